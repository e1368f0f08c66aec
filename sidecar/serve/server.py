"""The streaming websocket server: moves frames between clients and the one shared engine
(`Sidecar`).

Concurrency, in one place:
- the event loop reads every connection's frames, decodes them (protocol.py), updates the
  connection's Session (session.py) and queues spans in `Pending`; it never embeds;
- one worker thread owns the model: a dispatcher task hands it one bounded batch at a time
  (`Pending.take`: round-robin over connections, at most `max_batch_spans` spans and about
  `max_batch_ms` of estimated work, `shared_batch_ms` while a light connection shares the
  model with a busy one), and it judges them (`session.judge`: `Sidecar.judge`
  once per engine, so many streams share one llama.cpp call); while it works, new spans
  queue (and, under overload, supersede); an `end` is answered with `ended` once none of the stream's spans wait and the
  batch that held its last ones is delivered;
- a `hello`'s new tools are embedded on a second context of the model, on an index thread
  beside the model thread (`hello_embed = "beside"`), so a session catalog delays no other
  session's spans; or (`"between"`) on the model thread in slices (`catalog_slice_tools`,
  about `shared_batch_ms` of estimated work) queued between batches, so it delays them by one slice;
- with live MCP servers (`mcp`), their connections live on the event loop and a tool-list
  change reindexes the engine's pipeline in place on the model thread (mcp/live.py), its new
  texts first embedded on the index thread's second context, so the reindex embeds nothing;
- each connection has an outbox drained by its own writer task, which awaits each send (the
  socket's flow control): at `outbox_messages` queued the connection's frames are not read
  until it drains, and a client that takes nothing for `send_timeout_s` is closed with 1013,
  so a slow client stalls only itself and a prompt one is never closed for a burst;
- each connection has a quota of queued work (spans, `end`s, store writes): at the quota its
  frames are not read until the dispatcher takes its work (backpressure), so a client that
  floods frames costs bounded memory;
- tool_result / feedback go to the MetricsStore on a store thread and are acknowledged
  after commit; a periodic task rolls the raw call log up once a day.

HTTP shares the port through websockets' `process_request` (web.py: /healthz, /metrics, the
page at `/`, and the token / Origin / capacity checks every handshake passes first); /metrics
is kept by telemetry.py.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from .. import __version__
from ..core import cases as cases_mod
from .. import protocol as p
from ..core.catalog import Catalog, Tool
from ..config import Config
from ..engine import Sidecar
from ..core.gate import Decision
from ..core.index import PRIMARY_CHARS
from ..mcp.config import McpConfig
from .completion import Completion, start_completion
from .pending import Pending
from .learner import Learner
from ..learn.traffic import Turns
from .records import Records
from ..recommend.filters import compile_permissions
from .session import (
    Evaluation,
    Scope,
    Session,
    Verdict,
    context_of,
    inject_for,
    judge,
    session_catalog,
    settle,
)
from ..store import Store
from .telemetry import Metrics, freeze_loaded_heap, limit_blas_threads, pin_mmap_threshold
from .web import Web, peer

if TYPE_CHECKING:  # imported where live servers are configured: the mcp SDK's models take ~1 s to import
    from ..mcp.connections import ConnectionManager
    from ..mcp.live import LiveCatalog

log = logging.getLogger("sidecar.server")

# A token frame is segmented this many characters at a time, each slice waiting for the
# connection's quota of queued spans and then serving the event loop: 1 MiB of "abc\n"
# (262,144 clauses) held every client's pings for 53.8 s (issue 33); in slices of 4,096 with no
# quota between them, 1 MB of it still held the loop 25 ms a slice, 5.6 s in all; in slices of
# 1,024, about 10 ms a slice (256 clauses of 34 us each, most of it their words' tokenizing),
# which made the victim's pings 9x their idle p99; 256 take about 2.5 ms.
TOKEN_SLICE_CHARS = 256
# Spans decided on the event loop (`settle_ms`; ~0.1-0.2 ms each, the negative patterns most of
# it): at most this many a second on average and this many at once, a connection's and the
# server's. A real stream cuts ~5 a second (50 tokens/s). Past them a span waits for the model
# thread as any other, under its connection's quota: a flood of tiny clauses settled without a
# bound held the loop in 10 ms stretches (victim's ping p99 22 ms against 5, bench/attacks.py).
SETTLE_SPANS_PER_S, SETTLE_BURST = 200.0, 16.0
SERVER_SETTLE_SPANS_PER_S, SERVER_SETTLE_BURST = 800.0, 32.0
COST_OVERHEAD_CHARS = 32  # a span's fixed cost in the batch estimate, in characters
COST_EWMA = 0.3  # how fast the measured cost per character follows the model
SHARED_WINDOW_S = 1.0  # a connection answered this recently still shares the model (shared_batch_ms)
EVICT_SILENT_S = 1.0  # at capacity, a connection silent (no hello) this long gives its place to a newcomer
SATURATED_SHARE = 0.5  # a queue over max_batch_ms that no connection holds this much of: big batches
ROLLUP_CHECK_S = 3600.0  # how often to ask whether the daily roll-up of the call log is due


class ReadBudget:
    """A token bucket: of characters, how long a connection's next read must wait so that it
    is read at `rate` characters a second on average, `burst` at once (`charge`); of spans,
    whether one more may be settled on the event loop (`take`). Sans-I/O: the caller gives
    the clock."""

    def __init__(self, rate: float, burst: float, now: float):
        self.rate, self.burst = rate, burst
        self.left, self.at = burst, now

    def charge(self, chars: int, now: float) -> float:
        """Spend `chars`; the seconds to wait before reading more (0: none)."""
        self.left = min(self.burst, self.left + (now - self.at) * self.rate) - chars
        self.at = now
        return 0.0 if self.left >= 0 else -self.left / self.rate

    def take(self, n: float, now: float) -> bool:
        """Spend `n` if the bucket holds it (True), else spend nothing (False)."""
        left = min(self.burst, self.left + (now - self.at) * self.rate)
        self.at = now
        self.left = left - n if left >= n else left
        return left >= n


class Silent:
    """Connections that have said no hello yet, by peer address, each address's oldest first."""

    def __init__(self) -> None:
        self._by_address: dict[str, OrderedDict[Connection, None]] = {}

    def add(self, conn: Connection) -> None:
        self._by_address.setdefault(conn.address, OrderedDict())[conn] = None

    def discard(self, conn: Connection) -> None:
        held = self._by_address.get(conn.address)
        if held is None or conn not in held:
            return
        del held[conn]
        if not held:
            del self._by_address[conn.address]

    def held_by(self, address: str) -> int:
        return len(self._by_address.get(address, ()))

    def candidate(self, newcomer: str) -> Connection | None:
        """The connection a newcomer from `newcomer` may take the place of: the oldest of the
        address holding the most, if that is more than the newcomer's own address holds (so
        silent sockets from several addresses do not evict each other). O(addresses)."""
        if not self._by_address:
            return None
        address, held = max(self._by_address.items(), key=lambda kv: len(kv[1]))
        return next(iter(held)) if len(held) > self.held_by(newcomer) else None


