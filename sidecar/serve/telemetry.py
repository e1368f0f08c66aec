"""What the server's /metrics shows, kept with prometheus-client: counters and histograms the
server updates as it works, and a collector that reads the server's live state (queue, open
connections, drops, regex timeouts) when scraped. One registry per server, so several servers
in one process (tests, embedding) never share numbers.

Memory (issue 13): beside the process's RSS, /metrics splits what holds it, since RSS alone
cannot tell a bound filling from a leak: Python's allocated blocks, the stream states the
sessions remember, the query cache, and what tracemalloc cannot see, glibc malloc's and
SQLite's own accounts (`native_memory`, read through ctypes)."""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, GCCollector, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .pending import REASONS

prometheus_client.disable_created_metrics()  # no *_created series: they double the exposition for nothing here

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    def __init__(self, server: Any):
        r = self.registry = CollectorRegistry()
        self.frames = Counter("sidecar_frames", "WebSocket frames, by direction and message type.", ("direction", "type"), registry=r)
        self.detections = Counter("sidecar_detections", "Judged spans by tier (none: silent) and gate path.", ("tier", "path"), registry=r)
        self.injections = Counter("sidecar_injections", "inject messages sent, by tier.", ("tier",), registry=r)
        self.latency = Histogram("sidecar_decision_latency_seconds", "From the frame completing a span to its decision.",
                                 buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.batch = Histogram("sidecar_batch_size", "Evaluations judged per model call.", buckets=BATCH_BUCKETS, registry=r)
        self.errors = Counter("sidecar_errors", "error messages sent, by code.", ("code",), registry=r)
        self.throttled = Counter("sidecar_read_throttled_seconds", "Time connections were not read for sending more than "
                                 "read_chars_per_s.", registry=r)  # fmt: skip
        self.timeouts = Counter("sidecar_connection_timeouts", "Connections closed for silence: no hello in time, or idle.", ("kind",), registry=r)
        self.refused = Counter("sidecar_refused_connections", "Connections refused for capacity: max_connections, or "
                               "max_connections_per_address from one peer address.", ("reason",), registry=r)  # fmt: skip
        self.events = Counter("sidecar_events", "tool_result / feedback records committed.", ("kind",), registry=r)
        self.unchanged = Counter("sidecar_spans_unchanged", "Longer spans of a growing clause not judged: no content word gained.",
                                 registry=r)  # fmt: skip
        self.traffic = Counter("sidecar_traffic_examples", "User turns recorded to learn from: called (a tool followed) or silent (none did).",
                               ("kind",), registry=r)  # fmt: skip
        self.traffic_dropped = Counter("sidecar_traffic_dropped", "User turns dropped before being recorded: learning was behind "
                                       "by max_examples of them.", registry=r)  # fmt: skip
        self.refits = Counter("sidecar_refits", "Refits from traffic: swapped (the lesson is in use) or kept (it did not judge better).",
                              ("outcome",), registry=r)  # fmt: skip
        self.load = Gauge("sidecar_model_load_seconds", "Time to load the model and build the index.", registry=r)
        self.load_seconds = 0.0
        ProcessCollector(registry=r)  # process_cpu_seconds_total, resident memory, open fds
        GCCollector(registry=r)  # python_gc_collections_total{generation}: full collections pause every client
        gc_pauses()  # and how long they paused it
        r.register(_Live(server))

    def loaded(self, seconds: float) -> None:
        self.load_seconds = seconds
        self.load.set(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, sample: str, **labels: str) -> float:
        """One sample as /metrics would show it (0 when never counted)."""
        return self.registry.get_sample_value(sample, labels) or 0.0


TOOLS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)


