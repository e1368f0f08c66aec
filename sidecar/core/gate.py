"""The tiered gate: negative patterns block, high-confidence patterns lower the bar,
everything else must clear a high semantic threshold. Pure: no model, no I/O.

The gate is split in two so the expensive semantic step runs only when needed:
`route` looks at the text with the patterns (which path it takes), `decide` turns the
semantic candidates into a decision.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec
import numpy as np

from .patterns import GatePatterns, Match

Tier = Literal["auto", "confirm"]
PathKind = Literal["negative", "high", "fallback"]  # blocked by a pattern, lowered bar by one, neither
PATH_KINDS: tuple[PathKind, ...] = ("negative", "high", "fallback")


class Request(msgspec.Struct, frozen=True):
    """What the gate judges: a text and who wrote it ("user", or "llm" for the model's reply),
    since the two are held to their own thresholds and views. Defined here, beside the
    decision, so that learning (`sidecar.learn.traffic`) can build requests without importing
    the pipeline that applies what it learns."""

    text: str
    source: str = "user"
    # Log-odds added to the gate's probability: what the conversation says beyond the text (a
    # session whose model has called a tool, `[gate] after_call`); 0 for a text alone
    prior: float = 0.0


def path_kind(path: str) -> PathKind:
    """The kind of a gate path as the wire spells it: "negative:ID", "high:ID" or "fallback"."""
    kind = path.partition(":")[0]
    if kind not in PATH_KINDS:
        raise ValueError(f"not a gate path: {path!r}")
    return kind  # type: ignore[return-value]


def _check_cosine(name: str, v: float | None) -> None:
    if v is not None and not -1.0 <= v <= 1.0:
        raise ValueError(f"gate threshold {name}={v} is not a cosine in [-1, 1]")


class ToolThresholds(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One tool's own path thresholds, where a labelled set had enough texts about it to fit
    them (`sidecar tune`); unset ones fall back to the model's."""

    high: float | None = None
    fallback: float | None = None

    def __post_init__(self) -> None:
        _check_cosine("high", self.high)
        _check_cosine("fallback", self.fallback)


class Thresholds(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Scores are cosine similarities of one model; every model needs its own numbers."""

    high: float = 0.50  # semantic threshold after a high-confidence pattern
    fallback: float = 0.68  # semantic threshold with no pattern
    auto: float = 0.70  # a fired match at or above: inject without asking
    confirm: float = 0.55  # a fired match at or above (below auto): ask first
    tools: dict[str, ToolThresholds] = {}  # per-tool path thresholds, by tool name

    def __post_init__(self) -> None:
        for name in ("high", "fallback", "auto", "confirm"):
            _check_cosine(name, getattr(self, name))
        if self.confirm > self.auto:
            raise ValueError(f"gate threshold confirm={self.confirm} is above auto={self.auto}")

    def path_threshold(self, kind: PathKind, tool: str | None) -> float:
        """What a match of `tool` on a path of this kind must reach."""
        own = self.tools.get(tool) if tool is not None else None
        if kind == "high":
            return own.high if own is not None and own.high is not None else self.high
        return own.fallback if own is not None and own.fallback is not None else self.fallback


class Candidate(msgspec.Struct, frozen=True):
    tool: str
    score: float  # the ranker's blend of the tool's views of the text: shown as its "match"
    case: str  # the indexed text that matched best


class Trigger(msgspec.Struct, frozen=True):
    """Where in the judged text the decision came from."""

    text: str
    start: int
    end: int


def trimmed(text: str, start: int, end: int) -> Trigger:
    """A trigger without whitespace at its ends, its offsets moved with its text: a pattern's
    match can end on the space after its words (imperative: "show me ") and a span on the
    space before the next, which a user then reads as part of what fired."""
    lead = len(text) - len(text.lstrip())
    body = text.strip()
    return Trigger(body, start + lead, start + lead + len(body))


class Timing(msgspec.Struct):
    regex: float = 0.0
    embed: float = 0.0
    cosine: float = 0.0
    total: float = 0.0


class Route(msgspec.Struct, frozen=True):
    """What the patterns said: blocked, high confidence, or nothing (fallback). A negative
    match the gate head weighs instead of obeying takes the fallback path as
    "fallback:negative:ID"."""

    path: str  # "negative:ID" | "high:ID" | "fallback" | "fallback:negative:ID"
    match: Match | None = None

    @property
    def kind(self) -> PathKind:
        return path_kind(self.path)

    @property
    def blocked(self) -> bool:
        return self.kind == "negative"

    @property
    def negative(self) -> bool:
        """A negative pattern matched, whether it blocked or is only weighed."""
        return self.path.startswith(("negative:", "fallback:negative:"))


class Decision(msgspec.Struct, omit_defaults=False):
    """The gate's verdict on one text. `score` is what the thresholds compared: the gate head's
    probability that the text needs a tool (`probability`), or, with no head (an uncalibrated
    model), the best candidate's match. Shown to people, the two are named apart: a
    probability is never printed as a tool's score."""

    fired: bool  # passed its path's threshold and reached a tier: inject
    tier: Tier | None
    path: str
    tool: str | None
    score: float | None
    case: str | None
    threshold: float | None  # the threshold this path had to clear
    candidates: list[Candidate]
    timing_ms: Timing
    source: str = "user"
    trigger: Trigger | None = None
    truncated: bool = False  # the text was longer than the model takes and was cut (explicitly)
    probability: float | None = None  # the gate head's P(needs a tool); None: blocked, no candidates, or no head

    @property
    def kind(self) -> PathKind:
        return path_kind(self.path)


UNCOMMITTED = Route("negative:uncommitted")  # a reply that commits to no action (`route`)


def route(text: str, source: str, patterns: GatePatterns, weigh_negatives: bool = False,
          replies_commit: bool = False, within: float | None = None) -> Route:  # fmt: skip
    """`weigh_negatives`: a negative match does not block; the text takes the fallback path and
    the gate head, which has the match as a feature, decides (a fitted head weighs "the Delete
    button" in "let me click the Delete button" better than a rule that blocks it).

    `replies_commit`: the model's own text fires only where it commits to an action (a
    high-confidence pattern: "let me check", "I'll retrieve", "searching the ..."). A reply
    is mostly about the work: questions to the user, results, summaries, all in the words
    of the catalog; on real agent replies (tau-bench airline) the ones on no pattern's path
    fired for 1 right tool in 90, and no threshold on the gate's probability told them apart.

    `within`: each pattern set's searches finish within this many seconds of CPU time, else
    `patterns.Unsettled` (`Pipeline.settle`)."""
    uncommitted = replies_commit and source == "llm"
    neg = patterns.negative.first(text, source, within)
    if neg:
        if neg.timed_out or not weigh_negatives:  # a search that ran out of time still fails closed
            return Route(f"negative:{neg.id}", neg)
        if uncommitted and not patterns.high.first(text, source, within):
            return UNCOMMITTED
        return Route(f"fallback:negative:{neg.id}")
    high = patterns.high.first(text, source, within)
    if high:
        return Route(f"high:{high.id}", high)
    return UNCOMMITTED if uncommitted else Route("fallback")


def fires(kinds: Sequence[PathKind], scores: np.ndarray, t: Thresholds, tools: Sequence[str | None] | None = None) -> np.ndarray:
    """The gate's rule, over many texts at once: not blocked, at or above the threshold of its
    path (the best tool's own, where it has one), and at or above the confirm tier. `judge`
    decides by it one text at a time and `tune` searches thresholds with it."""
    kinds = np.asarray(kinds)
    scores = np.asarray(scores, float)
    tools = tools if tools is not None else [None] * len(kinds)
    need = np.array([t.path_threshold(k, tool) for k, tool in zip(kinds, tools)], float)
    return (kinds != "negative") & (scores >= need) & (scores >= t.confirm)


def tier_of(score: float, t: Thresholds) -> Tier | None:
    if score >= t.auto:
        return "auto"
    if score >= t.confirm:
        return "confirm"
    return None


def decide(text: str, source: str, route: Route, candidates: list[Candidate], t: Thresholds, timing: Timing,
          confidence: float | None = None) -> Decision:  # fmt: skip
    """Decide from the route and the ranked candidates (best first). With `confidence` (the
    gate head's probability that the text needs a tool) the thresholds compare that instead
    of the best candidate's score."""
    trigger = trimmed(route.match.text, route.match.start, route.match.end) if route.match else None
    if route.blocked:
        return Decision(False, None, route.path, None, None, None, None, candidates, timing, source, trigger)
    if not candidates:
        return Decision(False, None, route.path, None, None, None, t.path_threshold(route.kind, None), candidates, timing, source, trigger)
    best = candidates[0]
    score = best.score if confidence is None else round(float(confidence), 4)
    threshold = t.path_threshold(route.kind, best.tool)
    tier = tier_of(score, t) if fires([route.kind], np.array([score]), t, [best.tool])[0] else None
    if trigger is None:
        trigger = trimmed(text, 0, len(text))
    return Decision(tier is not None, tier, route.path, best.tool, score, best.case, threshold, candidates, timing, source, trigger,
                    probability=None if confidence is None else score)  # fmt: skip
