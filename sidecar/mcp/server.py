"""`sidecar mcp`: the sidecar as an MCP server, so an agent sees a few tools instead of all.

    tools/list  find_tool, call_tool, and the config's `keep_tools` (their real schemas)
    find_tool   the recommender's ranking over every live tool: full definitions
                (server__tool, description, inputSchema) with score and why
    call_tool   dispatch to the live server, record the call in the metrics store
                (latency, success, error); on failure an error result that carries
                `fallback_suggestions` from `Recommender.fallbacks`
    keep_tools  proxied the same way as call_tool

Built on the official SDK's low-level `Server`, so the schemas are served exactly as written.
Serves stdio (`serve_stdio`) or streamable HTTP (`serve_http`). At start every server is
connected and indexed in the background while the embedding model loads on its own thread
(which then does all embedding: reindexing and queries); find_tool waits for that, tools/list
and call_tool do not.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import mcp_types as types
from mcp.server.lowlevel import Server

from .. import __version__
from ..core.catalog import Catalog
from ..config import Config
from ..engine import Sidecar, open_history
from ..store.metrics import key_of
from ..store import Store
from ..serve.learner import apply_learned
from ..serve.telemetry import limit_blas_threads
from . import meta
from .calls import call_recorded, error, result
from .connections import ConnectionManager, ServerUnavailable, describe
from .live import LiveCatalog, go_live

log = logging.getLogger("sidecar.mcp")

INSTRUCTIONS = (
    "This server stands in for many MCP servers. Call find_tool with what you want to do to get the "
    "matching tools' definitions, then call_tool with one's name and arguments."
)


class MetaServer:
    """The MCP server's handlers over a `ConnectionManager` and the recommender."""

    def __init__(self, manager: ConnectionManager, cfg: Config, store: Store):
        self.manager, self.cfg, self.store = manager, cfg, store
        self.keep_tools = list(manager.options.keep_tools)
        self.metrics = open_history(cfg, store)  # calls are recorded while the model still loads
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sidecar-model")
        self.recommender = None
        self.live: LiveCatalog | None = None
        self._ready: asyncio.Future | None = None
        self.server: Server[Any] = Server(
            "sidecar", version=__version__, instructions=INSTRUCTIONS,
            on_list_tools=self._list_tools, on_call_tool=self._call_tool,
            get_tool_input_schema=self._input_schema,
        )  # fmt: skip

    # ---- life cycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Load the model and connect and index every server, in the background (once)."""
        if self._ready is None:
            self._ready = asyncio.ensure_future(self._prepare())

    async def ready(self) -> None:
        """Wait until the model is loaded and the first listing of every server is indexed
        (raises what went wrong)."""
        self.start()
        await asyncio.shield(self._ready)

    async def aclose(self) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.cancel()
        if self.live is not None:
            self.live.close()
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def _prepare(self) -> None:
        load = functools.partial(Sidecar.open, self.cfg, catalog=Catalog([]), store=self.store, progress=False, history=self.metrics)
        engine, self.live = await go_live(self.manager, load, self.executor)
        # what the store learned from traffic, as `serve --mcp-config` applies it over the same tools
        await asyncio.get_running_loop().run_in_executor(self.executor, apply_learned, engine)
        pipe = engine.pipeline
        self.recommender = engine.recommender
        log.info("ready: %d tools from %d server(s), model %s", len(pipe.catalog), len(self.manager.listings()), pipe.embedder.name)

    # ---- tools/list ------------------------------------------------------------------------
    async def exposed(self) -> list[dict[str, Any]]:
        """The meta-tools and the keep_tools, connecting their servers if need be."""
        for server in dict.fromkeys(key_of(None, name)[0] for name in self.keep_tools):
            try:
                await self.manager.list_tools(server)
            except ServerUnavailable as e:
                log.warning("keep_tools of %s left out of tools/list: %s", server, e)
        tools = meta.exposed_tools(self.manager.listings(), self.keep_tools)
        missing = set(self.keep_tools) - {t["name"] for t in tools}
        for server in dict.fromkeys(key_of(None, name)[0] for name in sorted(missing)):
            # a listing taken while the server was still starting may lack tools: ask again once
            with contextlib.suppress(ServerUnavailable):
                await self.manager.list_tools(server, refresh=True)
        if missing:
            tools = meta.exposed_tools(self.manager.listings(), self.keep_tools)
            missing = set(self.keep_tools) - {t["name"] for t in tools}
        if missing:
            log.warning("keep_tools not listed by their servers now: %s", ", ".join(sorted(missing)))
        return tools

    async def _list_tools(self, ctx: Any, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[types.Tool.model_validate(d) for d in await self.exposed()])

    def _input_schema(self, name: str) -> dict[str, Any] | None:
        """For the SDK's Mcp-Param header check: a served tool's schema, without listing."""
        served = {d["name"]: d for d in meta.META_TOOLS}
        if name in self.keep_tools:
            served = meta.all_tools(self.manager.listings())
        return served[name].get("inputSchema") if name in served else None

    # ---- tools/call ------------------------------------------------------------------------
    async def _call_tool(self, ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        args = params.arguments or {}
        if params.name == meta.FIND_TOOL:
            limit = args.get("limit")
            return await self.find_tool(args.get("query"), meta.DEFAULT_LIMIT if limit is None else limit)
        if params.name == meta.CALL_TOOL:
            name, arguments = args.get("name"), args.get("arguments") or {}
            if not isinstance(name, str) or not name:
                return error('call_tool needs "name": the tool\'s exact name as find_tool gave it')
            if not isinstance(arguments, dict):
                return error('call_tool\'s "arguments" must be an object', tool=name)
            return await self.call(name, arguments)
        if params.name == meta.ALTERNATIVES:
            name = args.get("name")
            if not isinstance(name, str) or name not in meta.all_tools(self.manager.listings()):
                return error(f"{meta.ALTERNATIVES} needs \"name\": a tool's exact name (server__tool), as find_tool gave it")
            return result({"tool": name, "alternatives": await self._fallbacks(name)})
        if params.name in self.keep_tools:
            return await self.call(params.name, args)
        return error(f"no tool named {params.name!r} here: find it with find_tool, then call it with call_tool")

    async def find_tool(self, query: Any, limit: Any = meta.DEFAULT_LIMIT) -> types.CallToolResult:
        if not isinstance(query, str) or not query.strip():
            return error('find_tool needs "query": what you want to do, in plain words')
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= meta.MAX_LIMIT:
            return error(f'find_tool\'s "limit" must be an integer from 1 to {meta.MAX_LIMIT}')
        try:
            await self.ready()
        except Exception as e:
            return error(f"the tool index is not available: {describe(e)}")
        ranked = await self._recommender("recommend", query, top=limit)
        every = meta.all_tools(self.manager.listings())
        tools = [{**every[r.tool], "score": round(r.score, 4), "why": r.why} for r in ranked.results if r.tool in every]
        return result({"query": query, "tools": tools})

    async def call(self, name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        """Call a server__tool on its live server, record the call, and on failure suggest
        fallbacks (calls.call_recorded)."""
        return await call_recorded(self.manager, self.metrics, name, arguments, self._fallbacks)

    async def _fallbacks(self, name: str) -> list[dict[str, Any]]:
        """Stand-ins for a failed tool, as full definitions with score and reason ([] while the
        index cannot be had)."""
        try:
            await self.ready()
        except Exception as e:
            log.warning("no fallback suggestions for %s: %s", name, describe(e))
            return []
        found = await self._recommender("fallbacks", name)
        every = meta.all_tools(self.manager.listings())
        return [{**every[f.tool], "score": f.score, "reason": f.reason} for f in found if f.tool in every]

    async def _recommender(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A recommender method, run on the model thread, with the servers failing now left out."""
        from ..recommend import Context

        context = Context(unavailable_servers=sorted(self.manager.unavailable()))
        call = functools.partial(getattr(self.recommender, method), *args, context=context, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self.executor, call)


# ---- transports --------------------------------------------------------------------------


async def serve_stdio(app: MetaServer) -> None:
    from mcp.server.stdio import stdio_server

    app.start()
    async with stdio_server() as (read, write):
        await app.server.run(read, write, app.server.create_initialization_options())


async def serve_http(app: MetaServer, host: str, port: int, announce: Callable[[str], None]) -> None:
    """Streamable HTTP at http://HOST:PORT/mcp until SIGINT or SIGTERM."""
    import uvicorn

    app.start()
    web = app.server.streamable_http_app(host=host)
    http = uvicorn.Server(uvicorn.Config(web, host=host, port=port, log_level="warning", lifespan="on"))
    # uvicorn re-raises the signal that stopped it once it is done: let SIGTERM end in our
    # own cleanup (closing the servers we spawned), not in the default handler's exit.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        serving = asyncio.ensure_future(http.serve())
        while not http.started and not serving.done():
            await asyncio.sleep(0.05)
        if http.started:
            bound = http.servers[0].sockets[0].getsockname()
            announce(f"MCP server (streamable HTTP) on http://{host}:{bound[1]}/mcp")
        await serving
    finally:
        signal.signal(signal.SIGTERM, previous)


async def run(config, cfg: Config, store: Store, *, http: tuple[str, int] | None = None,
              announce: Callable[[str], None] = lambda m: None) -> int:  # fmt: skip
    """Serve until the client hangs up (stdio) or a signal (HTTP); closes every server."""
    limit_blas_threads(cfg.model.blas_threads)  # no spinning BLAS thread on the event loop's core
    async with ConnectionManager(config) as manager:
        app = MetaServer(manager, cfg, store)
        try:
            if http is None:
                await serve_stdio(app)
            else:
                await serve_http(app, *http, announce)
        finally:
            await app.aclose()
    return 0


async def measure_savings(config, extra: dict[str, list[dict[str, Any]]] | None = None):
    """List every server of `config` (plus `extra` listings, e.g. catalog files) and count the
    tokens of all their schemas against what `sidecar mcp` lists."""
    from .savings import measure

    listings: dict[str, list[dict[str, Any]]] = {}
    unreachable: dict[str, str] = {}
    keep: list[str] = []
    if config is not None:
        keep = list(config.options.keep_tools)
        async with ConnectionManager(config) as manager:
            for name, err in (await manager.connect_all()).items():
                if err is not None:
                    unreachable[name] = err
            listings = manager.listings()
    every = [*meta.all_tools(listings).values(), *(d for defs in (extra or {}).values() for d in defs)]
    return measure(every, meta.exposed_tools(listings, keep), sources=[*listings, *(extra or {})], unreachable=unreachable)