class ProxyMetrics:
    """What `sidecar proxy`'s /metrics shows (one registry per proxy)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("sidecar_proxy_requests", "Requests, by API (chat: /v1/chat/completions, messages: /v1/messages), "
                                "stream or not, and the status answered.", ("api", "mode", "status"), registry=r)  # fmt: skip
        self.tools_added = Histogram("sidecar_proxy_tools_added", "Tools the proxy added to a request (before any narration).",
                                     buckets=TOOLS_BUCKETS, registry=r)  # fmt: skip
        self.schema_tokens_sent = Counter("sidecar_proxy_schema_tokens_sent", "Tokens of the tool schemas the proxy added "
                                          "(cl100k_base, in the request's shape).", registry=r)  # fmt: skip
        self.schema_tokens_saved = Counter("sidecar_proxy_schema_tokens_saved", "Tokens of tool schemas not sent: the whole "
                                           "catalog's minus those added, per request.", registry=r)  # fmt: skip
        self.catalog_tokens = Gauge("sidecar_proxy_catalog_schema_tokens", "Tokens of every catalog tool's schema in one request.",
                                    registry=r)  # fmt: skip
        self.gate = Histogram("sidecar_proxy_judge_seconds", "Judging a request's last user turn, before it goes upstream.",
                              buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.narrations = Counter("sidecar_proxy_narrations", "Replies whose text called for tools they were not given, by action.",
                                  ("action",), registry=r)  # fmt: skip
        self.restarts = Counter("sidecar_proxy_restarts", "Upstream calls stopped and sent again with narrated tools.", registry=r)
        self.mcp_calls = Counter("sidecar_proxy_mcp_calls", "Injected MCP tools the proxy ran, by outcome.", ("outcome",), registry=r)
        self.find_tools = Counter("sidecar_find_tools", "find_tools calls the proxy answered itself, by outcome: found, none (nothing "
                                  "matched), limit (past proxy.max_searches), bad_query.", ("outcome",), registry=r)  # fmt: skip
        self.upstream_errors = Counter("sidecar_proxy_upstream_errors", "Upstream calls that failed, by kind.", ("kind",), registry=r)
        self.cancelled = Counter("sidecar_proxy_cancelled", "Requests whose client went away before the answer.", registry=r)
        ProcessCollector(registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, sample: str, **labels: str) -> float:
        return self.registry.get_sample_value(sample, labels) or 0.0


class _Live(Collector):
    """Values read from the server when scraped, not counted twice."""

    def __init__(self, server: Any):
        self.server = server

    def collect(self) -> Iterator[Any]:
        s = self.server
        yield _gauge("sidecar_queue_depth", "Evaluations waiting for the model.", len(s.pending))
        yield _gauge("sidecar_connections", "Open websocket connections.", len(s.connections))
        yield _gauge("sidecar_records_waiting", "tool_result and feedback records received and not yet committed to the store.",
                     s.records.waiting)
        yield _gauge("sidecar_ready", "1 once the model and index are loaded.", float(s.ready))
        dropped = CounterMetricFamily("sidecar_dropped_evaluations", "Evaluations dropped under load, by reason.", labels=("reason",))
        for reason in REASONS:
            dropped.add_metric((reason,), s.pending.dropped[reason])
        yield dropped
        timeouts = CounterMetricFamily("sidecar_regex_timeouts",
                                       "Pattern searches cut off at their time budget, by pattern set (a negative one blocks).",
                                       labels=("set",))  # fmt: skip
        pats = s.engine.pipeline.patterns if s.engine is not None else None
        for name in ("negative", "high"):
            timeouts.add_metric((name,), getattr(pats, name).timeouts if pats is not None else 0)
        yield timeouts
        cache = s.engine.pipeline.queries if s.engine is not None else None
        hits = CounterMetricFamily("sidecar_query_cache_hits", "Texts whose embedding came from the query cache (not embedded).")
        hits.add_metric((), cache.hits if cache is not None else 0)
        yield hits
        misses = CounterMetricFamily("sidecar_query_cache_misses", "Texts embedded (the query cache did not have them).")
        misses.add_metric((), cache.misses if cache is not None else 0)
        yield misses
        yield _gauge("sidecar_query_cache_entries", "Query embeddings held in the cache.", len(cache) if cache is not None else 0)
        stats = s.engine.cascade_stats if s.engine is not None else None
        cascade = CounterMetricFamily("sidecar_cascade_texts", "Texts the cascade's screen model judged: settled as no tool "
                                      "(the main model never ran) or passed on to it.", labels=("outcome",))  # fmt: skip
        cascade.add_metric(("settled",), stats.settled if stats is not None else 0)
        cascade.add_metric(("passed",), stats.passed if stats is not None else 0)
        yield cascade
        down = CounterMetricFamily("sidecar_history_unavailable", "Rankings made on neutral history because the metrics store "
                                   "could not be read (fail open).")  # fmt: skip
        down.add_metric((), s.engine.recommender.history_errors if s.engine is not None else 0)
        yield down
        # Python's heap (pymalloc maps its small-object arenas itself: malloc's figures miss it)
        yield _gauge("sidecar_python_allocated_blocks", "Blocks Python's allocator holds (sys.getallocatedblocks).",
                     sys.getallocatedblocks())  # fmt: skip
        pauses = gc_pauses()
        total = CounterMetricFamily("sidecar_gc_pause_seconds", "Time the garbage collector held the process (and the GIL), by generation.",
                                    labels=("generation",))  # fmt: skip
        longest = GaugeMetricFamily("sidecar_gc_pause_max_seconds", "The longest single collection, by generation.", labels=("generation",))
        for gen in range(3):
            total.add_metric((str(gen),), pauses.total[gen])
            longest.add_metric((str(gen),), pauses.longest[gen])
        yield total
        yield longest
        if _blas_threads is not None:
            yield _gauge("sidecar_blas_threads", "Threads numpy's BLAS may use in this process (model.blas_threads).", _blas_threads)
        yield _gauge("sidecar_python_frozen_objects", "Objects loaded at start-up that the garbage collector no longer scans "
                     "(gc.freeze: freeze_loaded_heap).", _frozen_objects)  # fmt: skip
        yield _gauge("sidecar_session_streams", "Stream states the open connections remember (open, ended and user-turn ones).",
                     sum(len(getattr(c.session, "_streams", ())) for c in list(s.connections.values())))  # fmt: skip
        native = native_memory()
        if native is not None:
            yield _gauge("sidecar_malloc_heap_bytes", "glibc malloc: bytes its arenas took from the OS (sbrk/mmap'd heaps, mmap'd chunks).",
                         native.heap)  # fmt: skip
            yield _gauge("sidecar_malloc_in_use_bytes", "glibc malloc: bytes allocated and not freed.", native.in_use)
            yield _gauge("sidecar_malloc_free_bytes", "glibc malloc: bytes freed but kept in its arenas (resident only where touched).",
                         native.free)  # fmt: skip
            yield _gauge("sidecar_malloc_arenas", "glibc malloc arenas (about one per thread that allocated, up to MALLOC_ARENA_MAX).",
                         native.arenas)  # fmt: skip
            yield _gauge("sidecar_sqlite_memory_bytes", "SQLite's own allocations (page caches, statements) in this process.", native.sqlite)


def _gauge(name: str, doc: str, value: float | Callable[[], float]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class NativeMemory(msgspec.Struct, frozen=True):
    """What the C libraries hold, which tracemalloc cannot see: glibc malloc's account
    (mallinfo2, summed over arenas) and SQLite's (sqlite3_memory_used)."""

    heap: int  # bytes malloc took from the OS: arena heaps + mmap'd chunks
    in_use: int  # allocated, not freed
    mapped: int  # of which in blocks mapped on their own (at least the mmap threshold)
    free: int  # freed, still held by malloc (resident only where touched before)
    arenas: int
    sqlite: int


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                                                "keepcost")]  # fmt: skip