class Connection:
    """One client: its session, its outbox, and the work it has queued (its quota)."""

    def __init__(self, ws: ServerConnection, session: Session, metrics: Metrics, limits: Any, pending: Pending):
        self.ws = ws
        self.session = session
        self.metrics = metrics
        # The server's name for this connection, which scopes its records: hello.session is
        # chosen by the client, so another client may claim the same one.
        self.id = secrets.token_hex(8)
        # The key its refs are kept under: a new secret, or the one an earlier connection of
        # the client was given (hello.resume), so a resend after a reconnect counts once.
        self.refs = ""
        self.quota = limits.max_queued_per_connection
        self.pending = pending
        # `end`s read since the dispatcher last took work (an `end` still waiting for its
        # stream's spans is bounded by those spans, which count in `pending`)
        self.ends = 0
        self.records = 0  # tool_result / feedback writes not yet committed
        self._room = asyncio.Event()
        self._throttle = True
        # Flow control: at `pause` queued messages the connection is not read; what the work
        # already read can still produce keeps the outbox under `cap` (see ServerConfig).
        self.pause = limits.outbox_messages
        self.cap = limits.outbox_messages + 4 * limits.max_queued_per_connection + 64
        self.send_timeout = limits.send_timeout_s
        self.outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self.writer = asyncio.create_task(self._write())
        self._closing: asyncio.Task | None = None
        self.lost = False  # the connection closed (frames still buffered are not worked through)
        self.opened = time.monotonic()
        self.budget = ReadBudget(limits.read_chars_per_s, 2 * limits.max_frame_bytes, self.opened)
        # spans decided on the event loop (`settle`); past the bucket they queue like any other,
        # under the connection's quota, so a frame of 200,000 tiny clauses costs the loop little
        self.settling = ReadBudget(SETTLE_SPANS_PER_S, SETTLE_BURST, self.opened)
        self.held_until = self.opened  # not read before (spans of its were shed: `hold`)
        self.evicted = False  # closed to make room for a newcomer while it had not said hello
        self.address = peer(ws)  # what the per-address limits count it under
        self._watch = asyncio.ensure_future(ws.wait_closed())
        self._watch.add_done_callback(self._lost)

    def _lost(self, _: asyncio.Future) -> None:
        """The connection closed (the client left, or was closed): its queued spans are
        dropped when taken instead of judged for no one, and a reader paused on its quota
        (or mid-frame) runs on to see the close; frames already buffered are not worked through."""
        self.lost = True
        self.session.closed = True
        self.unthrottle()

    @property
    def backlog(self) -> int:
        """Spans and `end`s queued for the model thread."""
        return self.pending.count(self.session) + self.ends

    def over_quota(self) -> bool:
        return self._throttle and (self.backlog + self.records >= self.quota or self.outbox.qsize() >= self.pause)

    async def room(self) -> None:
        """Return once this connection's queued work is under its quota and its outbox under
        `outbox_messages`: until then its frames stay unread (in websockets' small buffer,
        then in TCP): backpressure."""
        while self.over_quota():
            self._room.clear()
            await self._room.wait()

    def wake(self) -> None:
        """Some of its work was taken or answered: a paused reader may be under quota."""
        self._room.set()

    def hold(self, seconds: float, most: float) -> None:
        """Its spans were shed, `seconds` of the model's work: its next frames are read that
        much later (at most `most` ahead of now), so a client sending faster than the model
        judges costs the event loop what it is answered, not every frame it can send."""
        now = time.monotonic()
        self.held_until = min(max(self.held_until, now) + seconds, now + most)

    def taken(self) -> None:
        """The dispatcher took a batch: the `end`s read so far wait on the model thread now."""
        self.ends = 0
        self._room.set()

    def recorded(self) -> None:
        self.records -= 1
        self._room.set()

    def unthrottle(self) -> None:
        """Shutting down: let a paused reader run to its end."""
        self._throttle = False
        self._room.set()

    def send(self, msg: p.ServerMessage) -> None:
        if self._closing is not None or self.writer.done():  # nothing more will go out
            return
        if self.outbox.qsize() >= self.cap:
            self._too_slow(f"{self.outbox.qsize()} messages queued")
            return
        self.outbox.put_nowait(p.encode_for(msg, self.session.version))
        kind = type(msg).__struct_config__.tag
        self.metrics.frames.labels("out", kind).inc()
        if isinstance(msg, p.Error):
            self.metrics.errors.labels(msg.code).inc()

    def _too_slow(self, why: str) -> None:
        if self._closing is None:
            self.session.closed = True
            log.warning("client %s is not reading (%s); closing with 1013", self.ws.remote_address, why)
            self._closing = asyncio.create_task(self._close_slow())

    async def _close_slow(self) -> None:
        """Close with 1013; a client that does not read will not answer the close frame
        either, so it gets `send_timeout_s` to do so before the socket is dropped."""
        try:
            await asyncio.wait_for(self.ws.close(1013, "client too slow: not reading"), self.send_timeout)
        except (TimeoutError, ConnectionClosed):
            pass
        if self.ws.transport is not None and not self.ws.transport.is_closing():
            self.ws.transport.abort()

    async def _write(self) -> None:
        while True:
            data = await self.outbox.get()
            try:
                # awaits the socket's flow control: a client that reads promptly keeps this short
                await asyncio.wait_for(self.ws.send(data, text=True), self.send_timeout)
            except ConnectionClosed:
                self._gone()
                return
            except TimeoutError:
                self._too_slow(f"no message taken for {self.send_timeout:g} s")
                self._gone()
                return
            finally:
                self.outbox.task_done()
            self._room.set()

    def _gone(self) -> None:
        """Nothing more can be sent: drop what is queued and let a reader paused on a full
        outbox run on, to see the close and end the connection (paused, it never would)."""
        self._discard()
        self.unthrottle()

    def _discard(self) -> None:
        while not self.outbox.empty():
            self.outbox.get_nowait()
            self.outbox.task_done()

    def stop(self) -> None:
        """The connection is gone: stop the writer and drop what it can no longer send
        (so a shutdown waiting on `outbox.join()` is not kept waiting)."""
        self.writer.cancel()
        self._watch.cancel()
        self._discard()


