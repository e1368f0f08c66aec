"""`sidecar proxy`: the HTTP edge. An ASGI app served by uvicorn, talking to the upstream with
httpx2 (both already installed with the MCP SDK); everything it decides comes from the engine
(offer.py) and every shape from shapes.py.

    POST /v1/chat/completions   OpenAI: judged, tools added, forwarded; replies relayed (SSE or
                                JSON), the proxy's MCP tools run in bounded rounds
    POST /v1/messages           Anthropic: the same, in Anthropic's shapes (shapes.MESSAGES)
    POST /v1/messages/count_tokens, GET /v1/models    passed through
    GET  /metrics               Prometheus text (telemetry.ProxyMetrics)
    GET  /healthz               ok

The paths also answer without the /v1 prefix. A client that goes away cancels its request,
and so the upstream call (its connection is closed). `Authorization`, `x-api-key` and the
OpenAI-* and Anthropic-* headers are forwarded to the upstream; no header is ever logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx2
import orjson

from .. import __version__
from ..core.catalog import Catalog
from ..config import Config
from ..engine import Sidecar
from ..serve.completion import health, start_completion
from ..serve.learner import Learner
from ..mcp.config import McpConfig
from ..mcp.savings import schema_tokens
from ..store import Store
from ..serve.telemetry import CONTENT_TYPE, ProxyMetrics, limit_blas_threads
from ..learn.traffic import Turn
from ..serve.web import _hostname, _loopback
from . import search, shapes
from .offer import Judge, Narration, Offer

log = logging.getLogger("sidecar.proxy")

FORWARDED = ("authorization", "api-key", "x-api-key", "user-agent", "accept-language")
FORWARDED_PREFIXES = ("openai-", "anthropic-")  # openai-organization, anthropic-version, anthropic-beta, ...
JSON = "application/json"


class UpstreamError(Exception):
    """The upstream could not be reached (502) or went silent (504)."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code

    def body(self, dialect: shapes.Dialect) -> dict[str, Any]:
        return dialect.error(str(self), "upstream_error", code=self.code)


@dataclass(frozen=True)
class Target:
    """Where one request's upstream calls go: its API, the endpoint's URL, the client's headers."""

    dialect: shapes.Dialect
    url: str
    headers: dict[str, str]


class Refused(Exception):
    """The upstream answered with an error status: passed to the client as it is."""

    def __init__(self, status: int, body: bytes, content_type: str):
        super().__init__(status)
        self.status, self.content, self.content_type = status, body, content_type


