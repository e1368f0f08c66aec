"""One connection's state, without I/O: its scope, its streams, and what was already
injected into each, so the server only moves frames and the rules live here.

Rules: `hello` comes first (ping aside) and fixes the connection's `Scope` (its catalog,
who asks, the engine that judges); `user` is judged whole; `token` feeds the stream's
segmenter, whose spans are judged as LLM output; `end` flushes and closes the stream
(later tokens on it are an error). Every span carries its scope to `judge`, which hands it
to the engine (`Sidecar.judge`); a tool is injected at most once per stream id.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from ..core.catalog import Catalog, CatalogError, from_tools
from ..config import ServerConfig
from ..core.gate import Decision
from ..core.pipeline import Request
from ..protocol import Hello, Inject, InjectedTool, ProtocolError, TriggerInfo, WorkflowStep
from ..recommend.filters import Context, Permissions
from ..core.stream import Segmenter, Span
from ..learn.traffic import Turn, Turns

if TYPE_CHECKING:
    from ..engine import Judgement, Sidecar


@dataclass(frozen=True, eq=False)
class Scope:
    """What a hello fixes for the rest of its connection: the catalog injected tools come
    from, who asks (the recommender's context), and the engine that judges its spans.

    `own` is None when the hello named no tools: the scope then follows the engine's catalog
    as a live catalog reindexes it in place, so a session started before a re-index gets the
    new tools. `down` names the servers that are down now (a live catalog's): their tools are
    dropped from an inject (`inject_for`) and left out of stand-ins (`context`)."""

    own: Catalog | None
    asked: Context  # the hello's: what spans are ranked in
    engine: Sidecar
    down: Callable[[], Collection[str]] | None = None

    @property
    def catalog(self) -> Catalog:
        return self.own if self.own is not None else self.engine.catalog

    def withheld(self) -> frozenset[str]:
        """The servers whose tools must not be handed out now."""
        return frozenset(self.down()) if self.down is not None else frozenset()

    @property
    def context(self) -> Context:
        """Who asks, with the servers down now: what stand-ins for a failed tool are picked in."""
        down = self.withheld()
        if not down:
            return self.asked
        return msgspec.structs.replace(self.asked, unavailable_servers=sorted({*self.asked.unavailable_servers, *down}))


OFFERS_KEPT = 64  # injected tools a session remembers the ranking of, for feedback (~0.4 KB each)


@dataclass(eq=False)
class StreamState:
    id: str
    segmenter: Segmenter | None = None  # set while tokens may arrive
    ended: bool = False
    received_chars: int = 0  # code points of `token` deltas received on the stream
    injected: set[str] = field(default_factory=set)


@dataclass(eq=False)
class Evaluation:
    """A span waiting for the engine. `key` identifies what a newer span supersedes; `owner`
    is the session whose connection gets the verdict."""

    owner: Session
    scope: Scope
    stream: StreamState
    text: str
    start: int
    end: int
    source: str  # "user" | "llm"
    received: float  # perf_counter when the frame that completed it arrived
    key: object  # a newer evaluation with the same key supersedes a pending one
    reason: str = "user"  # why the span was cut: "user" (a whole turn) or a stream.Span reason
    turn_chars: int | None = None  # a user turn's length (it arrives whole); None: LLM output, counted as it streams
    queued: float | None = None  # perf_counter when its wait for the model began, when not at `received` (stale_ms counts from it)


TURN_JOIN = " … "


def head_and_tail(text: str, limit: int) -> str:
    """A user turn as it is judged: whole up to `limit` characters, else its first and last
    halves of `limit` (the ask is usually at either end of a pasted document), so one turn's
    work on the model thread (patterns, tokenizer, embedding) is bounded whatever its length."""
    if len(text) <= limit:
        return text
    half = (limit - len(TURN_JOIN)) // 2
    return text[:half] + TURN_JOIN + text[-half:]


class Session:
    def __init__(self, limits: ServerConfig, count_unchanged: Callable[[int], None] | None = None):
        """`count_unchanged(n)`: told of spans a stream's segmenter did not emit again (their
        clause gained no content word; /metrics counts them)."""
        self.limits = limits
        self.count_unchanged = count_unchanged
        self.hello: Hello | None = None
        self.scope: Scope | None = None  # set by the hello
        self.closed = False
        # per injected tool, the ranking it was offered in and the span that caused it: what a
        # later `feedback` on that tool is recorded against (so `sidecar learn` has candidates)
        self.offered: OrderedDict[str, tuple[list[str], str]] = OrderedDict()
        # The tools in the model's context (`limits.context_tools`), oldest first: injected, and
        # whether a tool_result said one was called since
        self.in_context: OrderedDict[str, bool] = OrderedDict()
        self.tool_called = False  # a tool_result came: its user turns are judged with `[gate] after_call`
        self.turns: Turns | None = None  # user turns paired with the calls after them (the server's catalog only: learning from traffic)
        self.resolved: list[Turn] = []  # turns `turns` resolved, for the server to record
        self._streams: OrderedDict[str, StreamState] = OrderedDict()  # LRU, bounded
        self._open = 0

    @property
    def version(self) -> int | None:
        """The protocol version the hello asked for (None: no hello yet, or it named none: the current one)."""
        return self.hello.version if self.hello is not None else None

    def start(self, hello: Hello, scope: Scope) -> None:
        if self.hello is not None:
            raise ProtocolError("hello_again", "this connection already said hello")
        self.hello, self.scope = hello, scope

    def remember_offer(self, injected: Sequence[str], ranking: list[str], text: str) -> None:
        for tool in injected:
            self.offered[tool] = (ranking, text)
            self.offered.move_to_end(tool)
        while len(self.offered) > OFFERS_KEPT:
            self.offered.popitem(last=False)

    def admit(self, tools: Sequence[str]) -> tuple[list[str], list[str]]:
        """`tools` (best first) into the model's context: those the budget takes (all of them
        without one, at most `context_tools`), and the tools to drop for them: the oldest
        never called first, then the oldest called."""
        budget = self.limits.context_tools
        if not budget:
            return list(tools), []
        taken = list(tools)[:budget]
        for name in taken:
            self.in_context[name] = self.in_context.pop(name, False)
        over = len(self.in_context) - budget
        if over <= 0:
            return taken, []
        old = [n for n in self.in_context if n not in taken]
        drop = ([n for n in old if not self.in_context[n]] + [n for n in old if self.in_context[n]])[:over]
        for name in drop:
            del self.in_context[name]
        return taken, drop

    def called(self, tool: str) -> None:
        """A tool_result: the tool was used, so it is the last to leave the context, and the
        session's user turns are now those of someone using tools."""
        self.tool_called = True
        if tool in self.in_context:
            self.in_context[tool] = True
            self.in_context.move_to_end(tool)

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
        judged = head_and_tail(stripped, self.limits.max_turn_chars)
        if self.turns is not None and (done := self.turns.turn(judged)) is not None:
            self.resolved.append(done)
        return [Evaluation(self, self.scope, state, judged, start, start + len(stripped), "user", received, object(), turn_chars=len(text))]

    def on_token(self, stream: str, delta: str, received: float) -> list[Evaluation]:
        self.require_hello("token")
        state = self._state(stream)
        if state.ended:
            raise ProtocolError("stream_ended", f"stream {stream!r} has ended; use a new stream id")
        if state.segmenter is None:
            if self._open >= self.limits.max_streams:
                raise ProtocolError("too_many_streams", f"at most {self.limits.max_streams} open streams per connection; end one first")
            state.segmenter = Segmenter(self.limits.span_words, self.limits.max_stream_chars,
                                        rejudge_unchanged=self.limits.rejudge_unchanged)  # fmt: skip
            self._open += 1
        state.received_chars += len(delta)
        return self._evaluations(state, self._spans(state.segmenter, state.segmenter.feed, delta), received)

    def on_end(self, stream: str, received: float) -> list[Evaluation]:
        self.require_hello("end")
        state = self._streams.get(stream)
        if state is None:
            raise ProtocolError("unknown_stream", f"no stream {stream!r} on this connection")
        if state.ended:
            return []
        spans = self._spans(state.segmenter, state.segmenter.end) if state.segmenter else []
        if state.segmenter is not None:
            self._open -= 1
        state.segmenter, state.ended = None, True
        return self._evaluations(state, spans, received)

    def _spans(self, seg: Segmenter, step: Callable[..., list[Span]], *args: str) -> list[Span]:
        """`seg.feed(delta)` or `seg.end()`, reporting the spans it held back as unchanged."""
        before = seg.unchanged
        spans = step(*args)
        if seg.unchanged != before and self.count_unchanged is not None:
            self.count_unchanged(seg.unchanged - before)
        return spans

    def _evaluations(self, state: StreamState, spans: Sequence[Span], received: float) -> list[Evaluation]:
        # Keyed by (stream, clause start): a clause judged again as it grows supersedes its
        # pending shorter self, but a finished clause is never lost to the next one.
        return [Evaluation(self, self.scope, state, s.text, s.start, s.end, "llm", received, (state, s.start), s.reason) for s in spans]

    def _state(self, stream: str) -> StreamState:
        state = self._streams.get(stream)
        if state is None:
            state = self._streams[stream] = StreamState(stream)
            self._evict()
        else:
            self._streams.move_to_end(stream)
        return state

    def _evict(self) -> None:
        """Forget the least recently used closed streams beyond `closed_streams` of them (open
        ones stay, and never count against it: a connection with nothing open keeps
        `closed_streams` states, not `max_streams` more)."""
        keep = self._open + self.limits.closed_streams
        if len(self._streams) <= keep:
            return
        for sid in [s for s, st in self._streams.items() if st.segmenter is None][: len(self._streams) - keep]:
            del self._streams[sid]


