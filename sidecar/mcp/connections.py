"""Live connections to the configured MCP servers, one asyncio task per connection.

`ConnectionManager` connects lazily: a server is spawned (stdio) or reached (HTTP) on the
first `ensure`/`list_tools`/`call` that needs it, or at `start` for `preconnect_servers`.
Each connect cycle is one attempt plus `max_connection_retries` retries after 1, 2, 4 ...
s, every attempt bounded by `connection_timeout`; a failed cycle opens the server's circuit
(`state.Breaker`) and calls fail fast with `ServerUnavailable` until it allows a trial.

A connection lives in its own task (the SDK's anyio scopes must be entered and left by one
task) that holds `mcp.Client` open until `aclose`, or until the server goes away: then the
server is `failed`, its last tool list is kept, the next demand reconnects, and nothing
else is disturbed. Tool lists are read whole (following `nextCursor`) on connect and again
on `notifications/tools/list_changed` (a plain notification on handshake-era connections,
a `subscriptions/listen` stream on 2026-07-28 ones); listeners get the per-server diff.

`call(server, tool, arguments)` is the dispatch path for the sidecar's own MCP server.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import mcp
import mcp_types
import msgspec
from mcp.client.stdio import stdio_client
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from .. import __version__
from .config import McpConfig, ServerSpec
from .state import Breaker, State, ToolDiff, diff, schema_hash

log = logging.getLogger("sidecar.mcp")

MAX_PAGES = 1000  # tools/list pages per listing before the server is judged broken
CLOSE_TIMEOUT = 10.0  # waiting for one connection task to wind down (stdio: up to ~6 s)
STDERR_TAIL = 4096  # bytes of a stdio server's stderr kept for error messages

ToolsListener = Callable[[str, ToolDiff], Awaitable[None] | None]


class ServerUnavailable(RuntimeError):
    """A server cannot be used now: its connect cycle failed, its circuit is open, or its
    connection was lost mid-call. `retry_in`: seconds until the circuit allows a trial."""

    def __init__(self, server: str, reason: str | None, retry_in: float | None = None):
        self.server, self.reason, self.retry_in = server, reason, retry_in
        msg = f"MCP server {server!r} is unavailable: {reason or 'unknown error'}"
        if retry_in:
            msg += f" (failing fast; next attempt allowed in {retry_in:.0f} s)"
        super().__init__(msg)


class ServerStatus(msgspec.Struct):
    """What `sidecar servers` shows for one server."""

    name: str
    state: str
    tools: int | None  # tools in the last listing (None: never listed)
    connected_at: str | None  # ISO 8601 UTC, of the live connection
    last_error: str | None
    tools_changed_at: str | None  # the last listing that differed from the one before
    transport: str
    protocol_version: str | None = None
    retry_in: float | None = None  # the circuit is open: seconds until a trial is allowed


def _iso(ts: float | None) -> str | None:
    return None if ts is None else dt.datetime.fromtimestamp(ts, dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _leaves(e: BaseException) -> list[BaseException]:
    if isinstance(e, BaseExceptionGroup):
        return [leaf for sub in e.exceptions for leaf in _leaves(sub)]
    return [e]


def describe(e: BaseException, timeout: float | None = None) -> str:
    """One line for `last_error`."""
    leaves = [x for x in _leaves(e) if not isinstance(x, asyncio.CancelledError)] or [e]
    x = leaves[0]
    if isinstance(x, (TimeoutError, asyncio.TimeoutError)):
        return f"timed out after {timeout:g} s" if timeout else "timed out"
    if isinstance(x, FileNotFoundError):
        return f"command not found: {x.filename or x}"
    if isinstance(x, PermissionError):
        return f"cannot run the command: {x.filename or x} ({x.strerror})"
    if isinstance(x, MCPError):
        if x.error.code == mcp_types.CONNECTION_CLOSED:
            return "the server closed the connection (did it exit?)"
        return f"{x.error.message} (MCP error {x.error.code})"
    text = str(x).strip()
    return f"{type(x).__name__}: {text}" if text else type(x).__name__


def _transport_failure(e: BaseException) -> bool:
    """Did this exception come from the connection itself (rather than the server's answer)?"""
    for x in _leaves(e):
        if isinstance(x, MCPError):
            if x.error.code == mcp_types.CONNECTION_CLOSED:
                return True
        elif isinstance(x, (OSError, EOFError, anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream)):
            return True
        elif type(x).__module__.startswith(("httpx", "httpcore")):
            return True
    return False


class _Tail(asyncio.Protocol):
    """The last bytes a stdio server wrote to stderr."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.closed = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        del self.buf[:-STDERR_TAIL]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def text(self, limit: int = 300) -> str:
        lines = [ln.strip() for ln in self.buf.decode("utf-8", "replace").splitlines() if ln.strip()]
        out = " | ".join(lines[-3:])
        return out if len(out) <= limit else "..." + out[-limit:]


class _EofWatch:
    """A transport's read stream that reports its end (the server exited or hung up)."""

    def __init__(self, inner: Any, on_eof: Callable[[], None]):
        self._inner, self._on_eof = inner, on_eof

    async def receive(self) -> Any:
        try:
            return await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._on_eof()
            raise

    def __aiter__(self) -> _EofWatch:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> _EofWatch:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._inner.__aexit__(*exc)

    def __getattr__(self, name: str) -> Any:  # e.g. last_context
        return getattr(self._inner, name)


@asynccontextmanager
async def _watched(inner: Any, on_eof: Callable[[], None]):
    async with inner as (read, write):
        yield _EofWatch(read, on_eof), write


@asynccontextmanager
async def _http(spec: ServerSpec):
    import httpx2

    timeout = httpx2.Timeout(30.0, read=300.0)
    if spec.transport == "sse":
        from mcp.client.sse import sse_client

        async with sse_client(spec.url, headers=spec.headers or None) as streams:
            yield streams
        return
    from mcp.client.streamable_http import streamable_http_client

    async with httpx2.AsyncClient(headers=spec.headers or None, timeout=timeout) as http:
        async with streamable_http_client(spec.url, http_client=http) as streams:
            yield streams


class _Server:
    """One configured server's mutable record (event-loop thread only)."""

    def __init__(self, name: str, spec: ServerSpec, breaker: Breaker):
        self.name, self.spec, self.breaker = name, spec, breaker
        self.client: mcp.Client | None = None
        self.gen = 0  # connection generation: signals from an older connection are ignored
        self.holder: asyncio.Task | None = None
        self.ready: asyncio.Future | None = None
        self.stop: asyncio.Event | None = None
        self.lock = asyncio.Lock()  # one connect cycle at a time
        self.list_lock = asyncio.Lock()  # one listing at a time
        self.refresher: asyncio.Task | None = None
        self.dirty = False
        self.tools: list[dict[str, Any]] | None = None
        self.hashes: dict[str, str] = {}
        self.connected_at: float | None = None
        self.tools_changed_at: float | None = None
        self.protocol_version: str | None = None
        self.tail: _Tail | None = None  # the stdio server's stderr, of the latest connection

    def last_stderr(self, err: str) -> str:
        """`err`, with what the server last wrote to stderr, if anything."""
        text = self.tail.text() if self.tail is not None else ""
        return f"{err}; stderr: {text}" if text else err


class ConnectionManager:
    """Connections to every server of an mcpServers config, made on demand.

    Use inside one event loop: `async with ConnectionManager(cfg) as m: await m.list_tools("time")`.
    """

    def __init__(self, config: McpConfig, *, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.options = config.options
        self.clock = clock
        o = self.options
        self._servers = {
            name: _Server(name, spec, Breaker(o.max_connection_retries, o.backoff_base, o.backoff_max, o.circuit_reset))
            for name, spec in config.servers.items()
        }
        self._listeners: list[ToolsListener] = []
        self._background: set[asyncio.Task] = set()  # preconnects, relistings, reconnects
        self._holders: set[asyncio.Task] = set()  # connection tasks, closed politely by aclose
        self._preconnect: list[asyncio.Task] = []
        self._closing = False

    # ---- reading the state -------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self._servers)

    def state(self, name: str) -> State:
        return self._get(name).breaker.state

    def status(self) -> list[ServerStatus]:
        now = self.clock()
        out = []
        for s in self._servers.values():
            b = s.breaker
            retry_in = max(0.0, b.open_until - now) if b.open_until is not None and b.state == State.FAILED else None
            out.append(ServerStatus(
                name=s.name, state=str(b.state), tools=None if s.tools is None else len(s.hashes),
                connected_at=_iso(s.connected_at) if s.client is not None else None, last_error=b.last_error,
                tools_changed_at=_iso(s.tools_changed_at), transport=s.spec.transport,
                protocol_version=s.protocol_version if s.client is not None else None,
                retry_in=None if retry_in is None else round(retry_in, 1),
            ))  # fmt: skip
        return out

    def unavailable(self) -> frozenset[str]:
        """Servers that are failing now (connect cycle failed, circuit open, or connection
        lost): for the recommender's availability filter (`Context.unavailable_servers`)."""
        return frozenset(s.name for s in self._servers.values() if s.breaker.state == State.FAILED)

    def listings(self) -> dict[str, list[dict[str, Any]]]:
        """Every server's last tool list (MCP tool definitions), for servers listed so far."""
        return {s.name: s.tools for s in self._servers.values() if s.tools is not None}

    def on_tools_changed(self, listener: ToolsListener) -> Callable[[], None]:
        """Call `listener(server, diff)` (sync or async) after a listing that differs from the
        server's previous one (its first listing included). Returns an unsubscribe callable."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    # ---- using the servers ---------------------------------------------------------------
    def start(self) -> list[asyncio.Task]:
        """Connect `preconnect_servers` in the background (once); returns their tasks."""
        if not self._preconnect:
            self._preconnect = [self._spawn(self._quietly(self.ensure(n)), f"preconnect {n}") for n in self.options.preconnect_servers]
        return self._preconnect

    async def preconnected(self) -> None:
        """Wait until the `preconnect_servers` have connected or failed."""
        await asyncio.gather(*self._preconnect, return_exceptions=True)

    async def connect_all(self, names: Iterable[str] | None = None) -> dict[str, str | None]:
        """Connect the servers (all by default) concurrently: {name: error or None}."""
        names = list(self._servers if names is None else names)
        results = await asyncio.gather(*(self.ensure(n) for n in names), return_exceptions=True)
        out: dict[str, str | None] = {}
        for name, r in zip(names, results):
            if isinstance(r, BaseException) and not isinstance(r, Exception):
                raise r
            out[name] = str(r) if isinstance(r, Exception) else None
        return out

    async def ensure(self, name: str) -> mcp.Client:
        """The server's live client, connecting first if need be (fails fast while its
        circuit is open)."""
        srv = self._get(name)
        if srv.client is not None:
            return srv.client
        async with srv.lock:
            if srv.client is not None:
                return srv.client
            if self._closing:
                raise ServerUnavailable(name, "the connection manager is closed")
            b = srv.breaker
            now = self.clock()
            if not b.allow(now):
                raise ServerUnavailable(name, b.last_error, retry_in=b.open_until - now)
            delays = b.plan(now)
            attempt = 0
            try:
                while True:
                    try:
                        await self._open(srv)
                        await self._refresh(srv)
                        break
                    except Exception as e:
                        err = describe(e, self.options.connection_timeout)
                        await self._close(srv)
                        err = srv.last_stderr(err)
                        if attempt >= len(delays):
                            wait = b.failed(self.clock(), err)
                            log.warning("%s: cannot connect after %d attempt(s): %s (failing fast for %.0f s)", name, attempt + 1, err, wait)
                            raise ServerUnavailable(name, err, retry_in=wait) from None
                        b.last_error = err
                        log.info("%s: attempt %d failed: %s; retrying in %g s", name, attempt + 1, err, delays[attempt])
                        await asyncio.sleep(delays[attempt])
                        attempt += 1
            except asyncio.CancelledError:
                await self._close(srv)
                b.aborted(b.last_error)
                raise
            b.succeeded()
            srv.connected_at = time.time()
            log.info("%s: connected (%s, protocol %s, %d tools)", name, srv.spec.transport, srv.protocol_version, len(srv.hashes))
            return srv.client

    async def list_tools(self, name: str, refresh: bool = False) -> list[dict[str, Any]]:
        """The server's tools as MCP definitions (connecting if need be; `refresh` re-lists)."""
        srv = self._get(name)
        await self.ensure(name)
        if refresh:
            await self._guarded(srv, self._refresh(srv), "tools/list")
        return list(srv.tools or [])

    async def call(self, server: str, tool: str, arguments: dict[str, Any] | None = None, *, timeout: float | None = None) -> mcp_types.CallToolResult:
        """Call a tool on a server (its own tool name, not server__tool). A tool's failure
        is the result's `isError`; a lost connection raises `ServerUnavailable`; a protocol
        error (unknown tool, bad arguments) raises `MCPError`."""
        srv = self._get(server)
        client = await self.ensure(server)
        t = timeout or self.options.request_timeout
        return await self._guarded(srv, client.call_tool(tool, arguments or {}, read_timeout_seconds=t), "tools/call")

    async def aclose(self) -> None:
        """Close every connection (stdio servers are stopped) and background task."""
        self._closing = True
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await asyncio.gather(*(self._close(s) for s in self._servers.values()), return_exceptions=True)
        for task in list(self._holders):  # connections already lost, still winding down
            with contextlib.suppress(Exception, asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(task, CLOSE_TIMEOUT)

    async def __aenter__(self) -> ConnectionManager:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---- internals -----------------------------------------------------------------------
    def _get(self, name: str) -> _Server:
        try:
            return self._servers[name]
        except KeyError:
            raise ValueError(f"no MCP server named {name!r} in {self.config.origin} (have: {', '.join(self._servers) or 'none'})") from None

    def _spawn(self, coro: Awaitable[Any], name: str, into: set[asyncio.Task] | None = None) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        task.set_name(f"sidecar.mcp: {name}")
        tasks = self._background if into is None else into
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    async def _quietly(self, coro: Awaitable[Any]) -> None:
        with contextlib.suppress(ServerUnavailable):
            await coro

    async def _guarded(self, srv: _Server, coro: Awaitable[Any], what: str) -> Any:
        gen = srv.gen
        try:
            return await coro
        except Exception as e:
            if not _transport_failure(e):
                raise
            err = f"connection lost during {what}: {describe(e)}"
            self._lost(srv, gen, err)
            raise ServerUnavailable(srv.name, err) from e

    async def _open(self, srv: _Server) -> None:
        srv.gen += 1
        srv.stop = asyncio.Event()
        srv.ready = asyncio.get_running_loop().create_future()
        srv.holder = self._spawn(self._hold(srv, srv.gen, srv.ready, srv.stop), f"connection {srv.name}", self._holders)
        srv.tail = None
        client = await asyncio.wait_for(asyncio.shield(srv.ready), self.options.connection_timeout)
        srv.client = client
        srv.protocol_version = client.protocol_version

    async def _close(self, srv: _Server) -> None:
        """End the current connection task (if any) and wait for it, bounded."""
        srv.client = None
        holder, ready = srv.holder, srv.ready
        if holder is None:
            return
        if srv.stop is not None:
            srv.stop.set()
        if ready is not None and not ready.done():
            holder.cancel()  # still connecting: nothing to close politely
        if srv.refresher is not None:
            srv.refresher.cancel()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
            await asyncio.wait_for(asyncio.shield(holder), CLOSE_TIMEOUT)
        if not holder.done():
            holder.cancel()
        srv.holder = None

    async def _hold(self, srv: _Server, gen: int, ready: asyncio.Future, stop: asyncio.Event) -> None:
        """The connection task: open the client, hand it over, hold it until told to stop or
        until the server goes away."""
        eof = asyncio.Event()
        tail: _Tail | None = None
        pipe_w = None
        lost = False
        try:
            spec = srv.spec
            if spec.transport == "stdio":
                r, w = os.pipe()
                pipe_w = os.fdopen(w, "wb", buffering=0)
                _, tail = await asyncio.get_running_loop().connect_read_pipe(_Tail, os.fdopen(r, "rb", buffering=0))
                srv.tail = tail
                params = mcp.StdioServerParameters(command=spec.command, args=spec.args, env=spec.env or None, cwd=spec.cwd)
                inner = stdio_client(params, errlog=pipe_w)
            else:
                inner = _http(spec)

            async def on_message(message: Any) -> None:
                if isinstance(message, mcp_types.ToolListChangedNotification):
                    self._schedule_refresh(srv, gen)
                elif isinstance(message, Exception):
                    log.debug("%s: transport error: %s", srv.name, message)

            client = mcp.Client(
                _watched(inner, eof.set), mode=spec.protocol, cache=None, message_handler=on_message,
                read_timeout_seconds=self.options.request_timeout,
                client_info=mcp_types.Implementation(name="sidecar", version=__version__),
            )  # fmt: skip
            async with client:
                if ready.done():  # the attempt was given up meanwhile
                    return
                ready.set_result(client)
                waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(eof.wait())]
                caps = client.server_capabilities.tools
                if client.protocol_version in MODERN_PROTOCOL_VERSIONS and caps is not None and caps.list_changed:
                    waits.append(asyncio.ensure_future(self._listen(srv, gen, client)))
                try:
                    await asyncio.wait(waits[:2], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w_ in waits:
                        w_.cancel()
                    await asyncio.gather(*waits, return_exceptions=True)
                lost = eof.is_set() and not stop.is_set()
                if lost:
                    self._lost(srv, gen, "connection lost: the server closed the connection")
        except asyncio.CancelledError:
            if not ready.done():
                ready.cancel()
            raise
        except Exception as e:
            if not ready.done():
                ready.set_exception(e)
            elif not stop.is_set():
                lost = True
                self._lost(srv, gen, f"connection lost: {describe(e)}")
        finally:
            if pipe_w is not None:
                pipe_w.close()
            if tail is not None:
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(tail.closed), 0.5)
                if lost and srv.gen == gen and srv.breaker.state == State.FAILED and tail.text():
                    srv.breaker.last_error = f"{srv.breaker.last_error}; stderr: {tail.text()}"

    async def _listen(self, srv: _Server, gen: int, client: mcp.Client) -> None:
        """2026-07-28 servers announce tool-list changes on a subscriptions/listen stream."""
        try:
            async with client.listen(tools_list_changed=True) as sub:
                async for _event in sub:
                    self._schedule_refresh(srv, gen)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # no listen support, or the stream dropped: notifications still arrive, or not
            log.debug("%s: subscriptions/listen ended: %s", srv.name, describe(e))

    def _lost(self, srv: _Server, gen: int, error: str) -> None:
        if srv.gen != gen or srv.client is None:
            return
        srv.client = None
        if srv.stop is not None:
            srv.stop.set()
        srv.breaker.lost(error)
        log.warning("%s: %s", srv.name, error)
        if srv.name in self.options.preconnect_servers and not self._closing:
            self._spawn(self._quietly(self._reconnect(srv)), f"reconnect {srv.name}")

    async def _reconnect(self, srv: _Server) -> None:
        holder = srv.holder
        if holder is not None:  # let the old connection wind down first
            with contextlib.suppress(Exception, asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(holder), CLOSE_TIMEOUT)
        await self.ensure(srv.name)

    def _schedule_refresh(self, srv: _Server, gen: int) -> None:
        if srv.gen != gen or self._closing:
            return
        srv.dirty = True
        if srv.refresher is None or srv.refresher.done():
            srv.refresher = self._spawn(self._refresh_loop(srv, gen), f"relist {srv.name}")

    async def _refresh_loop(self, srv: _Server, gen: int) -> None:
        await asyncio.sleep(0.02)  # let a burst of notifications (and the listen tee) coalesce
        while srv.dirty and srv.gen == gen and srv.client is not None:
            srv.dirty = False
            try:
                await self._guarded(srv, self._refresh(srv), "tools/list")
            except ServerUnavailable:
                return
            except Exception as e:
                log.warning("%s: re-listing tools after list_changed failed: %s", srv.name, describe(e))
                return

    async def _refresh(self, srv: _Server) -> ToolDiff:
        """List the server's tools (every page) and tell the listeners what changed."""
        async with srv.list_lock:
            client = srv.client
            if client is None:
                raise ServerUnavailable(srv.name, srv.breaker.last_error or "not connected")
            raw: list[mcp_types.Tool] = []
            if client.server_capabilities.tools is not None:
                cursor: str | None = None
                seen: set[str] = set()
                for _ in range(MAX_PAGES):
                    page = await client.list_tools(cursor=cursor)
                    raw.extend(page.tools)
                    cursor = page.next_cursor
                    if not cursor:
                        break
                    if cursor in seen:
                        raise RuntimeError(f"tools/list pagination repeats cursor {cursor!r}")
                    seen.add(cursor)
                else:
                    raise RuntimeError(f"tools/list pagination did not end after {MAX_PAGES} pages")
            defs: list[dict[str, Any]] = []
            hashes: dict[str, str] = {}
            for t in raw:
                d = t.model_dump(by_alias=True, exclude_none=True, mode="json")
                if d["name"] in hashes:
                    log.warning("%s: tools/list has %r twice; keeping the first", srv.name, d["name"])
                    continue
                hashes[d["name"]] = schema_hash(d)
                defs.append(d)
            change = diff(srv.hashes, hashes)
            first = srv.tools is None
            srv.tools, srv.hashes = defs, hashes
            if first or change.changed:
                srv.tools_changed_at = time.time()
                log.info("%s: tools/list: %d tools (%s)", srv.name, len(hashes), change.counts())
                await self._emit(srv.name, change)
            return change

    async def _emit(self, server: str, change: ToolDiff) -> None:
        for listener in list(self._listeners):
            try:
                out = listener(server, change)
                if asyncio.iscoroutine(out) or isinstance(out, asyncio.Future):
                    await out
            except Exception:
                log.exception("tools-changed listener failed for %s", server)

