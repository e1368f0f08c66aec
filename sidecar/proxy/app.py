"""`sidecar proxy`: the HTTP edge. An ASGI app served by uvicorn, talking to the upstream with
httpx2 (both already installed with the MCP SDK); everything it decides comes from the engine
(offer.py) and every shape from shapes.py.

    POST /v1/chat/completions   judged, tools added, forwarded; replies relayed (SSE or JSON),
                                the proxy's MCP tools run in bounded rounds
    GET  /v1/models             passed through
    GET  /metrics               Prometheus text (telemetry.ProxyMetrics)
    GET  /healthz               ok

The paths also answer without the /v1 prefix. A client that goes away cancels its request,
and so the upstream call (its connection is closed). `Authorization` and the OpenAI-* headers
are forwarded to the upstream; no header is ever logged.
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
from typing import Any

import httpx2
import orjson

from .. import __version__
from ..core.catalog import Catalog
from ..config import Config
from ..engine import Sidecar
from ..serve.learner import Learner
from ..mcp.config import McpConfig
from ..store import Store
from ..serve.telemetry import CONTENT_TYPE, ProxyMetrics, limit_blas_threads
from ..learn.traffic import Turn
from ..serve.web import _hostname, _loopback
from . import shapes
from .offer import Judge, Narration, Offer

log = logging.getLogger("sidecar.proxy")

FORWARDED = ("authorization", "api-key", "openai-organization", "openai-project", "openai-beta", "user-agent", "accept-language")
JSON = "application/json"


class UpstreamError(Exception):
    """The upstream could not be reached (502) or went silent (504)."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code

    def body(self) -> dict[str, Any]:
        return shapes.error_body(str(self), "upstream_error", code=self.code)


class Refused(Exception):
    """The upstream answered with an error status: passed to the client as it is."""

    def __init__(self, status: int, body: bytes, content_type: str):
        super().__init__(status)
        self.status, self.content, self.content_type = status, body, content_type