class Proxy:
    """The ASGI app over one loaded engine."""

    def __init__(self, cfg: Config, engine: Sidecar, executor: ThreadPoolExecutor, *, live=None, manager=None):
        self.cfg, self.engine, self.executor, self.live, self.manager = cfg, engine, executor, live, manager
        self.opts = cfg.proxy
        self.base = (self.opts.upstream or "").rstrip("/")
        timeout = httpx2.Timeout(connect=self.opts.connect_timeout_s, read=self.opts.read_timeout_s, write=self.opts.read_timeout_s,
                                 pool=self.opts.connect_timeout_s)  # fmt: skip
        self.http = httpx2.AsyncClient(timeout=timeout, trust_env=False)
        self.metrics = ProxyMetrics()
        self.learner: Learner | None = None  # learning from traffic ([learn] traffic): set by ProxyServer
        self._counted: dict[str, tuple[Catalog, bytes, int]] = {}  # by dialect: the catalog, a digest of its schemas, their tokens

    async def aclose(self) -> None:
        await self.http.aclose()

    # ---- the whole catalog's schema tokens: what the proxy saves -----------------------------

    async def catalog_tokens(self, dialect: shapes.Dialect = shapes.CHAT) -> int:
        """Tokens of every catalog tool in `dialect`'s shape, counted once per catalog (the gauge
        shows OpenAI's function shape)."""
        catalog = self.engine.catalog
        counted = self._counted.get(dialect.name)
        if counted is None or counted[0] is not catalog:
            every = [dialect.tool(t.definition()) for t in catalog]
            digest = hashlib.blake2b(orjson.dumps(every), digest_size=16).digest()
            if counted is not None and counted[1] == digest:  # the same schemas (written cases added): no count, no wait
                tokens = counted[2]
            else:
                tokens = await asyncio.to_thread(schema_tokens, every)
            counted = self._counted[dialect.name] = (catalog, digest, tokens)
            if dialect is shapes.CHAT:
                self.metrics.catalog_tokens.set(tokens)
        return counted[2]

    # ---- ASGI --------------------------------------------------------------------------------

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path, method = scope["path"], scope["method"]
        route = path[3:] if path.startswith("/v1/") else path
        query = scope.get("query_string") or b""
        dialect = shapes.MESSAGES if route.startswith("/messages") else shapes.CHAT  # the shape of its errors
        host = headers.get("host")
        if host is not None and _loopback(self.opts.host) and not _loopback(_hostname(host)):
            return await _error(send, 421, f"host {host} is not this proxy: a loopback proxy answers only to a loopback name", "invalid_request_error",
                                dialect=dialect)  # fmt: skip
        if route == "/healthz" and method in ("GET", "HEAD"):
            return await _respond(send, 200, health(self.engine).encode(), "text/plain")
        if route == "/metrics" and method in ("GET", "HEAD"):
            return await _respond(send, 200, self.metrics.render(), CONTENT_TYPE)
        allowed = "GET" if route == "/models" or route.startswith("/models/") else "POST"
        if route not in ("/chat/completions", "/messages", "/messages/count_tokens") and allowed == "POST":
            return await _error(send, 404, f"no route {method} {path}: this proxy serves /v1/chat/completions, /v1/messages, "
                                "/v1/messages/count_tokens and /v1/models", "invalid_request_error", dialect=dialect)  # fmt: skip
        if method != allowed:
            return await _error(send, 405, f"method {method} is not allowed here: {allowed}", "invalid_request_error", dialect=dialect)
        raw = b""
        if method == "POST":
            raw = await _body(receive, self.opts.max_body_bytes)
            if raw is None:
                return await _error(send, 413, f"the request body is over proxy.max_body_bytes ({self.opts.max_body_bytes})", "invalid_request_error",
                                    code="request_too_large", dialect=dialect)  # fmt: skip
        if route in ("/chat/completions", "/messages"):
            work = self._converse(send, raw, headers, dialect, query)
        else:
            work = self._passed(send, method, route, query, raw, headers, dialect)
        return await self._guarded(receive, send, work)

    async def _guarded(self, receive: Callable, send: Callable, work) -> None:
        """Run `work` until it ends or the client goes away, which cancels it (and so the
        upstream call it waits on)."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
                self.metrics.cancelled.inc()
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _forwarded(self, headers: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in headers.items() if k in FORWARDED or k.startswith(FORWARDED_PREFIXES)}

    def _url(self, route: str, query: bytes = b"") -> str:
        return self.base + route + ("?" + query.decode("latin-1") if query else "")

    async def _passed(self, send: Callable, method: str, route: str, query: bytes, raw: bytes, headers: dict[str, str],
                      dialect: shapes.Dialect) -> None:  # fmt: skip
        """/models and /messages/count_tokens: the upstream's answer, as it is."""
        forwarded = self._forwarded(headers) | ({"content-type": JSON} if method == "POST" else {})
        try:
            resp = await self.http.request(method, self._url(route, query), content=raw or None, headers=forwarded)
        except httpx2.HTTPError as e:
            err = self._upstream_error(e)
            return await _respond(send, err.status, orjson.dumps(err.body(dialect)), JSON)
        await _respond(send, resp.status_code, resp.content, resp.headers.get("content-type", JSON))

    # ---- a conversation: chat completions or messages ----------------------------------------

    async def _converse(self, send: Callable, raw: bytes, headers: dict[str, str], dialect: shapes.Dialect, query: bytes = b"") -> None:
        try:
            body = dialect.parse(raw)
        except shapes.BadRequest as e:
            self.metrics.requests.labels(dialect.name, "unknown", "400").inc()
            return await _error(send, 400, str(e), "invalid_request_error", param=e.param, dialect=dialect)
        mode = "stream" if body.get("stream") else "whole"
        t0 = time.perf_counter()
        judge = Judge(self.cfg, self.engine, self.live, self.executor, agent=dialect.agent(body), dialect=dialect)
        target = Target(dialect, self._url(dialect.path, query), self._forwarded(headers))
        try:
            offer = await judge.offer(body)
        except Exception:  # fail open: the request goes upstream as the client sent it
            log.exception("judging a request failed; forwarding it without tools")
            offer = Offer()
        self.metrics.gate.observe(time.perf_counter() - t0)
        upstream = dialect.with_tools(body, offer.tools)
        try:
            if mode == "stream":
                resp = await self._open(upstream, target)
                self.metrics.requests.labels(dialect.name, mode, "200").inc()
                await send({"type": "http.response.start", "status": 200, "headers": _headers("text/event-stream", [(b"cache-control", b"no-cache")])})
                async for piece in self._relay(resp, upstream, target, offer, judge):
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                status, out = await self._whole(upstream, target, offer, judge)
                self.metrics.requests.labels(dialect.name, mode, str(status)).inc()
                await _respond(send, status, orjson.dumps(out), JSON)
        except UpstreamError as e:
            self.metrics.requests.labels(dialect.name, mode, str(e.status)).inc()
            await _respond(send, e.status, orjson.dumps(e.body(dialect)), JSON)
        except Refused as e:
            self.metrics.requests.labels(dialect.name, mode, str(e.status)).inc()
            await _respond(send, e.status, e.content, e.content_type)
        finally:  # counted once the request is on its way, not before it
            self._learn(body, judge)
            await self._count(offer, dialect)

    def _learn(self, body: dict[str, Any], judge: Judge) -> None:
        """A fresh user turn (the request ends with a user message) and the tools the model called
        in answer, or none: an example for learning from traffic. A request that ends with tool
        results continues a turn already recorded. A conversation (named by its first user
        message) is one session: its share of the examples is bounded."""
        messages = body.get("messages") or []
        turns = judge.dialect.user_turns(messages)
        if self.learner is None or not judge.dialect.fresh_turn(messages) or not turns:
            return
        vector = judge.vectors.get("user")
        if vector is not None:
            self.learner.add([Turn(turns[-1], vector, list(dict.fromkeys(judge.called)))], conversation_of(turns))

    async def _count(self, offer: Offer, dialect: shapes.Dialect) -> None:
        self.metrics.tools_added.observe(len(offer.names))  # catalog tools: find_tools is counted in the tokens only
        sent = schema_tokens(offer.tools)
        self.metrics.schema_tokens_sent.inc(sent)
        # counted in a thread the first time, and after the catalog's schemas changed
        self.metrics.schema_tokens_saved.inc(max(0, await self.catalog_tokens(dialect) - sent))

    def _upstream_error(self, e: Exception) -> UpstreamError:
        if isinstance(e, httpx2.TimeoutException) and not isinstance(e, (httpx2.ConnectTimeout, httpx2.PoolTimeout)):
            self.metrics.upstream_errors.labels("timeout").inc()
            return UpstreamError(504, "upstream_timeout", f"the upstream sent nothing for {self.opts.read_timeout_s:g} s (proxy.read_timeout_s)")
        self.metrics.upstream_errors.labels("unreachable").inc()
        return UpstreamError(502, "upstream_unreachable", f"the upstream at {self.base} cannot be reached: {type(e).__name__}: {e}")

    async def _open(self, body: dict[str, Any], target: Target) -> httpx2.Response:
        """A streamed upstream call, its status checked: raises UpstreamError or Refused."""
        request = self.http.build_request("POST", target.url, content=orjson.dumps(body),
                                          headers={**target.headers, "content-type": JSON, "accept": "text/event-stream"})  # fmt: skip
        try:
            resp = await self.http.send(request, stream=True)
        except httpx2.HTTPError as e:
            raise self._upstream_error(e) from None
        if resp.status_code != 200:
            try:
                content = await resp.aread()
            except httpx2.HTTPError as e:
                raise self._upstream_error(e) from None
            finally:
                await resp.aclose()
            self.metrics.upstream_errors.labels("status").inc()
            raise Refused(resp.status_code, content, resp.headers.get("content-type", JSON))
        return resp

    async def _post(self, body: dict[str, Any], target: Target) -> dict[str, Any]:
        try:
            resp = await self.http.post(target.url, content=orjson.dumps(body), headers={**target.headers, "content-type": JSON})
        except httpx2.HTTPError as e:
            raise self._upstream_error(e) from None
        if resp.status_code != 200:
            self.metrics.upstream_errors.labels("status").inc()
            raise Refused(resp.status_code, resp.content, resp.headers.get("content-type", JSON))
        try:
            out = orjson.loads(resp.content)
        except orjson.JSONDecodeError:
            self.metrics.upstream_errors.labels("invalid").inc()
            raise UpstreamError(502, "upstream_invalid", "the upstream's answer is not JSON") from None
        if (wrong := target.dialect.whole_error(out)) is not None:
            self.metrics.upstream_errors.labels("invalid").inc()
            raise UpstreamError(502, "upstream_invalid", wrong)
        return out

    async def _relay(self, resp: httpx2.Response, body: dict[str, Any], target: Target, offer: Offer, judge: Judge) -> AsyncIterator[bytes]:
        """The client's event stream over one or more upstream calls: the first reply's events
        as they come (the proxy's own tool calls held back), then, while the model calls only
        the proxy's tools, their results appended and the next reply; a narrated tool is
        annotated or restarts the call. One reply throughout (dialect.Stream), usage added up."""
        action = self.opts.on_narration
        rounds = restarts = 0
        dialect = target.dialect
        stream = dialect.Stream(body)
        while True:
            reply = stream.reply(offer.ours)
            narration = Narration(judge, f"reply-{rounds}-{restarts}", dialect.client_tool_names(body)) if action != "off" else None  # body: tools as sent
            restart: list = []
            reader = shapes.SSEReader()
            try:
                async for data in resp.aiter_bytes():
                    for ev in reader.feed(data):
                        before = len(reply.content)
                        try:
                            out, failed = stream.feed(reply, ev)
                        except shapes.NotAnEvent:  # skipped, counted
                            self.metrics.upstream_errors.labels("invalid").inc()
                            continue
                        for piece in out:
                            yield piece
                        if failed:  # the upstream failed mid-stream: the client was told so
                            return
                        if narration is not None and len(reply.content) > before:
                            narration.feed("".join(reply.content[before:]))
                    if narration is not None and (found := narration.take()):
                        for piece in stream.narrated([self._note(inj, dialect) for inj in found]):
                            yield piece
                        if action == "restart" and restarts < self.opts.max_restarts and dialect.adds_tools(body):
                            restart = found
                            break
            except httpx2.HTTPError as e:
                yield stream.error(self._upstream_error(e).body(dialect))
                return
            finally:
                await resp.aclose()
            if not reply.ended and not restart and reply.finish_reason is None:  # closed mid-reply: not an answer
                self.metrics.upstream_errors.labels("cut").inc()
                yield stream.error(dialect.error("the upstream's stream ended before its reply did", "upstream_error", code="upstream_cut"))
                return
            if narration is not None and not restart:
                found = await narration.end()
                for piece in stream.narrated([self._note(inj, dialect) for inj in found]):
                    yield piece
                if action == "restart" and restarts < self.opts.max_restarts and found and dialect.adds_tools(body):
                    restart = found
            stream.usage = shapes.add_usage(stream.usage, reply.usage)
            follow, rounds, restarts = await self._follow(reply, body, offer, judge, restart, rounds, restarts, shown=True)
            if follow is None:
                for piece in stream.finish(reply):
                    yield piece
                return
            for piece in stream.between(reply):
                yield piece
            body = follow
            try:
                resp = await self._open(body, target)
            except UpstreamError as e:
                yield stream.error(e.body(dialect))
                return
            except Refused as e:
                yield stream.error(dialect.refused(e.status, e.content))
                return

    async def _follow(self, reply: shapes.Answer, body: dict[str, Any], offer: Offer, judge: Judge, narrated: list, rounds: int,
                      restarts: int, *, shown: bool) -> tuple[dict[str, Any] | None, int, int]:  # fmt: skip
        """The body of the upstream call that follows `reply`, or None when `reply` is the last,
        with the rounds and restarts counted: a restart with the `narrated` tools (within
        max_restarts; the reply so far goes along when the client was `shown` it), else a round
        with the results of the proxy's calls (within max_tool_rounds)."""
        dialect = judge.dialect
        judge.called += [offer.names.get(c.name, c.name) for c in reply.calls.values() if c.name and not (c.name == search.FIND_TOOLS and c.ours)]
        messages = list(body["messages"])
        if narrated and restarts < self.opts.max_restarts:
            self.metrics.restarts.inc()
            added = judge.add(offer, [t.definition for inj in narrated for t in inj.tools], dialect.client_tool_names(body))
            partial = dialect.partial(reply.text) if shown else []
            return {**body, "tools": [*(body.get("tools") or ()), *added], "messages": messages + partial}, rounds, restarts + 1
        if reply.our_calls and not reply.client_calls and rounds < self.opts.max_tool_rounds:
            results = await self._run_calls(reply, offer, judge, body)
            follow = {**body, "messages": [*messages, *dialect.results(reply, results)]}
            follow = dialect.with_tools(follow, [t for t in offer.tools if t not in (body.get("tools") or ())])
            if offer.searchable and offer.searches >= self.opts.max_searches:  # searched enough: find_tools is no longer offered
                follow = without_tool(follow, dialect, search.FIND_TOOLS)
            return follow, rounds + 1, restarts
        return None, rounds, restarts

    def _note(self, inject, dialect: shapes.Dialect) -> dict[str, Any]:
        """What a narration annotation says of one inject (and counts it)."""
        self.metrics.narrations.labels(self.opts.on_narration).inc()
        return {"tier": inject.tier, "probability": inject.probability, "trigger": inject.trigger.text, "action": self.opts.on_narration,
                "tools": [dialect.tool(t.definition) for t in inject.tools]}  # fmt: skip

    async def _whole(self, body: dict[str, Any], target: Target, offer: Offer, judge: Judge) -> tuple[int, dict[str, Any]]:
        """A non-streamed request over one or more upstream calls (as `_relay`)."""
        action = self.opts.on_narration
        dialect = target.dialect
        rounds = restarts = 0
        usage = None
        notes: list[dict[str, Any]] = []
        earlier: list[shapes.Answer] = []  # the replies of the proxy's tool rounds (not those restarted)
        while True:
            out = await self._post(body, target)
            reply = dialect.Reply(offer.ours)
            reply.take_whole(out)
            usage = shapes.add_usage(usage, reply.usage)
            found = []
            if action != "off" and reply.text:
                narration = Narration(judge, f"reply-{rounds}-{restarts}", dialect.client_tool_names(body))
                narration.feed(reply.text)
                found = await narration.end()
                notes += [self._note(inj, dialect) for inj in found]
            narrated = found if action == "restart" and dialect.adds_tools(body) else []
            before = restarts
            follow, rounds, restarts = await self._follow(reply, body, offer, judge, narrated, rounds, restarts, shown=False)
            if follow is not None:
                earlier += [reply] if restarts == before else []
                body = follow
                continue
            out = dialect.answer(out, reply, earlier, usage)
            if notes:
                out["sidecar"] = {"narration": notes}
            return 200, out

    # ---- running the proxy's tools -----------------------------------------------------------

    async def _run_calls(self, reply: shapes.Answer, offer: Offer, judge: Judge, body: dict[str, Any]) -> list[tuple[shapes.Call, str, bool]]:
        """Run the model's calls of the proxy's MCP tools (concurrently), each recorded in the
        metrics store: (call, result, failed) each. A failure's result carries the error and the
        fallbacks, which are also offered for the next round."""
        taken = judge.dialect.client_tool_names(body)
        results = await asyncio.gather(*(self._search(c, offer, judge, taken) if c.name == search.FIND_TOOLS and offer.searchable
                                         else self._run(c, offer, judge.dialect.agent(body)) for c in reply.our_calls))  # fmt: skip
        for _, fallbacks, _ in results:
            judge.add(offer, fallbacks, judge.dialect.client_tool_names(body))
        return [(call, content, failed) for call, (content, _, failed) in zip(reply.our_calls, results)]

    async def _search(self, call: shapes.Call, offer: Offer, judge: Judge, taken: set[str]) -> tuple[str, list[dict[str, Any]], bool]:
        """A find_tools call, answered by the proxy: the found tools join `offer` (and so the
        next round's request); the model gets their names and one-line descriptions."""
        try:
            query = shapes.arguments_of(call).get("query")
        except ValueError:
            query = None
        content, outcome = await judge.find(offer, query, taken)
        self.metrics.find_tools.labels(outcome).inc()
        return content, [], outcome in ("limit", "bad_query")

    async def _run(self, call: shapes.Call, offer: Offer, agent: str | None) -> tuple[str, list[dict[str, Any]], bool]:
        from ..mcp.calls import call_recorded, text_of

        name = offer.names[call.name]
        try:
            arguments = shapes.arguments_of(call)
        except ValueError as e:
            self.metrics.mcp_calls.labels("bad_arguments").inc()
            return orjson.dumps({"error": str(e)}).decode(), [], True
        res = await call_recorded(self.manager, self.engine.history, name, arguments, self._fallbacks, agent=agent)
        self.metrics.mcp_calls.labels("error" if res.is_error else "ok").inc()
        limit = self.opts.max_tool_result_chars
        if res.is_error:
            payload = res.structured_content or {"error": text_of(res)}
            fallbacks = [{k: v for k, v in d.items() if k not in ("score", "reason")} for d in payload.get("fallback_suggestions") or ()]
            note = {"error": payload.get("error"), "tool": call.name,
                    "fallback_suggestions": [shapes.function_name(d["name"]) for d in fallbacks]}  # fmt: skip
            return orjson.dumps(note).decode()[:limit], fallbacks, True
        text = text_of(res)
        if not text and res.structured_content is not None:
            text = orjson.dumps(res.structured_content).decode()
        return text[:limit], [], False

    async def _fallbacks(self, name: str) -> list[dict[str, Any]]:
        """Live tools that could stand in for a failed one, as full definitions with score and reason."""
        from ..mcp import meta
        from ..recommend.filters import Context

        context = Context(unavailable_servers=sorted(self.manager.unavailable()))
        found = await asyncio.get_running_loop().run_in_executor(self.executor, lambda: self.engine.recommender.fallbacks(name, context))
        every = meta.all_tools(self.manager.listings())
        return [{**every[f.tool], "score": f.score, "reason": f.reason} for f in found if f.tool in every]


