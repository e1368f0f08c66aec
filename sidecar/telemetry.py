"""What the server's /metrics shows, kept with prometheus-client: counters and histograms the
server updates as it works, and a collector that reads the server's live state (queue, open
connections, drops, regex timeouts) when scraped. One registry per server, so several servers
in one process (tests, embedding) never share numbers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
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
        self.events = Counter("sidecar_events", "tool_result / feedback records committed.", ("kind",), registry=r)
        self.unchanged = Counter("sidecar_spans_unchanged", "Longer spans of a growing clause not judged: no content word gained.",
                                 registry=r)  # fmt: skip
        self.load = Gauge("sidecar_model_load_seconds", "Time to load the model and build the index.", registry=r)
        self.load_seconds = 0.0
        ProcessCollector(registry=r)  # process_cpu_seconds_total, resident memory, open fds
        r.register(_Live(server))

    def loaded(self, seconds: float) -> None:
        self.load_seconds = seconds
        self.load.set(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, sample: str, **labels: str) -> float:
        """One sample as /metrics would show it (0 when never counted)."""
        return self.registry.get_sample_value(sample, labels) or 0.0


class _Live(Collector):
    """Values read from the server when scraped, not counted twice."""

    def __init__(self, server: Any):
        self.server = server

    def collect(self) -> Iterator[Any]:
        s = self.server
        yield _gauge("sidecar_queue_depth", "Evaluations waiting for the model.", len(s.pending))
        yield _gauge("sidecar_connections", "Open websocket connections.", len(s.connections))
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


def _gauge(name: str, doc: str, value: float | Callable[[], float]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