class SidecarServer:
    def __init__(self, cfg: Config, *, engine: Sidecar | None = None, catalog: Catalog | None = None, store: Store | None = None,
                 progress: bool = False, mcp: McpConfig | None = None):  # fmt: skip
        """Give `engine` to serve an already loaded one (tests, embedding); otherwise the
        model loads in the background after the port is bound (/healthz says 503 until then).
        `mcp`: the live servers whose tools are indexed beside `catalog` (`--mcp-config`)."""
        self.cfg = cfg
        self.mcp = mcp
        self.live: LiveCatalog | None = None  # set once the live servers' tools are indexed
        self._servers: ConnectionManager | None = None
        self.limits = cfg.server
        self.engine: Sidecar | None = None
        self.completion: Completion | None = None  # the tools and cases added after ready (serve/completion.py)
        self.learner: Learner | None = None  # learning from traffic ([learn] traffic), set with the engine
        self._given = engine
        self.catalog = catalog
        self.store = store if store is not None else getattr(engine, "store", None)
        self.progress = progress
        self.pending = Pending(self.limits.max_pending, self.limits.stale_ms / 1000, span_chars)
        self.metrics = Metrics(self)
        self.connections: dict[Session, Connection] = {}
        self.addresses: Counter[str] = Counter()  # open connections per peer address
        self.load_error: BaseException | None = None
        self.closing = False
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="sidecar-model")
        self._indexer = ThreadPoolExecutor(1, thread_name_prefix="sidecar-index")  # hellos' catalogs ("beside") and globs, live tool-list changes
        self._session_engines: OrderedDict[tuple, Sidecar] = OrderedDict()
        self._building: dict[tuple, asyncio.Future] = {}  # session catalogs being embedded
        # `end`s waiting for their stream's spans, as a count per stream: repeated `end`s of
        # one stream cost one entry (and each counts against its connection's quota)
        self._ending: OrderedDict[tuple[Session, str], int] = OrderedDict()
        self._backlogged: set[Connection] = set()  # connections with work in `pending` / `_ending`
        self._cost_per_char: float | None = None  # the model's measured seconds per character of a batch
        self._settling = ReadBudget(SERVER_SETTLE_SPANS_PER_S, SERVER_SETTLE_BURST, time.monotonic())  # spans settled on the event loop, all connections'
        self._evicting = 0  # silent connections closed to make room, not yet gone
        self._silent = Silent()  # connections with no hello yet, oldest first (eviction's candidates)
        self._answered: OrderedDict[Session, float] = OrderedDict()  # connection -> when its last span was taken, oldest first
        self.records = Records(self)  # tool_result / feedback commits in flight
        self._busy = False
        self._ws: Server | None = None
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self.loaded: asyncio.Event | None = None

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.closing

    @property
    def port(self) -> int:
        return self._ws.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"ws://{self.limits.host}:{self.port}"

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self.loaded = asyncio.Event()
        self._ws = await serve(
            self._handle,
            self.limits.host,
            self.limits.port,
            process_request=Web(self),
            max_size=self.limits.max_frame_bytes,
            max_queue=self.limits.read_ahead_frames,
            compression=None,  # small frames at a high rate: deflate costs more than it saves
            server_header=f"sidecar/{__version__}",
        )
        self._tasks.append(asyncio.create_task(self._dispatch()))
        if self._given is None or self.mcp is not None:
            self._tasks.append(asyncio.create_task(self._load()))
        else:
            await self._attach(self._given)
            self.loaded.set()

    async def _load(self) -> None:
        """Build the engine on the model thread (or take the given one) and, with `mcp`,
        connect the live servers meanwhile and index their tools, also on the model thread."""
        t0 = time.perf_counter()
        def build() -> Sidecar:
            if self._given is not None:
                return self._given
            return open_engine(self.cfg, self.catalog, self.store, live=self.mcp is not None, progress=self.progress)

        try:
            if self.mcp is None:
                engine = await asyncio.get_running_loop().run_in_executor(self._worker, build)
            else:
                from ..mcp.connections import ConnectionManager
                from ..mcp.live import go_live

                self._servers = ConnectionManager(self.mcp)
                self._servers.start()  # preconnect_servers: reconnected in the background when lost
                beside = self._indexer if self.limits.hello_embed == "beside" else None  # a tool-list change embeds there first
                engine, self.live = await go_live(self._servers, build, self._worker, beside)
        except Exception as e:  # reported by the caller of wait_loaded()
            self.load_error = e
        else:
            self.metrics.loaded(time.perf_counter() - t0)
            await self._attach(engine)
        self.loaded.set()

    @property
    def history(self):
        """The call history the engine's recommender learns from (None: no store)."""
        return self.engine.history if self.engine is not None else None

    async def _attach(self, engine: Sidecar) -> None:
        """Serve `engine`, its call history rolled up now if due, then checked hourly."""
        self.store = self.store or engine.store
        if engine.history is not None:
            await asyncio.to_thread(engine.history.rollup_if_due)
            self._tasks.append(asyncio.create_task(self._rollups()))
        if self.cfg.learn.traffic and engine.store is not None:
            self.learner = Learner(engine, self.cfg.learn, self.metrics)
            self.learner.refit()  # what earlier runs recorded, in the background
        self.completion = start_completion(engine, self.cfg, self._worker, self._indexer)
        self.engine = engine  # last: a non-None engine means ready

    async def _rollups(self) -> None:
        while True:
            await asyncio.sleep(ROLLUP_CHECK_S)
            try:
                await asyncio.to_thread(self.history.rollup_if_due)
            except Exception:
                log.exception("rolling up the call log failed")

    # Websocket side -------------------------------------------------------------------

    def refusal(self, address: str) -> tuple[int, str] | None:
        """Whether a new connection from `address` would pass the capacity limits: None, or
        the HTTP status and reason to refuse it with (counted in sidecar_refused_connections_total)."""
        limits = self.limits
        if len(self.connections) - self._evicting >= limits.max_connections and (
            self.addresses[address] >= limits.max_connections_per_address or not self._evict_silent(address)
        ):
            self.metrics.refused.labels("max_connections").inc()
            return 503, f"at most {limits.max_connections} connections"
        if self.addresses[address] >= limits.max_connections_per_address:
            self.metrics.refused.labels("per_address").inc()
            return 429, f"at most {limits.max_connections_per_address} connections from one address (server.max_connections_per_address)"
        return None

    def _evict_silent(self, newcomer: str) -> bool:
        """At capacity, close a connection that has said no `hello` for EVICT_SILENT_S (1013),
        so a newcomer gets its place: a real client says hello as soon as it connects, and
        silent sockets from many addresses (which no per-address limit stops) would otherwise
        turn everyone away until `hello_timeout_s`. The one closed is the oldest of the address
        holding the most, and only for a newcomer whose address holds fewer: silent sockets
        from 8 addresses evicted each other as fast as they reconnected (765 handshakes and
        closes in 4 s; the victim's ping p99 6.8x its idle one). False when there is none."""
        oldest = self._silent.candidate(newcomer)
        if oldest is None or time.monotonic() - oldest.opened < EVICT_SILENT_S:
            return False
        self._silent.discard(oldest)
        oldest.evicted = True
        self._evicting += 1
        self.metrics.timeouts.labels("evicted").inc()
        self._tasks.append(asyncio.ensure_future(oldest.ws.close(1013, "the server is full and this connection said no hello")))
        self._tasks = [t for t in self._tasks if not t.done()]
        return True

    async def _handle(self, ws: ServerConnection) -> None:
        address = peer(ws)
        if (refused := self.refusal(address)) is not None:  # handshakes that passed the check together
            await ws.close(1013, refused[1])
            return
        session = Session(self.limits, self.metrics.unchanged.inc)
        conn = Connection(ws, session, self.metrics, self.limits, self.pending)
        self.connections[conn.session] = conn
        self._silent.add(conn)
        self.addresses[address] += 1
        frames = aiter(ws)
        try:
            while True:
                said_hello = conn.session.hello is not None
                try:
                    frame = await asyncio.wait_for(anext(frames), self.limits.idle_timeout_s if said_hello else self.limits.hello_timeout_s)
                except StopAsyncIteration:
                    break
                except TimeoutError:  # a silent connection holds a place others could use
                    self.metrics.timeouts.labels("idle" if said_hello else "hello").inc()
                    if said_hello:
                        await ws.close(1001, f"idle for {self.limits.idle_timeout_s:g} s")
                    else:
                        await ws.close(1008, f"no hello within {self.limits.hello_timeout_s:g} s")
                    break
                if conn.lost:  # frames buffered before the close: nobody would get their answers
                    break
                await self._on_frame(conn, frame)
                await conn.room()
                if (held := conn.held_until - time.monotonic()) > 0:  # its spans were shed: read it no faster than the model judges
                    self.metrics.throttled.inc(held)
                    await asyncio.sleep(held)
                await asyncio.sleep(0)  # the event loop's fair share: one frame, then every other ready connection's turn
                if (wait := conn.budget.charge(len(frame), time.monotonic())) > 0:  # ... and no more than read_chars_per_s
                    self.metrics.throttled.inc(wait)
                    await asyncio.sleep(wait)
        except ConnectionClosed:
            pass  # e.g. 1009 for an oversized frame: websockets already closed it
        finally:
            conn.session.closed = True
            del self.connections[conn.session]
            self._silent.discard(conn)
            if conn.evicted:
                self._evicting -= 1
            self.addresses[address] -= 1
            if not self.addresses[address]:
                del self.addresses[address]
            self.pending.discard(conn.session)
            for key in [k for k in self._ending if k[0] is conn.session]:
                del self._ending[key]
            self._backlogged.discard(conn)
            conn.stop()
            if conn.session.turns is not None and self.learner is not None:
                self.learner.add(list(filter(None, [conn.session.turns.close()])), conn.id)

    async def _on_frame(self, conn: Connection, frame: str | bytes) -> None:
        """Answer one frame. Never raises: an exception escaping here would close the
        connection with 1011, so whatever a frame holds, it gets an `error` at worst."""
        now = time.perf_counter()
        try:
            msg = p.decode_client(frame, self.limits.max_frame_values)
        except p.ProtocolError as e:
            self.metrics.frames.labels("in", "invalid").inc()
            conn.send(p.Error(e.code, e.message, e.ref))
            return
        except Exception as e:  # decode_client raises only ProtocolError: a bug, reported as one
            log.exception("decoding a frame failed")
            self.metrics.frames.labels("in", "invalid").inc()
            conn.send(p.Error("internal", f"decoding the frame failed: {type(e).__name__}"))
            return
        kind = type(msg).__struct_config__.tag
        self.metrics.frames.labels("in", kind).inc()
        s = conn.session
        try:
            if isinstance(msg, p.Token):
                await self._token(conn, msg, now)
            elif isinstance(msg, p.User):
                evaluations = s.on_user(msg.stream, msg.text, now)
                await self._embed_long_turns(evaluations)
                self._queue(conn, evaluations)
                if s.resolved and self.learner is not None:
                    self.learner.add(s.resolved, conn.id)
                s.resolved = []
            elif isinstance(msg, p.End):
                self._queue(conn, s.on_end(msg.stream, now))
                self._end(conn, msg.stream)
            elif isinstance(msg, p.Ping):
                conn.send(p.Pong())
            elif isinstance(msg, p.Hello):
                await self._hello(conn, msg)
            else:  # ToolResult | Feedback
                s.require_hello(kind)
                if isinstance(msg, p.ToolResult):
                    s.called(msg.tool)
                self.records.take(conn, msg)
        except p.ProtocolError as e:
            conn.send(p.Error(e.code, e.message, e.ref if e.ref is not None else getattr(msg, "ref", None)))
        except Exception as e:
            log.exception("handling a %s frame failed", kind)
            conn.send(p.Error("internal", f"{type(e).__name__}: {e}", getattr(msg, "ref", None)))

    async def _token(self, conn: Connection, msg: p.Token, now: float) -> None:
        """A long delta in slices, as if sent in smaller frames: each waits for the
        connection's quota, then yields. One frame makes at most `max_queued_per_connection`
        spans (a frame of a reply's tokens makes a few): the rest of a frame past it is not
        read, and the client gets `too_many_spans`, so a frame of 200,000 tiny clauses costs one
        slice, not minutes of the model's time (and of the event loop's, should it leave)."""
        s, made = conn.session, 0
        for lo in range(0, len(msg.delta), TOKEN_SLICE_CHARS) or [0]:
            if lo:
                await conn.room()
                await asyncio.sleep(0)
                if self.closing or conn.lost:  # the rest would be judged for no one
                    return
            if made >= self.limits.max_queued_per_connection:
                raise p.ProtocolError("too_many_spans", f"a token frame makes at most {self.limits.max_queued_per_connection} spans "
                                                        f"(max_queued_per_connection): the rest of this one, from character {lo}, was not read")  # fmt: skip
            evaluations = s.on_token(msg.stream, msg.delta[lo : lo + TOKEN_SLICE_CHARS], time.perf_counter() if lo else now)
            made += len(evaluations)
            self._queue(conn, evaluations)

    async def _embed_long_turns(self, evaluations: list[Evaluation]) -> None:
        """Embed the user turns among `evaluations` longer than any streamed span beside the
        model thread first (`long_turn_embed`), on the index thread: the model thread then
        finds their vectors in the query cache. The connection's next frames wait meanwhile,
        so a client of long turns is read no faster than the second context embeds them; a
        turn up to max_stream_chars never waits there (behind another client's long turns).
        A failure there only leaves the embedding to the model thread."""
        long = [e.text for e in evaluations if len(e.text) > self.limits.max_stream_chars]
        if not long or self.limits.long_turn_embed != "beside":
            return
        try:
            await asyncio.get_running_loop().run_in_executor(self._indexer, evaluations[0].scope.engine.embed_beside, long)
        except Exception:
            log.exception("embedding %d long user turns beside the model thread failed", len(long))
        queued = time.perf_counter()  # stale_ms is for waiting on the model: a nomic turn can take 2 s beside
        for e in evaluations:
            e.queued = queued

    async def _hello(self, conn: Connection, msg: p.Hello) -> None:
        if msg.version is not None and msg.version not in p.VERSIONS:
            spoken = ", ".join(map(str, p.VERSIONS))
            raise p.ProtocolError("unsupported_version", f"this sidecar speaks protocol versions {spoken}, not {msg.version}")
        if conn.session.hello is not None:
            raise p.ProtocolError("hello_again", "this connection already said hello")
        base = self.engine
        defined = sum(1 for t in msg.tools or () if not isinstance(t, str))
        if defined > self.limits.max_hello_tools:
            raise p.ProtocolError("too_many_tools", f"hello.tools defines {defined} tools; at most {self.limits.max_hello_tools} per hello")
        current = base.catalog  # read once: a live catalog's reindex replaces it on the model thread
        catalog = session_catalog(current, msg.tools)
        own = None if catalog is current else catalog  # None: no tools named, follow the server's catalog
        engine = base if own is None else await self._session_engine(base, catalog)
        if msg.permissions:  # compiled by the session's own hello, not at its first ranking on the model thread
            await asyncio.get_running_loop().run_in_executor(self._indexer, compile_permissions, msg.permissions)
        conn.session.start(msg, Scope(own, context_of(msg), engine, self.live.unavailable if self.live else None))
        self._silent.discard(conn)
        conn.refs = msg.resume or secrets.token_hex(16)
        if own is None and self.learner is not None:  # the server's catalog: what its lesson is for
            conn.session.turns = Turns()
        conn.send(p.Ready(version=conn.session.version or p.VERSION, model=base.pipeline.embedder.name, tools=catalog.names(),
                          sidecar=__version__, resume=conn.refs))  # fmt: skip

    async def _session_engine(self, base: Sidecar, catalog: Catalog) -> Sidecar:
        """A session catalog's engine, built on the model thread and shared by sessions that
        send the same tools (also while it is being built)."""
        key = tuple((t.name, t.content_hash) for t in catalog)
        built = self._session_engines.get(key)
        if built is not None:
            self._session_engines.move_to_end(key)
            return built
        fut = self._building.get(key)
        if fut is None:
            fut = self._building[key] = asyncio.ensure_future(self._build_session(base, catalog))
            fut.add_done_callback(lambda _: self._building.pop(key, None))
        engine = await asyncio.shield(fut)
        built = self._session_engines.setdefault(key, engine)
        while len(self._session_engines) > self.limits.session_catalogs:
            self._session_engines.popitem(last=False)
        return built

    async def _build_session(self, base: Sidecar, catalog: Catalog) -> Sidecar:
        """Index a session catalog on the index thread beside the model thread, embedding on
        second contexts of the models (`hello_embed = "beside"`). Or in slices on the model
        thread, `catalog_slice_tools` new ones per job (the tools the server's index already
        has embed nothing). Each job queues behind the batch being judged and the next batch
        queues behind it, so other sessions wait at most one slice."""
        loop = asyncio.get_running_loop()
        if self.limits.hello_embed == "beside":
            return await loop.run_in_executor(self._indexer, base.with_catalog, catalog, False, True)  # not stored; beside
        old = base.catalog
        known = [t for t in catalog if (o := old.get(t.name)) is not None and o.content_hash == t.content_hash]
        names = {t.name for t in known}
        fresh = [t for t in catalog if t.name not in names]
        starts = slice_starts(fresh, self.limits.catalog_slice_tools, self._cost_per_char, self.limits.shared_batch_ms / 1000)
        steps = [Catalog(known + fresh[:i], catalog.sources) for i in starts[1:]] + [catalog]  # each step embeds one more slice
        engine = base
        for cat in steps:
            engine = await loop.run_in_executor(self._worker, engine.with_catalog, cat, False)  # hello tools are not stored
        return engine

    # Evaluation -----------------------------------------------------------------------

    def _queue(self, conn: Connection, evaluations: list[Evaluation]) -> None:
        """Decide the spans the patterns block at once (`settle`), queue the rest."""
        if self.closing or not evaluations:
            return
        within = self.limits.settle_ms / 1000
        queued, now = 0, time.monotonic()
        for ev in evaluations:
            verdict = settle(ev, within) if within and conn.settling.take(1, now) and self._settling.take(1, now) else None
            if verdict is None:
                self.pending.put(ev)
                queued += 1
            else:
                self.pending.supersede(ev)  # an older span of its clause, still waiting, would say less
                self._deliver(verdict)
        if queued:
            self._owe(conn, queued)

    def _end(self, conn: Connection, stream: str) -> None:
        """An `ended` is owed once the spans queued before this `end` are delivered."""
        key = (conn.session, stream)
        self._ending[key] = self._ending.get(key, 0) + 1
        conn.ends += 1
        self._owe(conn, 1)

    def _owe(self, conn: Connection, n: int) -> None:
        self._backlogged.add(conn)
        self._wake.set()

    async def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            now = time.perf_counter()
            batch_ms = self._batch_ms(now)
            budget = batch_ms / 1000 if self._cost_per_char is not None else None
            if self._cost_per_char:  # overload: whole streams go before every stream is late
                self.pending.shed(self.limits.shed_ms / 1000 / self._cost_per_char, self.limits.shed_turns_ms / 1000 / self._cost_per_char)
                if shed := self.pending.take_shed():  # ... and their senders wait what they would have cost
                    sharing = self.pending.owners() | self._answered.keys()
                    for session, chars in shed.items():
                        if (conn := self.connections.get(session)) is not None and sharing - {session}:  # a lone client holds no one up
                            conn.hold(chars * self._cost_per_char, self.limits.stale_ms / 1000)
            # shared: a span that waited behind a flood's batch is not judged beside a second round of it
            batch = self.pending.take(now, self.limits.max_batch_spans, budget, self._cost, one_round=batch_ms < self.limits.max_batch_ms)
            batch = [ev for ev in batch if not ev.owner.closed]
            for ev in batch:
                self._answered[ev.owner] = now
                self._answered.move_to_end(ev.owner)
            self._release_backlogs()
            if batch:
                await self._judge(loop, batch)
            self._answer_ends()
            if len(self.pending) or self._ending:
                self._wake.set()
                await asyncio.sleep(0)  # let readers and writers run between batches

    def _batch_ms(self, now: float) -> float:
        """The next batch's estimated work. `shared_batch_ms` while other connections wait or
        were answered within SHARED_WINDOW_S (or a hello's slices queue between batches), so a span
        that arrives behind the batch waits a short one; `max_batch_ms` while one connection has
        the model to itself, or while more than a big batch waits spread over many connections
        (no one holds half of it): then every stream is a neighbour's victim alike and bigger
        batches judge more a second (the model embeds a batch of texts at a lower cost per
        text; 250 ms batches judged about 1.6 times the spans 40 ms ones did at saturation),
        and while the connections sharing the model are all busy or all light (`_light`):
        short batches only shorten a light connection's wait behind a busy one's (at 1x load,
        61 light streams, they cut the model's throughput under the load and decisions took
        190 ms at the median instead of 16-22). One connection flooding the queue keeps the
        batches short for the others."""
        while self._answered and now - next(iter(self._answered.values())) > SHARED_WINDOW_S:
            self._answered.popitem(last=False)
        owners = self.pending.owners() | self._answered.keys()
        between = self._building and self.limits.hello_embed == "between"  # a hello's slices queue between batches
        shared = len(owners) > 1 or bool(between and owners)
        if not shared:
            return self.limits.max_batch_ms
        saturated = self.pending.weight_total * (self._cost_per_char or 0.0) * 1000 > self.limits.max_batch_ms
        if saturated and self.pending.heaviest_share() < SATURATED_SHARE:
            return self.limits.max_batch_ms
        live = [o for o in owners if o in self.connections]
        if not between and sum(map(self._light, live)) in (0, len(live)):  # all busy, or all light: no neighbour's batch to wait out
            return self.limits.max_batch_ms
        return min(self.limits.max_batch_ms, self.limits.shared_batch_ms)

    def _light(self, session: Session) -> bool:
        """Whether a connection that shares the model is one whose next span a short batch
        can speed up: at most one span of its waiting, not held for sending faster than the
        model judges, and read (not paused on a full outbox); else busy. Short batches cost
        throughput (8 connections flooding judged 63-87 spans a second with short batches for
        everyone, 88-99 with 40 ms ones), which only such a connection gains."""
        conn = self.connections[session]
        return self.pending.count(session) <= 1 and conn.held_until <= time.monotonic() and not conn.over_quota()

    def _cost(self, ev: Evaluation) -> float:
        """A span's estimated share of a batch's time on the model thread, in seconds."""
        return (self._cost_per_char or 0.0) * span_chars(ev)

    def _answer_ends(self) -> None:
        """`ended` for every stream none of whose spans wait any more: those queued before
        its `end` were in batches delivered by now (or dropped, and counted)."""
        done = []
        for key, n in self._ending.items():
            session, stream = key
            if self.pending.stream_pending(session, stream):
                continue
            done.append(key)
            if (conn := self.connections.get(session)) is not None:
                for _ in range(n):
                    conn.send(p.Ended(stream))
        for key in done:
            del self._ending[key]

    async def _judge(self, loop: asyncio.AbstractEventLoop, batch: list[Evaluation]) -> None:
        self._busy = True
        try:
            verdicts, sizes, took = await loop.run_in_executor(self._worker, timed_judge, batch)
        except Exception:
            log.exception("judging a batch of %d failed", len(batch))
            verdicts, sizes = [], []
        else:
            per_char = took / sum(map(span_chars, batch))
            prev = self._cost_per_char
            self._cost_per_char = per_char if prev is None else prev + COST_EWMA * (per_char - prev)
        finally:
            self._busy = False
        for n in sizes:
            self.metrics.batch.observe(n)
        for v in verdicts:
            self._deliver(v)

    def _deliver(self, v: Verdict) -> None:
        ev, d = v.ev, v.decision
        self.metrics.latency.observe(time.perf_counter() - ev.received)
        self.metrics.detections.labels(d.tier if d.fired and d.tier else "none", d.path).inc()
        conn = self.connections.get(ev.owner)
        if conn is None:
            return
        if ev.source == "user" and ev.owner.turns is not None:
            ev.owner.turns.embedded(ev.text, v.judgement.vector)
        inject = inject_for(v, self.limits.margin_for(ev.source))
        if inject is not None:
            self.metrics.injections.labels(inject.tier).inc()
            conn.send(inject)
        if ev.owner.hello is not None and ev.owner.hello.decisions:
            conn.send(report(ev, d))

    def _release_backlogs(self) -> None:
        """Some of the queue was just taken: paused connections may be under quota again
        (those with nothing left waiting are no longer tracked)."""
        for conn in list(self._backlogged):
            conn.taken()
            if conn.backlog == 0:
                self._backlogged.discard(conn)

    # Lifecycle ------------------------------------------------------------------------

    async def _close_live(self) -> None:
        """Stop following the live servers and close them (stdio servers are stopped)."""
        if self.live is not None:
            self.live.close()
        if self._servers is not None:
            await self._servers.aclose()

    async def shutdown(self) -> None:
        """Stop accepting, finish queued evaluations and store writes, deliver what they
        produced, close every connection with 1001, then flush the store."""
        if self.closing:
            return
        self.closing = True
        deadline = time.monotonic() + self.limits.shutdown_timeout_s
        self._ws.server.close()  # stop listening; handshakes in flight get 503
        while (len(self.pending) or self._busy or self.records.pending or self._ending) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for c in self.connections.values():
            c.unthrottle()
        flushes = [asyncio.create_task(c.outbox.join()) for c in self.connections.values()]
        if flushes:
            await asyncio.wait(flushes, timeout=max(0.1, deadline - time.monotonic()))
        self._ws.close(close_connections=True)  # 1001 going away
        await self._ws.wait_closed()
        if self.learner is not None:
            await asyncio.wait_for(self.learner.drain(due=False), max(0.1, deadline - time.monotonic()))
            self.learner.close()
        if self.completion is not None:
            self.completion.close()
        for t in self._tasks:
            t.cancel()
        for c in list(self.connections.values()):
            c.stop()
        await self._close_live()
        self._worker.shutdown(wait=False, cancel_futures=True)
        self._indexer.shutdown(wait=False, cancel_futures=True)
        if self.store is not None:
            try:
                self.store.checkpoint()
            except Exception:
                log.exception("store checkpoint failed")