@dataclass(eq=False)
class Verdict:
    """A judged evaluation: the engine's judgement of its span."""

    ev: Evaluation
    judgement: Judgement

    @property
    def decision(self) -> Decision:
        return self.judgement.decision


def judge(evaluations: Sequence[Evaluation]) -> tuple[list[Verdict], list[int]]:
    """On the model thread (it embeds): one `Sidecar.judge` per distinct engine, so the spans
    of every stream on one catalog share one llama.cpp call. The server and replay both judge
    through here, so they inject alike. Also returns the batch sizes."""
    groups: dict[int, list[Evaluation]] = {}
    for ev in evaluations:
        groups.setdefault(id(ev.scope.engine), []).append(ev)
    out: list[Verdict] = []
    for evs in groups.values():
        engine = evs[0].scope.engine
        after_call = engine.cfg.gate.after_call
        judged = engine.judge([Request(ev.text, ev.source, after_call if ev.source == "user" and ev.owner.tool_called else 0.0) for ev in evs],
                              [ev.scope.asked for ev in evs])  # fmt: skip
        out.extend(Verdict(ev, j) for ev, j in zip(evs, judged))
    return out, [len(evs) for evs in groups.values()]


def settle(ev: Evaluation, within: float) -> Verdict | None:
    """On the event loop, as a span is cut: its verdict when the patterns block it within
    `within` seconds of CPU time (`Sidecar.settle`), so it need not wait for the model thread
    and the batch of embeddings there; None: it queues for `judge`."""
    judged = ev.scope.engine.settle(Request(ev.text, ev.source), within)
    return None if judged is None else Verdict(ev, judged)


