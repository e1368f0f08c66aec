"""The bridge from live tool lists to the pipeline's index.

`LiveCatalog` listens to a `ConnectionManager`; whenever a server's tool list changes (its
first listing included) it rebuilds the merged `Catalog` (tools named `server__tool`) and
calls `Pipeline.reindex`, which embeds only tools whose content hash changed, and logs the
added / updated / removed / unchanged counts. Reindexing runs off the event loop, on the
executor given (the server's model thread, so embeddings never race), else the loop's
default one. `call("server__tool", arguments)` dispatches through the manager.

`unavailable()` names the indexed servers that are not connected now (lost, failed, or
reconnecting), whose tools must not be handed out; asking is also the demand that brings a
failed server back: one reconnect at a time per server, through the manager's backoff and
circuit breaker (an open circuit fails fast and spawns nothing). `go_live` is how a server
starts on live tools: connect every server while the model loads, then index what they list.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import msgspec

from ..core.catalog import SEP, Catalog, CatalogError, Tool, parse_tools
from ..core.index import IndexStats
from .connections import ConnectionManager, ServerUnavailable
from .state import State, ToolDiff

if TYPE_CHECKING:
    from ..engine import Sidecar

log = logging.getLogger("sidecar.mcp")


def build_catalog(listings: Mapping[str, Sequence[Mapping[str, Any]]], base: Catalog | None = None) -> Catalog:
    """`base`'s tools, then every server's live tools named server__tool. A tool the
    catalog cannot take (no name, ill-typed fields) is skipped with a warning; a live tool
    replaces a base tool of the same name."""
    tools: dict[str, Tool] = {t.name: t for t in base} if base is not None else {}
    for server, defs in listings.items():
        for raw in defs:
            try:
                _, parsed = parse_tools({"tools": [dict(raw)]}, f"MCP server {server!r}")
            except CatalogError as e:
                log.warning("skipping a tool: %s", e)
                continue
            tool = parsed[0]
            name = f"{server}{SEP}{tool.name}"
            tools[name] = msgspec.structs.replace(tool, name=name, server=server)
    sources = [*(base.sources if base is not None else ()), *(f"mcp:{s}" for s in listings)]
    return Catalog(tools.values(), sources)


def _signature(catalog: Catalog) -> tuple[tuple[str, str], ...]:
    return tuple((t.name, t.content_hash) for t in catalog)


def _servers(catalog: Catalog, live: Sequence[str]) -> frozenset[str]:
    """The live servers that have tools in `catalog`."""
    names = set(live)
    return frozenset(t.server for t in catalog if t.server in names)


class LiveCatalog:
    """Keeps `pipeline`'s index in step with the servers' live tool lists."""

    def __init__(self, manager: ConnectionManager, pipeline: Any, *, base: Catalog | None = None, executor: Executor | None = None,
                 indexer: Executor | None = None):  # fmt: skip
        self.manager, self.pipeline, self.base, self.executor = manager, pipeline, base, executor
        self.indexer = indexer  # where a change's new texts are embedded first, on the model's second context (None: not)
        self.history: list[IndexStats] = []  # one per reindex that ran
        self._synced = _signature(pipeline.catalog)
        self._indexed = _servers(pipeline.catalog, manager.names)  # swapped whole: read from any thread
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self._dirty = False
        self._unsubscribe = manager.on_tools_changed(self._changed)
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._reviving: dict[str, asyncio.Task] = {}
        self._revive_due = False

    def catalog(self) -> Catalog:
        """The merged catalog as the servers list their tools now."""
        return build_catalog(self.manager.listings(), self.base)

    async def sync(self) -> IndexStats | None:
        """Reindex if the live catalog differs from the indexed one; returns the index's
        stats (None when nothing changed)."""
        async with self._lock:
            catalog = self.catalog()
            signature = _signature(catalog)
            if signature == self._synced:
                return None
            loop = asyncio.get_running_loop()
            if self.indexer is not None:  # embedded first beside the judging, into the store: the reindex then finds every vector there
                await loop.run_in_executor(self.indexer, self.pipeline.with_catalog, catalog, True, True)  # (the copy is dropped)
            built = await loop.run_in_executor(self.executor, self.pipeline.reindex, catalog)
            self._synced = signature
            self._indexed = _servers(catalog, self.manager.names)
            stats = [ix.stats for ix in built.values() if ix.stats is not None]
            if not stats:
                return None
            s = msgspec.structs.replace(
                stats[0], embedded=sum(x.embedded for x in stats), cached=sum(x.cached for x in stats),
                seconds=sum(x.seconds for x in stats),
            )  # fmt: skip
            self.history.append(s)
            servers = len(self.manager.listings())
            log.info("live catalog: %d tools from %d server(s): %d added, %d updated, %d removed, %d unchanged; "
                     "embedded %d texts (%d cached) in %.2f s", s.tools, servers, s.added, s.updated, s.removed,
                     s.unchanged, s.embedded, s.cached, s.seconds)  # fmt: skip
            return s

    async def settled(self) -> None:
        """Wait until changes announced so far are indexed."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    def unavailable(self) -> frozenset[str]:
        """Indexed servers not connected now: their tools are withheld (the recommender's
        `Context.unavailable_servers`). Called from the model and store threads too: it only
        reads each server's state, and hands bringing failed servers back to the loop."""
        down = frozenset(s for s in self._indexed if self.manager.state(s) != State.CONNECTED)
        loop = self._loop
        if loop is not None and not self._revive_due and (down or self.manager.unavailable()):
            self._revive_due = True  # one wake-up of the loop per batch of asks, not one per span
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing to bring back
                loop.call_soon_threadsafe(self._revive)
        return down

    def _revive(self) -> None:
        """Reconnect each failed server whose circuit allows an attempt, one connect cycle at
        a time (the manager's backoff). A server back with other tools is reindexed through
        the usual tools-changed path."""
        self._revive_due = False
        if self._loop is None:
            return
        for s in self.manager.status():
            task = self._reviving.get(s.name)
            if s.state == State.FAILED and not s.retry_in and (task is None or task.done()):
                self._reviving[s.name] = asyncio.ensure_future(self._reconnect(s.name))

    async def _reconnect(self, name: str) -> None:
        with contextlib.suppress(ServerUnavailable):
            await self.manager.ensure(name)
            log.info("%s: reconnected; its tools are offered again", name)

    async def call(self, name: str, arguments: dict[str, Any] | None = None, *, timeout: float | None = None):
        """Call a catalog tool by its server__tool name through the connection manager."""
        tool = self.pipeline.catalog.get(name)
        if tool is None or tool.server is None or tool.server not in self.manager.names:
            raise ValueError(f"{name!r} is not a tool of a live MCP server")
        return await self.manager.call(tool.server, tool.bare_name, arguments, timeout=timeout)

    def close(self) -> None:
        self._unsubscribe()
        self._loop = None
        for task in [self._task, *self._reviving.values()]:
            if task is not None:
                task.cancel()

    def _changed(self, server: str, change: ToolDiff) -> None:
        # Listeners must not hold up the listing: reindex in a task, coalescing bursts.
        self._dirty = True
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while self._dirty:
            self._dirty = False
            try:
                await self.sync()
            except Exception:
                log.exception("live catalog: reindexing failed; the previous index stays in use")


async def go_live(manager: ConnectionManager, load: Callable[[], Sidecar], executor: Executor,
                  indexer: Executor | None = None) -> tuple[Sidecar, LiveCatalog]:  # fmt: skip
    """Connect every server while `load` builds the engine on `executor` (the model thread),
    then index their tools beside the engine's own catalog. Returns once each server's first
    connect cycle has ended (connected or failed: a failed one is logged, and indexed when it
    comes back) and its tools are indexed; `load`'s error is raised. `indexer`: where later
    changes are embedded first, beside the judging (the first index is built before any)."""
    connecting = asyncio.ensure_future(manager.connect_all())
    try:
        engine = await asyncio.get_running_loop().run_in_executor(executor, load)
        live = LiveCatalog(manager, engine.pipeline, base=engine.catalog, executor=executor)
        for name, err in (await connecting).items():
            if err is not None:
                log.warning("%s: not indexed: %s", name, err)
    finally:
        connecting.cancel()  # a no-op once it is done
    await live.sync()
    await live.settled()
    live.indexer = indexer
    return engine, live