def open_engine(cfg: Config, catalog: Catalog | None, store: Store | None, *, live: bool, progress: bool) -> Sidecar:
    """The engine `serve` and `proxy` run on, ranking ready (before "listening on", not on the
    first user's request). With `live` MCP servers and no catalog files, it starts on no tools:
    the live servers' tools are indexed into it (mcp/live.py). Written cases come after it is
    ready, and so do the tools of a large catalog not yet in the store (serve/completion.py):
    a first start on 605 tools embeds for a minute, which must not hold up the first turn."""
    if catalog is None and live and not cfg.catalogs:
        catalog = Catalog([])  # the live servers' tools alone
    engine = Sidecar.open(cfg, catalog=catalog, store=store, progress=progress, cases=False, at_once=True)
    engine.recommender.prepare()
    return engine


def slice_starts(tools: Sequence[Tool], most: int, cost_per_char: float | None, budget: float) -> list[int]:
    """Where each model-thread job of a hello's new tools starts: at most `most` tools a job
    and, once the model's cost per character is measured, about `budget` seconds of estimated
    embedding a job (one tool at least): a hello of a few huge descriptions takes several jobs,
    so another session's span waits for one of them, not for all."""
    starts: list[int] = []
    size, chars = 0, 0
    for i, tool in enumerate(tools):
        c = tool_chars(tool)
        if not starts or size >= most or (cost_per_char is not None and (chars + c) * cost_per_char > budget):
            starts.append(i)
            size, chars = 0, 0
        size += 1
        chars += c
    return starts


