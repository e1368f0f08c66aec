"""One connection's state, without I/O: its session catalog, its streams, and what was
already injected into each, so the server only moves frames and the rules live here.

Rules: `hello` comes first (ping aside); `user` is judged whole; `token` feeds the stream's
segmenter, whose spans are judged as LLM output; `end` flushes and closes the stream
(later tokens on it are an error). When the gate fires, the session's recommender picks the
tools (`judge`); a tool is injected at most once per stream id.
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from .catalog import Catalog, CatalogError, from_tools
from .config import ServerConfig
from .gate import Decision
from .pipeline import Request
from .protocol import Hello, Inject, InjectedTool, ProtocolError, TriggerInfo
from .recommend.filters import Context, Permissions
from .stream import Segmenter, Span

if TYPE_CHECKING:
    import numpy as np

    from .recommend.recommender import Recommendations


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
    def __init__(self, limits: ServerConfig, catalog: Catalog, pipeline: Any = None, recommender: Any = None):
        self.limits = limits
        self.hello: Hello | None = None
        self.catalog = catalog  # the session's (server's, narrowed or extended by hello.tools)
        self.pipeline = pipeline  # the Pipeline that judges this session's spans
        self.recommender = recommender  # the Recommender over that pipeline: picks the tools to inject
        self.context = Context()  # who asks and what it may be offered, from the hello
        self.closed = False
        self._streams: OrderedDict[str, StreamState] = OrderedDict()  # LRU, bounded
        self._open = 0

    @property
    def open_streams(self) -> int:
        return self._open

    def start(self, hello: Hello, catalog: Catalog, pipeline: Any, recommender: Any = None) -> None:
        if self.hello is not None:
            raise ProtocolError("hello_again", "this connection already said hello")
        self.hello, self.catalog, self.pipeline, self.recommender = hello, catalog, pipeline, recommender
        self.context = context_of(hello)

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

    def rank(self, ev: Evaluation, d: Decision, vector: np.ndarray | None, top: int) -> Recommendations | None:
        """The recommender's tools for a span the gate fired on (None when it did not).
        On the model thread: without `vector` the recommender embeds the span."""
        if not d.fired or self.recommender is None:
            return None
        context = msgspec.structs.replace(self.context, source=ev.source)
        return self.recommender.recommend(ev.text, context, top=top, query_vector=vector)

    def inject_for(self, v: Verdict, margin: float) -> Inject | None:
        """The inject a fired decision calls for: the recommender's best tool and runners-up
        within `margin` of its score, minus tools this stream already got. The tier and the
        trigger are the gate's."""
        ev, d, ranked = v.ev, v.decision, v.ranked
        if not d.fired or d.tier is None or ranked is None or not ranked.results or self.closed:
            return None
        bar = ranked.results[0].score - margin
        tools: list[InjectedTool] = []
        for r in ranked.results:
            tool = self.catalog.get(r.tool)
            if r.score >= bar and tool is not None and r.tool not in ev.stream.injected:
                tools.append(InjectedTool(tool.definition(), r.score, r.why))
        if not tools:
            return None
        ev.stream.injected.update(t.definition["name"] for t in tools)
        trig = d.trigger
        lo, hi, text = (trig.start, trig.end, trig.text) if trig else (0, len(ev.text), ev.text)
        trigger = TriggerInfo(text, ev.start + lo, ev.start + hi, d.path)
        latency = (time.perf_counter() - ev.received) * 1000
        return Inject(stream=ev.stream.id, tier=d.tier, tools=tools, trigger=trigger, latency_ms=round(latency, 2))


@dataclass(eq=False)
class Verdict:
    """A judged evaluation: the gate's decision and, when it fired, the recommender's ranking."""

    ev: Evaluation
    decision: Decision
    ranked: Recommendations | None = None


def judge(evaluations: Sequence[Evaluation], top: int) -> tuple[list[Verdict], list[int]]:
    """On the model thread (it embeds): one `judge_batch` per distinct pipeline, then each
    fired span ranked by its session's recommender on the span's own vector. The server and
    replay both judge through here, so they inject alike. Also returns the batch sizes."""
    groups: dict[int, tuple[Any, list[Evaluation]]] = {}
    for ev in evaluations:
        groups.setdefault(id(ev.session.pipeline), (ev.session.pipeline, []))[1].append(ev)
    out: list[Verdict] = []
    for pipe, evs in groups.values():
        judged = pipe.judge_batch([Request(ev.text, ev.source) for ev in evs])
        for ev, d, vec in zip(evs, judged.decisions, judged.vectors):
            out.append(Verdict(ev, d, ev.session.rank(ev, d, vec, top)))
    return out, [len(evs) for _, evs in groups.values()]


def context_of(hello: Hello) -> Context:
    """What the recommender filters a session's tools by: `hello.permissions` are globs of
    the tools it may be offered (catalog or server name), `hello.project` a project tag."""
    allowed = Permissions(allow=list(hello.permissions)) if hello.permissions is not None else None
    return Context(agent=hello.agent, permissions=allowed, project_tags=[hello.project] if hello.project else [])

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