def without_tool(body: dict[str, Any], dialect: shapes.Dialect, name: str) -> dict[str, Any]:
    """`body` without the tool `name` (and without `tools` when none is left)."""
    tools = [t for t in body.get("tools") or () if dialect.tool_name(t) != name]
    return {**{k: v for k, v in body.items() if k != "tools"}, **({"tools": tools} if tools else {})}


def conversation_of(turns: list[str]) -> str:
    """A conversation's name, from its first user turn (an OpenAI request names none): the
    session its examples are kept under."""
    return f"proxy:{hashlib.sha256(turns[0].encode()).hexdigest()[:16]}"


async def _body(receive: Callable, limit: int) -> bytes | None:
    """The request body, or None past `limit` bytes."""
    parts, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":  # what is answered goes nowhere
            return None
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
        if not msg.get("more_body"):
            return b"".join(parts)


async def _disconnected(receive: Callable) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _headers(content_type: str, extra: list[tuple[bytes, bytes]] = ()) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", content_type.encode()), (b"server", f"sidecar/{__version__}".encode()), *extra]


async def _respond(send: Callable, status: int, content: bytes, content_type: str) -> None:
    await send({"type": "http.response.start", "status": status, "headers": _headers(content_type)})
    await send({"type": "http.response.body", "body": content, "more_body": False})