def tool_chars(tool: Tool) -> int:
    """A hello tool's size in the cost estimate: what the index embeds of it (its name and the
    head of its description as one text, and its cases: its own, or up to MAX_CASES derived
    ones of up to MAX_WORDS words), each text with the fixed overhead."""
    if tool.cases:
        cases, case_chars = len(tool.cases[: cases_mod.MAX_CASES]), sum(map(len, tool.cases[: cases_mod.MAX_CASES]))
    else:  # derived: about 7 characters a word
        cases, case_chars = cases_mod.MAX_CASES, cases_mod.MAX_CASES * cases_mod.MAX_WORDS * 7
    return len(tool.name) + min(len(tool.description or ""), PRIMARY_CHARS) + case_chars + COST_OVERHEAD_CHARS * (1 + cases)


def span_chars(ev: Evaluation) -> int:
    """A span's size in the model's cost estimate: its characters and a fixed overhead."""
    return len(ev.text) + COST_OVERHEAD_CHARS


def timed_judge(batch: list[Evaluation]) -> tuple[list[Verdict], list[int], float]:
    """`judge` on the model thread, with the seconds it took there (not counting the wait)."""
    t0 = time.perf_counter()
    verdicts, sizes = judge(batch)
    return verdicts, sizes, time.perf_counter() - t0


