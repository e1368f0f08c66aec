"""What `detect` and `recommend` print, as text and as JSON: three numbers that look alike,
each under one name wherever it is shown (the CLI, the client, the page, the protocol):

- **probability**: the gate's P(this text needs a tool), which the thresholds compare;
- **relevance**: the probability that a tool is the one the text asks for, among the catalog's
  (the fitted ranker's softmax, `recommend.recommender.fit_probability`); the recommender
  orders and picks the injected tools by its *score*, which adds call history to it;
- **match**: a tool's score in the gate's own ranking (the ranker's blend of its views of
  the text: cosines and BM25), which decides nothing with a gate head, and is what the
  thresholds compare without one (an uncalibrated model).

A newcomer who saw "0.994" from `detect`, "0.85" on an inject and "scored 0.000 … next 0.340"
on a silent line could not tell which was which; here each says what it is. The best tool's
score with no call history is the same whatever the text (0.85 with the default weights), so
it is not what is shown as relevance (issue 52).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from .core.gate import Decision, Thresholds, Timing, Trigger
from .recommend.recommender import Factors, Recommendation


class ToolMatch(msgspec.Struct):
    """A tool in the gate's ranking."""

    tool: str
    match: float
    case: str  # its indexed text that matched best


class ToolRelevance(msgspec.Struct):
    """A tool in the recommender's ranking: what `serve` would inject, best first."""

    tool: str
    relevance: float
    why: str


class RecommendedTool(msgspec.Struct):
    """One of `recommend --json`'s results."""

    tool: str
    relevance: float
    score: float  # what the ranking is ordered by
    why: str
    factors: Factors  # what the relevance is made of (each in 0..1)


class Detected(msgspec.Struct):
    """`detect --json`: the gate's decision, then the tools that would be injected."""

    fired: bool
    tier: str | None
    path: str
    probability: float | None  # None: blocked by a pattern, or no gate head (uncalibrated model)
    threshold: float | None  # what the probability had to reach on this path (no gate head: the best match)
    tool: str | None  # the tool the gate fired for (its ranking's best); None when silent: candidates[0] is the best
    match: float | None
    case: str | None
    candidates: list[ToolMatch]
    inject: list[ToolRelevance]
    source: str
    trigger: Trigger | None
    truncated: bool
    timing_ms: Timing
    model: str
    thresholds: Thresholds
    thresholds_origin: str


def detected(d: Decision, injected: Sequence[Recommendation], model: str, thresholds: Thresholds, origin: str) -> Detected:
    """`detect --json`. A silent decision names no tool (nor its match and case): a reader
    took "tool" beside "fired": false for a tool injected; the gate's best is candidates[0]."""
    best = d.candidates[0] if d.candidates and d.fired else None
    return Detected(
        fired=d.fired, tier=d.tier, path=d.path, probability=d.probability, threshold=d.threshold, tool=d.tool if d.fired else None,
        match=best.score if best is not None and best.tool == d.tool else None, case=d.case if d.fired else None,
        candidates=[ToolMatch(c.tool, c.score, c.case) for c in d.candidates],
        inject=[ToolRelevance(r.tool, r.relevance, r.why) for r in injected],
        source=d.source, trigger=d.trigger, truncated=d.truncated, timing_ms=d.timing_ms,
        model=model, thresholds=thresholds, thresholds_origin=origin,
    )  # fmt: skip


def recommended(results: Sequence[Recommendation]) -> list[RecommendedTool]:
    return [RecommendedTool(r.tool, r.relevance, r.score, r.why, r.factors) for r in results]


def describe(d: Decision, injected: Sequence[Recommendation] = ()) -> str:
    """`detect`'s answer: whether the gate fired and on what probability, what would be injected
    (with each tool's relevance), the gate's ranking (matches), the time."""
    t = d.timing_ms
    timing = f"{t.total:.1f} ms (regex {t.regex:.2f}, embed {t.embed:.1f}, cosine {t.cosine:.2f})"
    if d.kind == "negative":
        head = f"silent: blocked by {d.path} ({d.trigger.text!r})" if d.trigger else f"silent: blocked by {d.path}"
        return f"{head}\n  {timing}"
    if not d.candidates:
        return f"silent: the catalog is empty\n  {timing}"
    if d.probability is not None:
        gate = f"probability {d.probability:.3f} that it needs a tool"
    else:
        gate = f"match {d.score:.3f} of {d.tool} (no gate head: the thresholds compare the best match)"
    if d.fired:
        tools = ", ".join(f"{r.tool} (relevance {r.relevance:.2f})" for r in injected) or d.tool
        head = f"{d.tier}: inject {tools}\n  {gate}, >= {d.threshold:.2f} via {d.path}; best match {d.case!r}"
    else:
        below = f"below {d.threshold:.2f}" if d.score is not None and d.score < (d.threshold or 0) else "below the confirm tier"
        head = f"silent: {gate}, {below} ({d.path})"
    ranking = ", ".join(f"{c.tool} {c.score:.3f}" for c in d.candidates[:4])
    cut = "\n  [text truncated to the model's limit]" if d.truncated else ""
    return f"{head}\n  ranked by match: {ranking}{cut}\n  {timing}"
