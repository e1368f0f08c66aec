"""Ranking metrics, in one place: `eval` over labelled sets, `learn` over recorded feedback and
the benches all score a ranking (tool names, best first) against the tools that were right;
`replay` and `eval` summarise latencies with the same `percentiles`."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def first_hit(ranking: Sequence[str], expected: frozenset[str] | set[str]) -> int | None:
    """1-based rank of the first expected tool, or None when none is ranked."""
    return next((r for r, tool in enumerate(ranking, 1) if tool in expected), None)


def ndcg(ranking: Sequence[str], expected: frozenset[str] | set[str], k: int = 10) -> float:
    """Normalised discounted gain of the top k: every expected tool counts, the ideal ranks
    them all first."""
    gains = sum(1.0 / math.log2(r + 1) for r, tool in enumerate(ranking[:k], 1) if tool in expected)
    ideal = sum(1.0 / math.log2(r + 1) for r in range(1, min(len(expected), k) + 1))
    return gains / ideal if ideal else 0.0


def mrr(hits: Sequence[int | None]) -> float:
    """Mean reciprocal rank over first hits (None counts 0); NaN with no rows."""
    return sum(1.0 / h for h in hits if h) / len(hits) if hits else math.nan


def hit_rate(hits: Sequence[int | None], k: int) -> float:
    """Share of rows whose first hit is within the top k; NaN with no rows."""
    return sum(1 for h in hits if h is not None and h <= k) / len(hits) if hits else math.nan


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 99)) -> dict[str, float]:
    """{"p50": .., "p99": ..} of `values`; NaN with none."""
    if not len(values):
        return {f"p{q:g}": math.nan for q in qs}
    arr = np.asarray(values, float)
    return {f"p{q:g}": float(np.percentile(arr, q)) for q in qs}