def report(ev: Evaluation, d: Decision) -> p.DecisionReport:
    """The `decision` message for a session that opted in."""
    latency = (time.perf_counter() - ev.received) * 1000
    return p.DecisionReport(stream=ev.stream.id, source=ev.source, text=ev.text, start=ev.start, end=ev.end, reason=ev.reason,
                            fired=d.fired, tier=d.tier, path=d.path, tool=d.tool, probability=d.probability,
                            latency_ms=round(latency, 2))  # fmt: skip


def listening(server: SidecarServer) -> str:
    """The start-up line: where it listens and what it serves: the model, the tools and where
    they came from (catalog files, live MCP servers), and the store its history goes to (a
    SQLite file, or a PostgreSQL URL without its password), so a newcomer sees which of
    several stores and catalogs this process uses."""
    pipe = server.engine.pipeline
    sources = [str(c) for c in server.cfg.catalogs or ()]
    if server.live is not None:
        up = sum(st.state == "connected" for st in server.live.manager.status())
        sources.append(f"MCP servers {', '.join(server.mcp.servers)} ({up} of {len(server.mcp.servers)} connected)")
    tools = f"{len(pipe.catalog)} tools from {' and '.join(sources)}" if sources else "no tools of its own: sessions bring theirs"
    store = server.store.location if server.store is not None else "none"
    return (f"listening on {server.url} (model {pipe.embedder.name}, {tools}, store {store}, "
            f"loaded in {server.metrics.load_seconds:.1f} s)")  # fmt: skip


