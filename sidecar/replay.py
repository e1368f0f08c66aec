"""Replaying transcripts through the server's streaming logic, and scoring what it injected.

A transcript's assistant messages are streamed delta by delta (their recorded `chunks`, or
LLM-like tokens) and its user turns sent whole, through the same `Session`, `judge` and
`Pipeline` the websocket server uses: each span is judged as it completes, exactly as a
client streaming at an unhurried pace would see it. `replay_url` streams the same through a
running sidecar instead. Ground truth is the `tool_calls` of each assistant message; a user
turn is answered by the tool calls of the next assistant message.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import msgspec
import regex

from .client import SidecarClient, SidecarError
from .config import ServerConfig
from .core.ranking import percentiles
from .mcp.savings import schema_tokens
from .protocol import DecisionReport, Ended, Error, Hello, Inject
from .serve.session import Scope, Session, context_of, inject_for, judge
from .transcripts import (  # noqa: F401  (replay's API)
    Conversation,
    Message,
    ToolCall,
    TranscriptError,
    read_transcripts,
)

if TYPE_CHECKING:
    from .engine import Sidecar

# The GPT-2 pre-tokenizer: LLM tokens never cross these pieces' boundaries, so streaming them
# one by one is a faithful (slightly coarse) stand-in for an LLM's token stream.
_LLM_PIECES = regex.compile(r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def llm_tokens(text: str) -> list[str]:
    """Split text the way an LLM streams it (pieces join back to `text`)."""
    return _LLM_PIECES.findall(text)


class Detection(msgspec.Struct):
    """One inject, as a line of the events file."""

    conversation: str
    message: int  # index within the conversation
    role: str
    tier: str
    probability: float | None  # the gate's P(needs a tool) (None: the model has no gate head)
    tools: list[str]
    relevance: list[float]  # each injected tool's, as the recommender ranked it
    trigger: str
    path: str
    at_char: int  # end of the judged span within the message
    truth: list[str]  # the tools the model itself called for this message
    correct: list[bool]
    lead_chars: int  # characters of the message (and, for a user turn, of the reply) still to come
    lead_tokens: int


class Summary(msgspec.Struct):
    conversations: int
    messages: int  # user and assistant messages replayed
    injections: int  # injected tools
    precision: float  # injected tools that the model called for that message
    recall: float  # tools the model called that were injected first (during its message or the user turn before)
    false_fires: int  # messages that called no tool but got an inject
    lead_time_chars: dict[str, float]
    lead_time_tokens: dict[str, float]
    per_conversation: dict[str, dict[str, float]] = {}
    # replies that called tools whose calls were injected exactly (during the reply or on the
    # user turn it answers: nothing missing, nothing more), over the replies that called tools
    exact_set: float = float("nan")
    # Per reply, the tokens of the tool schemas the session's model holds by its end: every tool
    # injected in the conversation so far, less those an inject said to drop
    # (`server.context_tools`); p50, p90 and mean (cl100k_base, each tool as compact JSON)
    context_tokens: dict[str, float] = {}
    # Of the tools replies called, those the model's context held when it called them: injected
    # anywhere earlier in the conversation (or during the reply) and not dropped since
    held_when_called: float = float("nan")
    # Of the distinct tools a conversation was injected, those the model called on or after
    # the message of their first inject: the conversation as one stream, where a tool injected
    # early for a later step counts (precision above counts it only for its own message)
    used_after_inject: float = float("nan")
    # The same figures for what user turns injected and what replies injected, apart: "user"
    # and "assistant", each with its messages, injections, precision, false fires and recall
    # (of the tools replies called, those injected by that side: the user turn answered, or
    # the reply itself while it streamed)
    by_role: dict[str, dict[str, float]] = {}


def _truths(conv: Conversation) -> list[list[str]]:
    """Per message, the tools it should have led to (user turn: the next assistant message's)."""
    out: list[list[str]] = []
    for i, m in enumerate(conv.messages):
        if m.role == "assistant":
            out.append([c.name for c in m.tool_calls or ()])
        elif m.role == "user":
            nxt = next((n for n in conv.messages[i + 1:] if n.role != "tool"), None)
            out.append([c.name for c in nxt.tool_calls or ()] if nxt is not None and nxt.role == "assistant" else [])
        else:
            out.append([])
    return out


Hit = tuple[Inject, int]  # an inject and where in the message the span that caused it ended


def replay(engine: Sidecar, conversations: Sequence[Conversation], on_message: Callable[[], None] | None = None) -> tuple[list[Detection], Summary]:
    """Stream every conversation through a fresh `Session` on `engine`, with the server
    limits of its config; score the injections."""
    limits = engine.cfg.server
    hits: list[list[list[Hit]]] = []
    for conv in conversations:
        session = Session(limits)
        hello = Hello(session=f"replay:{conv.id}")
        session.start(hello, Scope(engine.catalog, context_of(hello), engine))
        conv_hits = []
        for i, msg in _replayed(conv):
            conv_hits.append(_progress(_stream(session, limits, conv, i, msg), on_message))
            for call in msg.tool_calls or ():  # as a live client's tool_result would tell it
                session.called(call.name)
        hits.append(conv_hits)
    return score(conversations, hits)


async def replay_url(url: str, conversations: Sequence[Conversation], *, token: str | None = None,
                     on_message: Callable[[], None] | None = None) -> tuple[list[Detection], Summary]:  # fmt: skip
    """The same replay through a running sidecar: one connection per conversation, user turns
    as `user` + `end`, replies delta by delta + `end`, each message scored once its stream's
    `ended` came (so every span of it was judged and delivered). It sends no `tool_result`
    (that would write call history into the server's store), so the server does not hear of
    the transcript's calls: `[gate] after_call` applies in-process only."""
    hits: list[list[list[Hit]]] = []
    for conv in conversations:
        async with await SidecarClient.connect(url, session=f"replay:{conv.id}", token=token, decisions=True) as sc:
            hits.append([_progress(await _send(sc, f"{conv.id}:{i}", msg), on_message) for i, msg in _replayed(conv)])
    return score(conversations, hits)


def score(conversations: Sequence[Conversation], hits: Sequence[Sequence[Sequence[Hit]]]) -> tuple[list[Detection], Summary]:
    """Detections and their summary from each replayed message's hits (per conversation, in
    `_replayed` order)."""
    detections: list[Detection] = []
    per_conv: dict[str, dict[str, float]] = {}
    totals = _Tally()
    tokens: dict[str, int] = {}  # a tool's schema tokens, by name
    for conv, conv_hits in zip(conversations, hits):
        tally = _Tally()
        truths = _truths(conv)
        ahead: set[str] = set()  # injected on the user turn the next reply answers
        held: dict[str, int] = {}  # the tools in the model's context, and their tokens
        first: dict[str, int] = {}  # the message each injected tool was first injected on
        for (i, msg), msg_hits in zip(_replayed(conv), conv_hits):
            for inject, _ in msg_hits:
                for t in inject.tools:
                    name = t.definition["name"]
                    first.setdefault(name, i)
                    if name not in tokens:
                        tokens[name] = schema_tokens(t.definition)
                    held[name] = tokens[name]
                for name in inject.drop:
                    held.pop(name, None)
            if msg.role == "assistant":
                tally.context_tokens.append(sum(held.values()))
                tally.calls += len(set(truths[i]))
                tally.held += len(set(truths[i]) & held.keys())
            found = [_detection(conv, i, inject, at, truths[i]) for inject, at in msg_hits]
            tally.add(truths[i], found, ahead if msg.role == "assistant" else None)
            ahead = {t for d in found for t in d.tools} if msg.role == "user" else set()
            detections.extend(found)
        last = {name: i for i, called in enumerate(truths) for name in called if conv.messages[i].role == "assistant"}
        tally.offered += len(first)
        tally.used += sum(last.get(name, -1) >= i for name, i in first.items())
        totals.merge(tally)
        per_conv[conv.id] = tally.figures()
    return detections, totals.summary(len(conversations), per_conv)


def _replayed(conv: Conversation) -> Iterator[tuple[int, Message]]:
    """The messages a replay streams (tool results are not), with their index."""
    return ((i, m) for i, m in enumerate(conv.messages) if m.role != "tool")


def _progress(hits: Iterable[Hit], on_message: Callable[[], None] | None) -> list[Hit]:
    out = list(hits)
    if on_message:
        on_message()
    return out


def _stream(session: Session, limits: ServerConfig, conv: Conversation, index: int, msg: Message) -> Iterator[Hit]:
    stream = f"{conv.id}:{index}"
    now = time.perf_counter()
    if _silent(msg):
        return
    if msg.role == "user":
        batches = [session.on_user(stream, msg.content, now)]
    else:
        batches = [session.on_token(stream, d, now) for d in _deltas(msg)] + [session.on_end(stream, now)]
    for evs in batches:
        for v in judge(evs)[0]:
            inject = inject_for(v, limits.margin_for(v.ev.source))
            if inject is not None:
                yield inject, v.ev.end


async def _send(sc: SidecarClient, stream: str, msg: Message) -> list[Hit]:
    """Stream one message and collect its hits, reading while sending (a long message's
    decisions must not back up in the sidecar's outbox)."""
    if _silent(msg):
        return []
    reader = asyncio.create_task(_hits(sc, stream))
    if msg.role == "user":
        await sc.user(stream, msg.content)
    else:
        for d in _deltas(msg):
            await sc.token(stream, d)
    await sc.end(stream)
    return await reader


async def _hits(sc: SidecarClient, stream: str) -> list[Hit]:
    """Messages up to the stream's `ended`: each inject paired with the `decision` that
    follows it (its span's end)."""
    out: list[Hit] = []
    inject: Inject | None = None
    while not isinstance(msg := await sc.recv(), Ended):
        if isinstance(msg, Error):
            raise SidecarError(f"{stream}: {msg.code}: {msg.message}")
        if isinstance(msg, Inject):
            inject = msg
        elif isinstance(msg, DecisionReport) and inject is not None:
            out.append((inject, msg.end))
            inject = None
    if msg.stream != stream:
        raise SidecarError(f"expected the end of {stream!r}, got the end of {msg.stream!r}")
    return out


def _silent(msg: Message) -> bool:
    """Nothing to stream: a reply that only called tools (content null or "") or a user turn
    without text. It is still scored (its tool calls are the truth for the turn before it),
    but no stream is opened, so no `end` names a stream that never began."""
    return not (_deltas(msg) if msg.role == "assistant" else msg.content.strip())


def _next_reply(conv: Conversation, index: int) -> Message | None:
    return next((m for m in conv.messages[index + 1:] if m.role == "assistant"), None)


def _deltas(msg: Message) -> list[str]:
    return list(msg.chunks) if msg.chunks is not None else llm_tokens(msg.content)


def _ends(deltas: Sequence[str]) -> list[int]:
    out, n = [], 0
    for d in deltas:
        n += len(d)
        out.append(n)
    return out


def _detection(conv: Conversation, index: int, inject: Inject, at: int, truth: list[str]) -> Detection:
    """`at`: where the judged span ended; it was judged once the delta holding it arrived.
    Lead time counts what was still to come: the rest of the message, and for a user turn
    the whole reply."""
    msg = conv.messages[index]
    ends = _ends(_deltas(msg) if msg.role == "assistant" else [msg.content])
    reply = _next_reply(conv, index) if msg.role == "user" else None
    after = (len(reply.content), len(_deltas(reply))) if reply is not None else (0, 0)
    tools = [t.definition["name"] for t in inject.tools]
    seen = next((k for k, e in enumerate(ends) if e >= at), len(ends) - 1)
    return Detection(
        conversation=conv.id, message=index, role=msg.role, tier=inject.tier, probability=inject.probability, tools=tools,
        relevance=[t.relevance for t in inject.tools], trigger=inject.trigger.text, path=inject.trigger.path,
        at_char=at, truth=truth, correct=[t in truth for t in tools],
        lead_chars=len(msg.content) - at + after[0], lead_tokens=len(ends) - 1 - seen + after[1],
    )  # fmt: skip


class _Tally:
    def __init__(self) -> None:
        self.messages = self.injected = self.right = self.called = self.found = self.false_fires = 0
        self.calling = self.exact = 0  # replies that called tools; those injected exactly
        self.lead_chars: list[float] = []
        self.lead_tokens: list[float] = []
        self.context_tokens: list[float] = []
        self.calls = self.held = 0  # the tools replies called; those the model's context held by then
        self.offered = self.used = 0  # distinct tools injected per conversation; those called on or after
        self.roles = {role: _Side() for role in ROLES}

    def add(self, truth: list[str], found: list[Detection], ahead: set[str] | None) -> None:
        """Precision counts every injected tool; recall counts each assistant message's tool
        calls, found when injected during it or on the user turn it answers (`ahead`)."""
        self.messages += 1
        tools = [t for d in found for t in d.tools]
        self.injected += len(tools)
        self.right += sum(t in truth for t in tools)
        side = self.roles["user" if ahead is None else "assistant"]
        side.add(tools, truth)
        if ahead is not None:
            self.called += len(set(truth))
            self.found += len(set(truth) & (set(tools) | ahead))
            side.found += len(set(truth) & set(tools))
            for role in ROLES:
                self.roles[role].called += len(set(truth))
            self.roles["user"].found += len(set(truth) & ahead)
            if truth:
                self.calling += 1
                self.exact += set(truth) == set(tools) | ahead
        self.false_fires += bool(tools) and not truth
        for d in found:
            if any(d.correct):
                self.lead_chars.append(d.lead_chars)
                self.lead_tokens.append(d.lead_tokens)

    def merge(self, o: _Tally) -> None:
        for k in ("messages", "injected", "right", "called", "found", "false_fires", "calling", "exact"):
            setattr(self, k, getattr(self, k) + getattr(o, k))
        self.lead_chars += o.lead_chars
        self.lead_tokens += o.lead_tokens
        self.context_tokens += o.context_tokens
        self.calls += o.calls
        self.held += o.held
        self.offered += o.offered
        self.used += o.used
        for role in ROLES:
            self.roles[role].merge(o.roles[role])

    def figures(self) -> dict[str, float]:
        return {
            "messages": self.messages,
            "injections": self.injected,
            "precision": _ratio(self.right, self.injected),
            "recall": _ratio(self.found, self.called),
            "exact_set": _ratio(self.exact, self.calling),
            "false_fires": self.false_fires,
        }

    def summary(self, conversations: int, per_conv: dict[str, dict[str, float]]) -> Summary:
        return Summary(
            conversations=conversations, messages=self.messages, injections=self.injected,
            precision=_ratio(self.right, self.injected), recall=_ratio(self.found, self.called),
            false_fires=self.false_fires, exact_set=_ratio(self.exact, self.calling),
            lead_time_chars=percentiles(self.lead_chars, (50, 90)),
            lead_time_tokens=percentiles(self.lead_tokens, (50, 90)),
            per_conversation=per_conv,
            held_when_called=_ratio(self.held, self.calls), used_after_inject=_ratio(self.used, self.offered),
            context_tokens={**percentiles(self.context_tokens, (50, 90)),
                            "mean": sum(self.context_tokens) / len(self.context_tokens) if self.context_tokens else float("nan")},
            by_role={role: side.figures() for role, side in self.roles.items()},
        )  # fmt: skip


ROLES = ("user", "assistant")


class _Side:
    """What one side's messages (user turns, or replies) injected, and how much of it the replies called."""

    def __init__(self) -> None:
        self.messages = self.injected = self.right = self.false_fires = self.called = self.found = 0

    def add(self, tools: list[str], truth: list[str]) -> None:
        self.messages += 1
        self.injected += len(tools)
        self.right += sum(t in truth for t in tools)
        self.false_fires += bool(tools) and not truth

    def merge(self, o: _Side) -> None:
        for k in ("messages", "injected", "right", "false_fires", "called", "found"):
            setattr(self, k, getattr(self, k) + getattr(o, k))

    def figures(self) -> dict[str, float]:
        return {"messages": self.messages, "injections": self.injected, "precision": _ratio(self.right, self.injected),
                "false_fires": self.false_fires, "recall": _ratio(self.found, self.called)}  # fmt: skip


def _ratio(n: int, d: int) -> float:
    return n / d if d else float("nan")


def describe(s: Summary) -> str:
    """The summary as text; a figure with nothing to score (no tool injected: no precision; no
    tool called: no recall) reads "–", not "nan"."""
    lines = [
        f"{s.conversations} conversations, {s.messages} messages, {s.injections} tools injected",
        f"precision {_shown(s.precision, '.3f')}  recall {_shown(s.recall, '.3f')}  exact set {_shown(s.exact_set, '.3f')}  "
        f"false fires {s.false_fires}",
        f"lead time: chars p50 {_shown(s.lead_time_chars.get('p50'), '.0f')} p90 {_shown(s.lead_time_chars.get('p90'), '.0f')}; "
        f"tokens p50 {_shown(s.lead_time_tokens.get('p50'), '.0f')} p90 {_shown(s.lead_time_tokens.get('p90'), '.0f')}",
        f"tool schemas in context per reply: tokens p50 {_shown(s.context_tokens.get('p50'), '.0f')} "
        f"p90 {_shown(s.context_tokens.get('p90'), '.0f')} mean {_shown(s.context_tokens.get('mean'), '.0f')}; "
        f"called tools it held {_shown(s.held_when_called, '.3f')}",
        f"the conversation as one stream: injected tools called on or after their inject {_shown(s.used_after_inject, '.3f')}",
        *(f"  {role} messages: {f['injections']:.0f} tools injected, precision {_shown(f['precision'], '.3f')}, "
          f"recall {_shown(f['recall'], '.3f')}, false fires {f['false_fires']:.0f}" for role, f in s.by_role.items()),
    ]  # fmt: skip
    for cid, f in s.per_conversation.items():
        lines.append(f"  {cid}: {f['messages']:.0f} msgs, {f['injections']:.0f} injected, precision {_shown(f['precision'], '.2f')}, "
                     f"recall {_shown(f['recall'], '.2f')}, exact set {_shown(f['exact_set'], '.2f')}, false fires {f['false_fires']:.0f}")  # fmt: skip
    return "\n".join(lines)


def _shown(value: float | None, spec: str) -> str:
    """A figure as text, "–" where there was nothing to score."""
    return "–" if value is None or math.isnan(value) else format(value, spec)