async def _error(send: Callable, status: int, message: str, kind: str, *, param: str | None = None, code: str | None = None,
                 dialect: shapes.Dialect = shapes.CHAT) -> None:  # fmt: skip
    await _respond(send, status, orjson.dumps(dialect.error(message, kind, param=param, code=code)), JSON)


# ---- serving -------------------------------------------------------------------------------------


class ProxyServer:
    """The engine loaded (with live MCP servers, connected and indexed), then the app served on
    `proxy.host:proxy.port` (0: any free port). `engine`: serve an already loaded one (tests)."""

    def __init__(self, cfg: Config, *, catalog: Catalog | None = None, store: Store | None = None, mcp: McpConfig | None = None,
                 engine: Sidecar | None = None, progress: bool = False):  # fmt: skip
        if not cfg.proxy.upstream:
            raise ValueError("no upstream: give --upstream URL (or proxy.upstream, env SIDECAR_UPSTREAM)")
        self.cfg, self.catalog, self.store, self.mcp, self.progress = cfg, catalog, store, mcp, progress
        self.engine = engine
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="sidecar-model")
        self.manager = None
        self.live = None
        self.app: Proxy | None = None
        self.http = None
        self._serving: asyncio.Task | None = None
        self._sock: socket.socket | None = None
        self.completion = None  # the tools and cases added after ready (serve/completion.py)

    async def start(self) -> None:
        """Bind (a busy port fails here, before anything loads), load, then serve: connections
        made while loading wait in the listen backlog."""
        from ..serve.server import open_engine

        sock = self._sock = _bind(self.cfg.proxy.host, self.cfg.proxy.port)
        loop = asyncio.get_running_loop()
        build = lambda: self.engine or open_engine(self.cfg, self.catalog, self.store, live=self.mcp is not None, progress=self.progress)  # noqa: E731
        if self.mcp is None:
            self.engine = await loop.run_in_executor(self.executor, build)
        else:
            from ..mcp.connections import ConnectionManager
            from ..mcp.live import go_live

            self.manager = ConnectionManager(self.mcp)
            self.manager.start()
            self.engine, self.live = await go_live(self.manager, build, self.executor)
        self.app = Proxy(self.cfg, self.engine, self.executor, live=self.live, manager=self.manager)
        if self.cfg.learn.traffic and self.engine.store is not None:
            self.app.learner = Learner(self.engine, self.cfg.learn)
            self.app.learner.refit()  # what earlier runs recorded, in the background
        self.completion = start_completion(self.engine, self.cfg, self.executor, None, upstream=self.cfg.proxy.upstream)
        for dialect in (shapes.CHAT, shapes.MESSAGES):
            await self.app.catalog_tokens(dialect)
        import uvicorn

        config = uvicorn.Config(self.app, host=self.cfg.proxy.host, port=self.cfg.proxy.port, log_level="warning", access_log=False,
                                lifespan="off", http="h11", ws="none", server_header=False,
                                timeout_graceful_shutdown=self.cfg.server.shutdown_timeout_s)  # fmt: skip
        self.http = uvicorn.Server(config)
        self.http.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]  (run() owns the signals)
        self._serving = asyncio.ensure_future(self.http.serve(sockets=[sock]))
        while not self.http.started:
            if self._serving.done():
                self._serving.result()
                raise OSError(f"cannot serve on {self.cfg.proxy.host}:{self.cfg.proxy.port}")
            await asyncio.sleep(0.02)

    @property
    def port(self) -> int:
        return self.http.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.cfg.proxy.host}:{self.port}/v1"

    async def shutdown(self) -> None:
        if self._sock is not None and self._serving is None:  # bound, never served (the load failed)
            self._sock.close()
        if self.http is not None:
            self.http.should_exit = True
            if self._serving is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._serving, self.cfg.server.shutdown_timeout_s)
        if self.app is not None:
            if self.app.learner is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.app.learner.drain(due=False), self.cfg.server.shutdown_timeout_s)
                self.app.learner.close()
            await self.app.aclose()
        if self.completion is not None:
            self.completion.close()
        if self.live is not None:
            self.live.close()
        if self.manager is not None:
            await self.manager.aclose()
        self.executor.shutdown(wait=False, cancel_futures=True)


def _bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (IPv4 or IPv6, as the host resolves); OSError names
    the address when it is taken."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    try:
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from None


async def run(cfg: Config, catalog: Catalog | None, store: Store, announce=print, mcp: McpConfig | None = None, progress: bool = True) -> int:
    """`sidecar proxy`: load, listen, serve until SIGTERM/SIGINT. Returns the exit status."""
    limit_blas_threads(cfg.model.blas_threads)  # no spinning BLAS thread on the event loop's core
    announce(f"loading {cfg.model.name}")
    server = ProxyServer(cfg, catalog=catalog, store=store, mcp=mcp, progress=progress)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        pipe = server.engine.pipeline
        announce(f"proxy listening on {server.url} (upstream {cfg.proxy.upstream}, model {pipe.embedder.name}, "
                 f"{len(pipe.catalog)} tools, store {store.location})")  # fmt: skip
        await stop.wait()
        announce("shutting down")
    finally:
        await server.shutdown()
        store.close()
    return 0