def inject_for(v: Verdict, margin: float) -> Inject | None:
    """The inject a verdict calls for (`Judgement.inject`), minus tools its stream already got,
    tools its scope's catalog does not have, and tools of servers that are down now: dropped,
    not replaced, so no tool the text did not rank close to the best is promoted in their
    place. The tier and the trigger are the gate's; `sent_at` is how much of the stream had
    arrived when the inject was made, which on a busy server may be more than when its span was
    cut (later deltas are read while the span waits for the model)."""
    ev, d = v.ev, v.decision
    tools: list[InjectedTool] = []
    picks = v.judgement.inject(margin)
    down = ev.scope.withheld() if picks else frozenset()
    for r in picks:
        tool = ev.scope.catalog.get(r.tool)
        if tool is not None and r.tool not in ev.stream.injected and tool.server not in down:
            tools.append(InjectedTool(tool.definition(), relevance=r.relevance, why=r.why))
    if not tools:
        return None
    taken, drop = ev.owner.admit([t.definition["name"] for t in tools])
    tools = tools[: len(taken)]
    names = [t.definition["name"] for t in tools]
    ev.stream.injected.update(names)
    ranking = [r.tool for r in v.judgement.ranked.results]  # the turn's; an ask's tool it lacks follows it
    ev.owner.remember_offer(names, ranking + [n for n in names if n not in ranking], ev.text)
    trig = d.trigger
    lo, hi, text = (trig.start, trig.end, trig.text) if trig else (0, len(ev.text), ev.text)
    trigger = TriggerInfo(text, ev.start + lo, ev.start + hi, d.path)
    latency = (time.perf_counter() - ev.received) * 1000
    sent_at = ev.turn_chars if ev.turn_chars is not None else ev.stream.received_chars
    return Inject(stream=ev.stream.id, tier=d.tier, probability=d.probability, tools=tools, trigger=trigger, sent_at=sent_at,
                  latency_ms=round(latency, 2), workflow=workflow_of(v.judgement, tools), drop=drop)  # fmt: skip


def workflow_of(j: Judgement, tools: Sequence[InjectedTool]) -> list[WorkflowStep]:
    """The injected tools in the order they are likely called, when a learned sequence added
    one (else none): each tool the text asked for, its usual prerequisites just before it and
    its usual next steps just after."""
    sent = {t.definition["name"]: t.why for t in tools}
    added = {r.tool: rule for rule, r in j.around if r.tool in sent}
    if not added:
        return []
    order: list[tuple[str, str]] = []
    for name, why in sent.items():
        if name in added:
            continue
        mine = [rule for rule, _ in j.around if rule.anchor == name and added.get(rule.tool) is rule]
        order += [(r.tool, r.why) for r in mine if r.relation == "before"] + [(name, why)] + [(r.tool, r.why) for r in mine if r.relation == "after"]
    order += sent.items()  # a tool whose anchor this stream already had: last
    seen: set[str] = set()
    steps = [(t, w) for t, w in order if t not in seen and not seen.add(t)]
    return [WorkflowStep(t, i, w) for i, (t, w) in enumerate(steps, 1)]


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
