"""The multi-factor score, pure arithmetic: no SQLite, no model, no clock.

A tool's score is a weighted sum of five factors in [0, 1]: relevance to the query, success
rate, popularity, performance and user rating. Every history factor has a neutral prior
until the tool has `min_calls` observations, so a tool nobody has called yet is judged on
relevance, not buried under tools with a track record.
"""

from __future__ import annotations

import math

import msgspec

from .intent import ACTION_MAP

FACTORS = ("relevance", "success", "popularity", "performance", "rating")
DAY_S = 86400.0


class Weights(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How much each factor counts; used normalised (they need not sum to 1 in a config)."""

    relevance: float = 0.35
    success: float = 0.25
    popularity: float = 0.15
    performance: float = 0.15
    rating: float = 0.10

    def __post_init__(self) -> None:
        values = self.as_tuple()
        if any(not math.isfinite(v) or v < 0 for v in values):
            raise ValueError(f"weights must be finite and >= 0, got {dict(zip(FACTORS, values))}")
        if sum(values) <= 0:
            raise ValueError("weights must not all be 0")

    def as_tuple(self) -> tuple[float, ...]:
        return tuple(getattr(self, f) for f in FACTORS)

    def normalised(self) -> Weights:
        total = sum(self.as_tuple())
        return Weights(*(v / total for v in self.as_tuple()))

    @classmethod
    def from_values(cls, values) -> Weights:
        """From any 5 non-negative numbers in FACTORS order, normalised."""
        return cls(*(float(v) for v in values)).normalised()


class Priors(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Factor values for a tool with too little history to judge. Quality factors start at
    'no penalty' (only observed failures, slowness or bad ratings lower a tool). Popularity
    unset means 'typical': the mean popularity of the other candidates that have a history,
    so a new tool is neither rewarded nor buried under the established ones."""

    success: float = 1.0
    popularity: float | None = None
    performance: float = 1.0
    rating: float = 1.0

    def __post_init__(self) -> None:
        for f in ("success", "popularity", "performance", "rating"):
            v = getattr(self, f)
            if v is not None and not 0.0 <= v <= 1.0:
                raise ValueError(f"priors.{f}={v} must be within 0..1")


class History(msgspec.Struct, frozen=True):
    """What the metrics store knows about one tool, as plain numbers."""

    calls: int = 0
    successes: int = 0
    avg_latency_ms: float | None = None
    last_called_at: float | None = None  # unix seconds
    agent_calls: int = 0  # the asking agent's calls of this tool
    agent_successes: int = 0
    ratings: int = 0
    avg_rating: float | None = None  # 0..5


class HistoryFactors(msgspec.Struct, frozen=True):
    success: float
    popularity: float
    performance: float
    rating: float
    prior: bool  # True when the calls were too few and priors stood in


def popularity(uses: int, days_since_last_use: float, agent_success_rate: float = 0.5) -> float:
    """min(uses/1000, 1) x exp(-days/30) x agent bias, where bias = 1 + (agent rate - 0.5).
    Capped at 1 so the factor stays on the same scale as the others."""
    base = min(uses / 1000.0, 1.0)
    recency = math.exp(-max(days_since_last_use, 0.0) / 30.0)
    bias = 1.0 + (agent_success_rate - 0.5)
    return min(base * recency * bias, 1.0)


def performance(avg_latency_ms: float) -> float:
    """1 at 0 ms, 0 at a second or slower."""
    return 1.0 - min(max(avg_latency_ms, 0.0) / 1000.0, 1.0)


def history_factors(h: History, now: float, priors: Priors = Priors(), min_calls: int = 3, typical_popularity: float = 0.0) -> HistoryFactors:
    """The four history factors of one tool; `typical_popularity` stands in for an unset
    popularity prior."""
    if h.calls < min_calls:
        rating = h.avg_rating / 5.0 if h.ratings >= min_calls and h.avg_rating is not None else priors.rating
        pop = typical_popularity if priors.popularity is None else priors.popularity
        return HistoryFactors(priors.success, pop, priors.performance, min(max(rating, 0.0), 1.0), True)
    success = h.successes / h.calls
    days = (now - h.last_called_at) / DAY_S if h.last_called_at is not None else 365.0
    agent_rate = h.agent_successes / h.agent_calls if h.agent_calls >= min_calls else 0.5
    perf = performance(h.avg_latency_ms) if h.avg_latency_ms is not None else priors.performance
    rating = h.avg_rating / 5.0 if h.ratings >= min_calls and h.avg_rating is not None else priors.rating
    return HistoryFactors(success, popularity(h.calls, days, agent_rate), perf, min(max(rating, 0.0), 1.0), False)


def combine(weights: Weights, values: tuple[float, ...]) -> float:
    """The weighted sum over FACTORS (weights normalised here, so any positive scale works)."""
    w = weights.normalised().as_tuple()
    return sum(a * b for a, b in zip(w, values))


def contributions(weights: Weights, values: tuple[float, ...]) -> dict[str, float]:
    w = weights.normalised().as_tuple()
    return {f: a * b for f, a, b in zip(FACTORS, w, values)}


# --- intent adjustments, applied to relevance after retrieval ---------------------------------


class IntentRules(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Boosts for query words found in a tool's name or description (action words count
    double), with diminishing returns, and penalties for tools that contradict the intent.

    Off by default: measured on top of the fitted ranker (which already weighs BM25), the
    design's values (0.4 / 0.2 / 0.2 / 0.1 boosts, 0.30 / 0.20 / 0.30 penalties) cost 5.5
    points of top-1 on Banking77 and gained nothing on the corpus's held-out servers
    (docs/benchmarks.md). Set them in `[recommend.intent]` to measure them on your data."""

    name_action: float = 0.0
    name_term: float = 0.0
    desc_action: float = 0.0
    desc_term: float = 0.0
    decay: float = 0.8  # each extra match in a field counts this much less
    read_only_vs_write: float = 0.0
    write_only_vs_read: float = 0.0
    delete_vs_create: float = 0.0

    def __post_init__(self) -> None:
        for f in self.__struct_fields__:
            v = getattr(self, f)
            top = 5.0 if f.startswith(("name", "desc")) else 1.0
            if not (0.0 <= v <= top and (f == "decay" or top > 1 or v < 1)):
                raise ValueError(f"intent.{f}={v} is out of range (boosts 0..5, decay 0..1, penalties 0..<1)")


class Adjustment(msgspec.Struct, frozen=True):
    multiplier: float
    name_boost: float
    desc_boost: float
    matched: tuple[str, ...]  # "save→write" or "file": what matched in the name
    penalties: tuple[str, ...]  # human reasons, e.g. "read-only tool for a write intent (-30%)"


def _diminished(hits: list[float], decay: float) -> float:
    return sum(hits) * decay ** (len(hits) - 1) if hits else 0.0


def intent_adjustment(intent, tool, rules: IntentRules = IntentRules()) -> Adjustment:
    """`intent` is an intent.Intent, `tool` an intent.ToolProfile. Returns the factor that
    multiplies the tool's retrieval relevance: (1 + name boost + description boost) times
    (1 - each conflict penalty)."""
    name_hits: list[float] = []
    desc_hits: list[float] = []
    matched: list[str] = []
    for term in intent.terms:
        meaning = ACTION_MAP.get(term)
        variants = meaning if meaning is not None else (term,)
        in_name = [v for v in variants if v in tool.name_words]
        if in_name:
            name_hits.append(rules.name_action if meaning is not None else rules.name_term)
            v = term if term in in_name else in_name[0]
            matched.append(term if v == term else f"{term}→{v}")
        if any(v in tool.desc_words for v in variants):
            desc_hits.append(rules.desc_action if meaning is not None else rules.desc_term)
    name_boost = _diminished(name_hits, rules.decay)
    desc_boost = _diminished(desc_hits, rules.decay)
    mult = 1.0 + name_boost + desc_boost
    penalties: list[str] = []
    if intent.wants_write and not intent.wants_read and tool.read_only and rules.read_only_vs_write:
        mult *= 1 - rules.read_only_vs_write
        penalties.append(f"read-only tool for a write intent (-{rules.read_only_vs_write:.0%})")
    if intent.wants_read and not intent.wants_write and tool.write_only and rules.write_only_vs_read:
        mult *= 1 - rules.write_only_vs_read
        penalties.append(f"write-only tool for a read intent (-{rules.write_only_vs_read:.0%})")
    if intent.wants_create and not intent.wants_delete and tool.deletes and rules.delete_vs_create:
        mult *= 1 - rules.delete_vs_create
        penalties.append(f"delete tool for a create intent (-{rules.delete_vs_create:.0%})")
    return Adjustment(mult, name_boost, desc_boost, tuple(matched), tuple(penalties))
