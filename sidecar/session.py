"""One connection's state, without I/O: its session catalog, its streams, and what was
already injected into each, so the server only moves frames and the rules live here.

Rules: `hello` comes first (ping aside); `user` is judged whole; `token` feeds the stream's
segmenter, whose spans are judged as LLM output; `end` flushes and closes the stream
(later tokens on it are an error). A tool is injected at most once per stream id.
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .catalog import Catalog, CatalogError, from_tools
from .config import ServerConfig
from .gate import Decision, tier_of
from .protocol import Hello, Inject, InjectedTool, ProtocolError, TriggerInfo
from .stream import Segmenter, Span


@dataclass(eq=False)
class StreamState:
    id: str
    segmenter: Segmenter | None = None  # set while tokens may arrive
    ended: bool = False
    injected: set[str] = field(default_factory=set)


@dataclass(eq=False)
class Evaluation:
    """A span waiting for the pipeline. `key` identifies what a newer span supersedes."""

    session: Session
    stream: StreamState
    text: str
    start: int
    end: int
    source: str  # "user" | "llm"
    received: float  # perf_counter when the frame that completed it arrived
    key: object  # a newer evaluation with the same key supersedes a pending one
    reason: str = "user"  # why the span was cut: "user" (a whole turn) or a stream.Span reason


class Session:
    def __init__(self, limits: ServerConfig, catalog: Catalog, pipeline: Any = None):
        self.limits = limits
        self.hello: Hello | None = None
        self.catalog = catalog  # the session's (server's, narrowed or extended by hello.tools)
        self.pipeline = pipeline  # the Pipeline that judges this session's spans
        self.closed = False
        self._streams: OrderedDict[str, StreamState] = OrderedDict()  # LRU, bounded
        self._open = 0

    @property
    def open_streams(self) -> int:
        return self._open

    def start(self, hello: Hello, catalog: Catalog, pipeline: Any) -> None:
        if self.hello is not None:
            raise ProtocolError("hello_again", "this connection already said hello")
        self.hello, self.catalog, self.pipeline = hello, catalog, pipeline

    def require_hello(self, kind: str) -> None:
        if self.hello is None:
            raise ProtocolError("no_hello", f"send hello before {kind}")

    def on_user(self, stream: str, text: str, received: float) -> list[Evaluation]:
        self.require_hello("user")
        state = self._state(stream)
        stripped = text.strip()
        if not stripped:
            return []
        start = len(text) - len(text.lstrip())
        return [Evaluation(self, state, stripped, start, start + len(stripped), "user", received, object())]

    def on_token(self, stream: str, delta: str, received: float) -> list[Evaluation]:
        self.require_hello("token")
        state = self._state(stream)
        if state.ended:
            raise ProtocolError("stream_ended", f"stream {stream!r} has ended; use a new stream id")
        if state.segmenter is None:
            if self._open >= self.limits.max_streams:
                raise ProtocolError("too_many_streams", f"at most {self.limits.max_streams} open streams per connection; end one first")
            state.segmenter = Segmenter(self.limits.span_words, self.limits.max_stream_chars)
            self._open += 1
        return self._evaluations(state, state.segmenter.feed(delta), received)

    def on_end(self, stream: str, received: float) -> list[Evaluation]:
        self.require_hello("end")
        state = self._streams.get(stream)
        if state is None:
            raise ProtocolError("unknown_stream", f"no stream {stream!r} on this connection")
        if state.ended:
            return []
        spans = state.segmenter.end() if state.segmenter else []
        if state.segmenter is not None:
            self._open -= 1
        state.segmenter, state.ended = None, True
        return self._evaluations(state, spans, received)

    def _evaluations(self, state: StreamState, spans: Sequence[Span], received: float) -> list[Evaluation]:
        # Keyed by (stream, clause start): a clause judged again as it grows supersedes its
        # pending shorter self, but a finished clause is never lost to the next one.
        return [Evaluation(self, state, s.text, s.start, s.end, "llm", received, (state, s.start), s.reason) for s in spans]

    def _state(self, stream: str) -> StreamState:
        state = self._streams.get(stream)
        if state is None:
            state = self._streams[stream] = StreamState(stream)
            self._evict()
        else:
            self._streams.move_to_end(stream)
        return state

    def _evict(self) -> None:
        """Forget the least recently used closed streams beyond a bound (open ones stay)."""
        keep = 4 * self.limits.max_streams
        if len(self._streams) <= keep:
            return
        for sid in [s for s, st in self._streams.items() if st.segmenter is None][: len(self._streams) - keep]:
            del self._streams[sid]

    def inject_for(self, ev: Evaluation, d: Decision, margin: float, limit: int) -> Inject | None:
        """The inject a fired decision calls for: its best tool and runners-up that clear the
        same bar within `margin` of it, minus tools this stream already got."""
        if not d.fired or d.tier is None or d.score is None or self.closed:
            return None
        thresholds = self.pipeline.thresholds
        bar = max(d.threshold or 0.0, d.score - margin)
        tools: list[InjectedTool] = []
        tier = None
        for c in d.candidates:
            if len(tools) >= limit:
                break
            c_tier = tier_of(c.score, thresholds)
            if c.score < bar or c_tier is None or c.tool in ev.stream.injected:
                continue
            tier = tier or c_tier  # the best tool sent decides the tier
            tool = self.catalog.get(c.tool)
            if tool is None:
                continue
            why = f"{d.path}: {c.score:.2f} >= {d.threshold:.2f}, like {c.case!r}"
            tools.append(InjectedTool(tool.definition(), c.score, why))
        if not tools:
            return None
        ev.stream.injected.update(t.definition["name"] for t in tools)
        trig = d.trigger
        lo, hi, text = (trig.start, trig.end, trig.text) if trig else (0, len(ev.text), ev.text)
        trigger = TriggerInfo(text, ev.start + lo, ev.start + hi, d.path)
        latency = (time.perf_counter() - ev.received) * 1000
        return Inject(stream=ev.stream.id, tier=tier, tools=tools, trigger=trigger, latency_ms=round(latency, 2))


def session_catalog(base: Catalog, entries: Sequence[str | dict[str, Any]] | None) -> Catalog:
    """hello.tools applied to the server's catalog: names keep those server tools (all of
    them when no name is given), definitions add tools (replacing a server tool of the
    same name). Raises ProtocolError naming an unknown tool or a bad definition."""
    if not entries:
        return base
    names = [e for e in entries if isinstance(e, str)]
    defs = [e for e in entries if not isinstance(e, str)]
    unknown = [n for n in names if base.get(n) is None]
    if unknown:
        raise ProtocolError("unknown_tool", f"hello.tools names tools the server does not have: {', '.join(unknown)}")
    try:
        extra = from_tools(defs, "hello.tools") if defs else Catalog([])
    except CatalogError as e:
        raise ProtocolError("bad_catalog", str(e)) from None
    if len({t.name for t in extra}) != len(extra):
        raise ProtocolError("bad_catalog", "hello.tools defines a tool name twice")
    kept = [base.get(n) for n in dict.fromkeys(names)] if names else list(base)
    replaced = set(extra.names())
    return Catalog([t for t in kept if t.name not in replaced] + list(extra), [*base.sources, "hello.tools"])


def derive_pipeline(base: Any, catalog: Catalog) -> Any:
    """A pipeline judging `catalog` with everything else shared (model, patterns,
    thresholds, store): `reindex` reuses the base index's unchanged tools and the store's
    embedding cache, so only new tool texts are embedded."""
    if hasattr(base, "with_catalog"):  # the pipeline's own API, when it grows one
        return base.with_catalog(catalog)
    clone = copy.copy(base)
    clone.reindex(catalog)  # rebinds clone.indexes / clone.catalog; base is untouched
    return clone