@functools.cache
def _libs() -> tuple[Any, Any] | None:
    """glibc and the libsqlite3 Python's sqlite3 module loaded, or None off glibc."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _MallInfo2
        libc.open_memstream.restype = ctypes.c_void_p
        libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
        libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        libc.free.argtypes = [ctypes.c_void_p]
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    try:
        import sqlite3  # noqa: F401 (loads the libsqlite3 the store uses, so dlopen finds that one)

        sqlite = ctypes.CDLL("libsqlite3.so.0")
        sqlite.sqlite3_memory_used.restype = ctypes.c_int64
    except (OSError, AttributeError):
        sqlite = None
    return libc, sqlite


def native_memory() -> NativeMemory | None:
    """The C libraries' memory now (None where glibc's calls are missing)."""
    libs = _libs()
    if libs is None:
        return None
    libc, sqlite = libs
    m = libc.mallinfo2()
    buf, size = ctypes.c_void_p(), ctypes.c_size_t()
    arenas = 0
    fp = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    if fp:
        libc.malloc_info(0, fp)
        libc.fclose(fp)
        arenas = len(re.findall(rb"<heap nr=", ctypes.string_at(buf, size.value)))
        libc.free(buf)
    return NativeMemory(heap=m.arena + m.hblkhd, in_use=m.uordblks + m.hblkhd, mapped=m.hblkhd, free=m.fordblks, arenas=arenas,
                        sqlite=sqlite.sqlite3_memory_used() if sqlite is not None else 0)  # fmt: skip


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 2 << 20  # above max_frame_bytes' default: a megabyte frame's buffers are reused, not mapped anew
TRIM_THRESHOLD = 4 << 20  # free memory a heap keeps at its top before giving it back


def pin_mmap_threshold(size: int = MMAP_THRESHOLD, trim: int = TRIM_THRESHOLD) -> bool:
    """Keep glibc's mmap threshold at `size` and its trim threshold at `trim` (mallopt), so
    blocks at least `size` large are always mapped and unmapped on free, and a heap keeps at
    most `trim` free at its top. By default glibc raises the mmap threshold to the largest
    block freed (up to 32 MiB, the trim threshold to twice that); big short-lived buffers are
    then carved from the heaps, whose freed space stays with the process: in bench/soak.py
    the free bytes malloc held grew in steps, 2.5 to 6.7 MB in 6 minutes, and stayed within
    1.5-2.4 MB pinned at 128 KiB. But at 128 KiB every buffer of a megabyte frame (the
    websocket's, its text, its decoded delta) was a fresh mapping whose pages fault when first
    written: decoding a 1 MB token frame took 2.4 ms of the event loop instead of 0.9 ms
    (issue 33). Not done when MALLOC_MMAP_THRESHOLD_ is set (glibc already obeys it); False
    off glibc."""
    libs = _libs()
    if libs is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    return bool(libs[0].mallopt(M_MMAP_THRESHOLD, size)) and bool(libs[0].mallopt(M_TRIM_THRESHOLD, trim))


_blas_threads: int | None = None  # numpy's BLAS threads once limit_blas_threads ran (None: not run, or no BLAS found)


def limit_blas_threads(threads: int) -> int | None:
    """Hold numpy's BLAS (OpenBLAS in numpy's wheels) to `threads` threads for the process; 0
    leaves its default, a thread per core. Returns the threads it then has (None: no BLAS
    library loaded), kept for /metrics. A serving process wants one: OpenBLAS's threads spin
    between calls, so with the model thread saturated, its batches' small matrix products
    kept a second thread at 100% of the other core of 2, the core the event loop and the
    clients needed (docs/configuration.md, `blas_threads`)."""
    global _blas_threads
    from threadpoolctl import threadpool_info, threadpool_limits

    if threads > 0:
        threadpool_limits(threads, user_api="blas")  # not used as a context: kept for the process
    found = [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]
    _blas_threads = max(found) if found else None
    return _blas_threads


class GcPauses:
    """How long the garbage collector held the process, per generation: a collection runs
    holding the GIL, so each one pauses the event loop and the model thread alike. Installed
    once per process (gc.callbacks is process-wide); every server's /metrics reads it."""

    def __init__(self) -> None:
        self.total = [0.0, 0.0, 0.0]
        self.longest = [0.0, 0.0, 0.0]
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
            return
        gen, took = info["generation"], now - self._started
        self.total[gen] += took
        self.longest[gen] = max(self.longest[gen], took)


@functools.cache
def gc_pauses() -> GcPauses:
    pauses = GcPauses()
    gc.callbacks.append(pauses)
    return pauses


_frozen_objects = 0  # what freeze_loaded_heap froze (nothing else freezes or unfreezes)


def freeze_loaded_heap() -> int:
    """Collect, then move every object alive now (the model's wrappers, the catalog, the
    calibration, the patterns: what lives as long as the process) out of the garbage
    collector's reach (gc.freeze). A full collection scans every tracked object while it
    holds the GIL, so each one paused the event loop and the model thread: 58-78 ms apiece
    on a MiniLM server of 111,000 objects, every few hellos of an attacker whose
    permissions were compiled (issue 33), 2-15 ms once the loaded heap is frozen. Returns
    how many objects were frozen (kept for /metrics: gc.get_freeze_count walks them all,
    13 ms of the event loop on that server at every scrape)."""
    global _frozen_objects
    gc.collect()
    gc.freeze()
    _frozen_objects = gc.get_freeze_count()
    return _frozen_objects