async def run(cfg: Config, catalog: Catalog | None, store: Store, announce=print, mcp: McpConfig | None = None, progress: bool = True) -> int:
    """`sidecar serve`: bind, load, serve until SIGTERM/SIGINT, shut down gracefully.
    Returns the exit status (2 when the model or index cannot be loaded). `progress`: bars on
    stderr while the catalog is indexed."""
    pin_mmap_threshold()  # a long-running process: big freed buffers go back to the OS (issue 13)
    limit_blas_threads(cfg.model.blas_threads)  # no spinning BLAS thread on the event loop's core
    server = SidecarServer(cfg, catalog=catalog, store=store, progress=progress, mcp=mcp)
    await server.start()  # binds (so /healthz can say 503 while loading), then loads
    announce(f"loading {cfg.model.name}")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stopping = asyncio.create_task(stop.wait())
    loading = asyncio.create_task(server.loaded.wait())
    await asyncio.wait([stopping, loading], return_when=asyncio.FIRST_COMPLETED)
    status = 0
    if server.load_error is not None:
        announce(f"error: {server.load_error}")
        status = 2
    elif server.engine is not None:  # only now, with everything loaded, does it say where it listens
        freeze_loaded_heap()  # what loaded stays for the process: full collections need not scan it
        announce(listening(server))
        await stopping
    announce("shutting down")
    await server.shutdown()
    loading.cancel()
    stopping.cancel()
    store.close()
    return status