def _schema_tokens(tools: list[dict[str, Any]]) -> int:
    from ..mcp.savings import count_tokens

    return count_tokens(orjson.dumps(tools).decode()) if tools else 0


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
        self._counted: tuple[Catalog, int] | None = None

    async def aclose(self) -> None:
        await self.http.aclose()

    # ---- the whole catalog's schema tokens: what the proxy saves -----------------------------

    async def catalog_tokens(self) -> int:
        """Tokens of every catalog tool as OpenAI function tools, counted once per catalog."""
        catalog = self.engine.catalog
        if self._counted is None or self._counted[0] is not catalog:
            every = [shapes.function_tool(t.definition()) for t in catalog]
            self._counted = (catalog, await asyncio.to_thread(_schema_tokens, every))
            self.metrics.catalog_tokens.set(self._counted[1])
        return self._counted[1]

    # ---- ASGI --------------------------------------------------------------------------------

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path, method = scope["path"], scope["method"]
        route = path[3:] if path.startswith("/v1/") else path
        host = headers.get("host")
        if host is not None and _loopback(self.opts.host) and not _loopback(_hostname(host)):
            return await _error(send, 421, f"host {host} is not this proxy: a loopback proxy answers only to a loopback name", "invalid_request_error")
        if route == "/healthz" and method in ("GET", "HEAD"):
            return await _respond(send, 200, b"ok\n", "text/plain")
        if route == "/metrics" and method in ("GET", "HEAD"):
            return await _respond(send, 200, self.metrics.render(), CONTENT_TYPE)
        if route == "/models" or route.startswith("/models/"):
            if method != "GET":
                return await _error(send, 405, f"method {method} is not allowed here: GET", "invalid_request_error")
            return await self._guarded(receive, send, self._models(send, route, headers))
        if route == "/chat/completions":
            if method != "POST":
                return await _error(send, 405, f"method {method} is not allowed here: POST", "invalid_request_error")
            raw = await _body(receive, self.opts.max_body_bytes)
            if raw is None:
                return await _error(send, 413, f"the request body is over proxy.max_body_bytes ({self.opts.max_body_bytes})", "invalid_request_error")
            return await self._guarded(receive, send, self._chat(send, raw, headers))
        return await _error(send, 404, f"no route {method} {path}: this proxy serves /v1/chat/completions and /v1/models", "invalid_request_error")

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
        return {k: v for k, v in headers.items() if k in FORWARDED or k.startswith("openai-")}

    async def _models(self, send: Callable, route: str, headers: dict[str, str]) -> None:
        try:
            resp = await self.http.get(self.base + route, headers=self._forwarded(headers))
        except httpx2.HTTPError as e:
            err = self._upstream_error(e)
            return await _respond(send, err.status, orjson.dumps(err.body()), JSON)
        await _respond(send, resp.status_code, resp.content, resp.headers.get("content-type", JSON))

    # ---- chat completions --------------------------------------------------------------------

    async def _chat(self, send: Callable, raw: bytes, headers: dict[str, str]) -> None:
        try:
            body = shapes.parse_request(raw)
        except shapes.BadRequest as e:
            self.metrics.requests.labels("unknown", "400").inc()
            return await _error(send, 400, str(e), "invalid_request_error", param=e.param)
        mode = "stream" if body.get("stream") else "whole"
        t0 = time.perf_counter()
        judge = Judge(self.cfg, self.engine, self.live, self.executor, agent=body.get("user") if isinstance(body.get("user"), str) else None)
        try:
            offer = await judge.offer(body)
        except Exception:  # fail open: the request goes upstream as the client sent it
            log.exception("judging a request failed; forwarding it without tools")
            offer = Offer()
        self.metrics.gate.observe(time.perf_counter() - t0)
        upstream = shapes.with_tools(body, offer.tools)
        forwarded = self._forwarded(headers)
        try:
            if mode == "stream":
                resp = await self._open(upstream, forwarded)
                self.metrics.requests.labels(mode, "200").inc()
                await send({"type": "http.response.start", "status": 200, "headers": _headers("text/event-stream", [(b"cache-control", b"no-cache")])})
                async for piece in self._relay(resp, upstream, forwarded, offer, judge):
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                status, out = await self._whole(upstream, forwarded, offer, judge)
                self.metrics.requests.labels(mode, str(status)).inc()
                await _respond(send, status, orjson.dumps(out), JSON)
        except UpstreamError as e:
            self.metrics.requests.labels(mode, str(e.status)).inc()
            await _respond(send, e.status, orjson.dumps(e.body()), JSON)
        except Refused as e:
            self.metrics.requests.labels(mode, str(e.status)).inc()
            await _respond(send, e.status, e.content, e.content_type)
        finally:  # counted once the request is on its way, not before it
            await self._count(offer)
            self._learn(body, judge)

    def _learn(self, body: dict[str, Any], judge: Judge) -> None:
        """A fresh user turn (the request ends with a user message) and the tools the model called
        in answer, or none: an example for learning from traffic. A request that ends with tool
        results continues a turn already recorded. A conversation (named by its first user
        message) is one session: its share of the examples is bounded."""
        messages = body.get("messages") or []
        turns = shapes.user_turns(messages)
        if self.learner is None or not messages or messages[-1].get("role") != "user" or not turns:
            return
        vector = judge.vectors.get("user")
        if vector is not None:
            self.learner.add([Turn(turns[-1], vector, list(dict.fromkeys(judge.called)))], conversation_of(turns))

    async def _count(self, offer: Offer) -> None:
        self.metrics.tools_added.observe(len(offer.tools))
        sent = _schema_tokens(offer.tools)
        self.metrics.schema_tokens_sent.inc(sent)
        self.metrics.schema_tokens_saved.inc(max(0, await self.catalog_tokens() - sent))

    def _upstream_error(self, e: Exception) -> UpstreamError:
        if isinstance(e, httpx2.TimeoutException) and not isinstance(e, (httpx2.ConnectTimeout, httpx2.PoolTimeout)):
            self.metrics.upstream_errors.labels("timeout").inc()
            return UpstreamError(504, "upstream_timeout", f"the upstream sent nothing for {self.opts.read_timeout_s:g} s (proxy.read_timeout_s)")
        self.metrics.upstream_errors.labels("unreachable").inc()
        return UpstreamError(502, "upstream_unreachable", f"the upstream at {self.base} cannot be reached: {type(e).__name__}: {e}")

    async def _open(self, body: dict[str, Any], headers: dict[str, str]) -> httpx2.Response:
        """A streamed upstream call, its status checked: raises UpstreamError or Refused."""
        request = self.http.build_request("POST", self.base + "/chat/completions", content=orjson.dumps(body),
                                          headers={**headers, "content-type": JSON, "accept": "text/event-stream"})  # fmt: skip
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

    async def _post(self, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        try:
            resp = await self.http.post(self.base + "/chat/completions", content=orjson.dumps(body), headers={**headers, "content-type": JSON})
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
        if not isinstance(out, dict) or not isinstance(out.get("choices"), list) or not out["choices"]:
            self.metrics.upstream_errors.labels("invalid").inc()
            raise UpstreamError(502, "upstream_invalid", "the upstream's answer has no choices")
        return out

    async def _relay(self, resp: httpx2.Response, body: dict[str, Any], headers: dict[str, str], offer: Offer,
                     judge: Judge) -> AsyncIterator[bytes]:  # fmt: skip
        """The client's event stream over one or more upstream calls: the first reply's chunks
        as they come (the proxy's own tool calls held back), then, while the model calls only
        the proxy's tools, their results appended and the next reply; a narrated tool is
        annotated or restarts the call. One completion id throughout; usage added up."""
        action = self.opts.on_narration
        rounds = restarts = 0
        usage = None
        first_id = None
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        while True:
            reply = shapes.Reply(offer.ours)
            narration = Narration(judge, f"reply-{rounds}-{restarts}", shapes.client_tool_names(body)) if action != "off" else None  # body: tools as sent
            restart: list = []
            reader = shapes.SSEReader()
            ended = False  # [DONE] seen
            try:
                async for data in resp.aiter_bytes():
                    for ev in reader.feed(data):
                        if ev.data is not None and ev.data.strip() == "[DONE]":
                            ended = True
                        if ev.data is None or ended:
                            continue
                        try:
                            chunk = orjson.loads(ev.data)
                        except orjson.JSONDecodeError:
                            chunk = None
                        if not isinstance(chunk, dict):  # not a chunk: skipped, counted
                            self.metrics.upstream_errors.labels("invalid").inc()
                            continue
                        if "error" in chunk:  # the upstream failed mid-stream: the client is told so
                            yield shapes.sse(chunk)
                            return
                        first_id = first_id or chunk.get("id")
                        before = len(reply.content)
                        out = reply.feed(chunk)
                        if out is not None:
                            yield shapes.sse({**out, "id": first_id})
                        if narration is not None and len(reply.content) > before:
                            narration.feed("".join(reply.content[before:]))
                    if narration is not None and (found := narration.take()):
                        for piece in self._narrated(found, first_id, body.get("model")):
                            yield piece
                        if action == "restart" and restarts < self.opts.max_restarts:
                            restart = found
                            break
            except httpx2.HTTPError as e:
                yield shapes.sse(self._upstream_error(e).body())
                return
            finally:
                await resp.aclose()
            if not ended and not restart and reply.finish_reason is None:  # closed mid-reply: not an answer
                self.metrics.upstream_errors.labels("cut").inc()
                yield shapes.sse(shapes.error_body("the upstream's stream ended before its reply did", "upstream_error", code="upstream_cut"))
                return
            if narration is not None and not restart:
                found = await narration.end()
                for piece in self._narrated(found, first_id, body.get("model")):
                    yield piece
                if action == "restart" and restarts < self.opts.max_restarts and found:
                    restart = found
            usage = shapes.add_usage(usage, reply.usage)
            follow, rounds, restarts = await self._follow(reply, body, offer, judge, restart, rounds, restarts, shown=True)
            if follow is None:
                finish = reply.finish_chunk or {"id": first_id, "object": "chat.completion.chunk", "created": int(time.time()),
                                                "model": body.get("model"), "choices": [{"index": 0, "delta": {}, "finish_reason": None}]}  # fmt: skip
                choices = [{**c, "finish_reason": reply.client_finish() or "stop"} if c.get("index", 0) == 0 else c for c in finish["choices"]]
                yield shapes.sse({**finish, "id": first_id, "choices": choices})
                if include_usage and usage is not None:
                    yield shapes.sse({"id": first_id, "object": "chat.completion.chunk", "created": finish.get("created"),
                                      "model": finish.get("model"), "choices": [], "usage": usage})  # fmt: skip
                yield shapes.sse("[DONE]")
                return
            body = follow
            try:
                resp = await self._open(body, headers)
            except UpstreamError as e:
                yield shapes.sse(e.body())
                return
            except Refused as e:
                yield shapes.sse(_refused_body(e))
                return

    async def _follow(self, reply: shapes.Reply, body: dict[str, Any], offer: Offer, judge: Judge, narrated: list, rounds: int,
                      restarts: int, *, shown: bool) -> tuple[dict[str, Any] | None, int, int]:  # fmt: skip
        """The body of the upstream call that follows `reply`, or None when `reply` is the last,
        with the rounds and restarts counted: a restart with the `narrated` tools (within
        max_restarts; the reply so far goes along when the client was `shown` it), else a round
        with the results of the proxy's calls (within max_tool_rounds)."""
        judge.called += [offer.names.get(c.name, c.name) for c in reply.calls.values() if c.name]
        messages = list(body["messages"])
        if narrated and restarts < self.opts.max_restarts:
            self.metrics.restarts.inc()
            added = judge.add(offer, [t.definition for inj in narrated for t in inj.tools], shapes.client_tool_names(body))
            partial = [{"role": "assistant", "content": reply.text}] if shown and reply.text else []
            return {**body, "tools": [*(body.get("tools") or ()), *added], "messages": messages + partial}, rounds, restarts + 1
        if reply.our_calls and not reply.client_calls and rounds < self.opts.max_tool_rounds:
            results = await self._run_calls(reply, offer, judge, body)
            follow = {**body, "messages": [*messages, reply.assistant_message(), *results]}
            return shapes.with_tools(follow, [t for t in offer.tools if t not in (body.get("tools") or ())]), rounds + 1, restarts
        return None, rounds, restarts

    def _note(self, inject) -> dict[str, Any]:
        """What a narration annotation says of one inject (and counts it)."""
        self.metrics.narrations.labels(self.opts.on_narration).inc()
        return {"tier": inject.tier, "probability": inject.probability, "trigger": inject.trigger.text, "action": self.opts.on_narration,
                "tools": [shapes.function_tool(t.definition) for t in inject.tools]}  # fmt: skip

    def _narrated(self, found: list, completion_id: str | None, model: str | None) -> list[bytes]:
        """The annotation of narrated tools in a stream: an SSE comment and a chunk with no
        choice whose `sidecar.narration` names them (a client that wants to decide reads it)."""
        out = []
        for inj in found:
            note = self._note(inj)
            out.append(shapes.sse_comment(f"sidecar narration: {', '.join(t['function']['name'] for t in note['tools'])}"))
            out.append(shapes.sse({"id": completion_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                                   "choices": [], "sidecar": {"narration": note}}))  # fmt: skip
        return out

    async def _whole(self, body: dict[str, Any], headers: dict[str, str], offer: Offer, judge: Judge) -> tuple[int, dict[str, Any]]:
        """A non-streamed request over one or more upstream calls (as `_relay`)."""
        action = self.opts.on_narration
        rounds = restarts = 0
        usage = None
        notes: list[dict[str, Any]] = []
        while True:
            out = await self._post(body, headers)
            choice = out["choices"][0]
            reply = shapes.Reply(offer.ours)
            message = reply.take_message(choice.get("message") or {}, choice.get("finish_reason"), out.get("usage"))
            usage = shapes.add_usage(usage, reply.usage)
            found = []
            if action != "off" and reply.text:
                narration = Narration(judge, f"reply-{rounds}-{restarts}", shapes.client_tool_names(body))
                narration.feed(reply.text)
                found = await narration.end()
                notes += [self._note(inj) for inj in found]
            follow, rounds, restarts = await self._follow(reply, body, offer, judge, found if action == "restart" else [], rounds, restarts,
                                                          shown=False)  # fmt: skip
            if follow is not None:
                body = follow
                continue
            out["choices"] = [{**choice, "message": message, "finish_reason": reply.client_finish()}, *out["choices"][1:]]
            if usage is not None:
                out["usage"] = usage
            if notes:
                out["sidecar"] = {"narration": notes}
            return 200, out

    # ---- running the proxy's tools -----------------------------------------------------------

    async def _run_calls(self, reply: shapes.Reply, offer: Offer, judge: Judge, body: dict[str, Any]) -> list[dict[str, Any]]:
        """Run the model's calls of the proxy's MCP tools (concurrently), each recorded in the
        metrics store; a failure is a tool message carrying the error and the fallbacks, which
        are also offered for the next round."""
        agent = body.get("user") if isinstance(body.get("user"), str) else None
        results = await asyncio.gather(*(self._run(c, offer, agent) for c in reply.our_calls))
        messages = []
        for call, (content, fallbacks) in zip(reply.our_calls, results):
            messages.append(shapes.tool_message(call.id, content))
            judge.add(offer, fallbacks, shapes.client_tool_names(body))
        return messages

    async def _run(self, call: shapes.Call, offer: Offer, agent: str | None) -> tuple[str, list[dict[str, Any]]]:
        from ..mcp.calls import call_recorded, text_of

        name = offer.names[call.name]
        try:
            arguments = shapes.arguments_of(call)
        except ValueError as e:
            self.metrics.mcp_calls.labels("bad_arguments").inc()
            return orjson.dumps({"error": str(e)}).decode(), []
        res = await call_recorded(self.manager, self.engine.history, name, arguments, self._fallbacks, agent=agent)
        self.metrics.mcp_calls.labels("error" if res.is_error else "ok").inc()
        limit = self.opts.max_tool_result_chars
        if res.is_error:
            payload = res.structured_content or {"error": text_of(res)}
            fallbacks = [{k: v for k, v in d.items() if k not in ("score", "reason")} for d in payload.get("fallback_suggestions") or ()]
            note = {"error": payload.get("error"), "tool": call.name,
                    "fallback_suggestions": [shapes.function_name(d["name"]) for d in fallbacks]}  # fmt: skip
            return orjson.dumps(note).decode()[:limit], fallbacks
        text = text_of(res)
        if not text and res.structured_content is not None:
            text = orjson.dumps(res.structured_content).decode()
        return text[:limit], []

    async def _fallbacks(self, name: str) -> list[dict[str, Any]]:
        """Live tools that could stand in for a failed one, as full definitions with score and reason."""
        from ..mcp import meta
        from ..recommend.filters import Context

        context = Context(unavailable_servers=sorted(self.manager.unavailable()))
        found = await asyncio.get_running_loop().run_in_executor(self.executor, lambda: self.engine.recommender.fallbacks(name, context))
        every = meta.all_tools(self.manager.listings())
        return [{**every[f.tool], "score": f.score, "reason": f.reason} for f in found if f.tool in every]


def conversation_of(turns: list[str]) -> str:
    """A conversation's name, from its first user turn (an OpenAI request names none): the
    session its examples are kept under."""
    return f"proxy:{hashlib.sha256(turns[0].encode()).hexdigest()[:16]}"


def _refused_body(e: Refused) -> dict[str, Any]:
    try:
        body = orjson.loads(e.content)
        if isinstance(body, dict) and "error" in body:
            return body
    except orjson.JSONDecodeError:
        pass
    return shapes.error_body(f"the upstream answered {e.status}", "upstream_error", code=str(e.status))


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


async def _error(send: Callable, status: int, message: str, kind: str, *, param: str | None = None) -> None:
    await _respond(send, status, orjson.dumps(shapes.error_body(message, kind, param=param)), JSON)


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
        await self.app.catalog_tokens()
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
