"""Learning from feedback: A/B arms, offline evaluation, and weight tuning.

Pure: feedback rows and factor matrices in, numbers out. The recommender replays feedback
queries into factor matrices (`Recommender.factor_matrix`); `samples_from_feedback` does
that, everything else here is arithmetic and reproducible (no randomness, no clock).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Sequence

import msgspec
import numpy as np

from ..core import ranking
from .scoring import FACTORS, Weights

KS = (1, 3, 5, 10)


def assign_variant(agent_id: str, variants: Sequence[str]) -> str:
    """The arm an agent is in: sha256(agent id) modulo the number of arms, over the arm
    names sorted (so the assignment does not depend on the order a config lists them)."""
    if not variants:
        raise ValueError("no variants to assign")
    arms = sorted(variants)
    digest = int.from_bytes(hashlib.sha256(agent_id.encode("utf-8")).digest(), "big")
    return arms[digest % len(arms)]


# --- offline evaluation -----------------------------------------------------------------


class Evaluation(msgspec.Struct):
    n: int  # feedback rows with a selected tool
    mrr: float
    precision: dict[str, float]  # "1", "3", "5", "10": share of rows whose selected tool was in the top k
    ndcg: float  # one relevant tool per row: mean of 1/log2(rank + 1), 0 when absent
    coverage: float | None  # share of the catalog ever recommended (None: catalog size unknown)
    not_recommended: int  # rows whose selected tool was not in the list at all


def evaluate(rows: Iterable, catalog_size: int | None = None, ks: Sequence[int] = KS) -> Evaluation:
    """MRR, P@k, nDCG and coverage of recorded recommendations. `rows`: anything with
    `recommended` (best first) and `selected` (e.g. metrics.Feedback); rows without a
    selected tool count towards coverage only."""
    hits: list[int | None] = []
    gains: list[float] = []
    seen: set[str] = set()
    for fb in rows:
        seen.update(fb.recommended)
        if fb.selected:
            hits.append(ranking.first_hit(fb.recommended, {fb.selected}))
            gains.append(ranking.ndcg(fb.recommended, {fb.selected}, k=len(fb.recommended)))
    n = len(hits)
    coverage = None if not catalog_size else min(len(seen) / catalog_size, 1.0)
    if not n:
        return Evaluation(0, 0.0, {str(k): 0.0 for k in ks}, 0.0, coverage, 0)
    return Evaluation(n, round(ranking.mrr(hits), 4), {str(k): round(ranking.hit_rate(hits, k), 4) for k in ks},
                      round(sum(gains) / n, 4), coverage, sum(1 for h in hits if h is None))  # fmt: skip


def by_variant(rows: Iterable, catalog_size: int | None = None) -> dict[str, Evaluation]:
    """One evaluation per A/B arm ("" for rows recorded without a variant), kept apart."""
    groups: dict[str, list] = {}
    for fb in rows:
        groups.setdefault(fb.variant or "", []).append(fb)
    return {v: evaluate(g, catalog_size) for v, g in sorted(groups.items())}


# --- weight tuning ----------------------------------------------------------------------


class Sample(msgspec.Struct, frozen=True):
    """One feedback row replayed: each candidate's factor values (rows, FACTORS order) and
    which row the user selected."""

    factors: np.ndarray
    selected: int
    key: str = ""  # stable identity (the feedback id) for the held-out split


class TuneResult(msgspec.Struct):
    weights: Weights  # normalised
    start: Weights
    train_mrr_before: float
    train_mrr_after: float
    heldout_mrr_before: float | None
    heldout_mrr_after: float | None
    train: int
    heldout: int
    evaluated: int  # weight vectors tried


def sample_mrr(samples: Sequence[Sample], weights: np.ndarray) -> np.ndarray:
    """Mean reciprocal rank of the selected rows for each weight vector in `weights`
    (m, 5). Ties rank pessimistically: a selected tool tied with others counts as last of
    them, so degenerate weights (all on one flat factor) gain nothing."""
    w = np.atleast_2d(np.asarray(weights, np.float64))
    total = np.zeros(w.shape[0])
    for s in samples:
        scores = np.nan_to_num(s.factors, nan=0.0) @ w.T  # (candidates, m)
        mine = scores[s.selected]
        rank = (scores >= mine - 1e-12).sum(axis=0)  # includes itself
        total += 1.0 / rank
    return total / max(len(samples), 1)


def simplex_grid(step: float) -> np.ndarray:
    """Every weight vector on the 5-simplex with coordinates multiple of `step`."""
    n = round(1 / step)
    pts = [c for c in itertools.product(range(n + 1), repeat=len(FACTORS) - 1) if sum(c) <= n]
    return np.asarray([(*c, n - sum(c)) for c in pts], np.float64) / n


def split(samples: Sequence[Sample], heldout_fraction: float) -> tuple[list[Sample], list[Sample]]:
    """Deterministic train / held-out split on sha256 of each sample's key."""
    train, held = [], []
    for s in samples:
        h = int.from_bytes(hashlib.sha256(s.key.encode()).digest()[:8], "big") / 2**64
        (held if h < heldout_fraction else train).append(s)
    return train, held


def tune(samples: Sequence[Sample], start: Weights = Weights(), heldout_fraction: float = 0.0,
         step: float = 0.05, floor: float = 0.0) -> TuneResult:  # fmt: skip
    """Weights that maximise the selected tool's reciprocal rank over the training samples:
    an exhaustive search over the simplex at `step` (coarse grid, then a grid twice as fine
    around the best), ties broken by the smallest distance to `start` so a flat objective
    keeps the configured weights. `floor`: a minimum share per factor. Reproducible: same
    samples, same answer."""
    train, held = split(samples, heldout_fraction) if heldout_fraction > 0 else (list(samples), [])
    w0 = np.asarray(start.normalised().as_tuple())
    if not train:
        raise ValueError("no feedback with a selected tool to learn from")
    coarse = simplex_grid(max(step * 2, 0.1))
    cands = coarse[(coarse >= floor - 1e-12).all(axis=1)]
    best = _best(train, np.vstack([w0, cands]), w0)
    fine = simplex_grid(step)
    near = fine[(np.abs(fine - best).max(axis=1) <= 2 * step + 1e-9) & (fine >= floor - 1e-12).all(axis=1)]
    best = _best(train, np.vstack([best, w0, near]), w0)
    evaluated = len(cands) + len(near) + 3
    before = float(sample_mrr(train, w0)[0])
    after = float(sample_mrr(train, best)[0])
    hb = float(sample_mrr(held, w0)[0]) if held else None
    ha = float(sample_mrr(held, best)[0]) if held else None
    return TuneResult(Weights.from_values(best), start.normalised(), round(before, 4), round(after, 4),
                      None if hb is None else round(hb, 4), None if ha is None else round(ha, 4),
                      len(train), len(held), evaluated)  # fmt: skip


def _best(samples: Sequence[Sample], grid: np.ndarray, w0: np.ndarray) -> np.ndarray:
    scores = np.concatenate([sample_mrr(samples, grid[i:i + 512]) for i in range(0, len(grid), 512)])
    top = scores.max()
    tied = np.flatnonzero(scores >= top - 1e-12)
    dist = np.linalg.norm(grid[tied] - w0, axis=1)
    return grid[tied[int(np.argmin(dist))]]


def samples_from_feedback(recommender, rows: Iterable, context=None) -> list[Sample]:
    """Replay feedback through the recommender's current factors: one sample per row whose
    selected tool is in the catalog (its candidates: what was recommended, plus the
    selected tool). History factors are today's, not the ones at the time of the row."""
    out = []
    for fb in rows:
        if not fb.selected:
            continue
        names = list(dict.fromkeys([*fb.recommended, fb.selected]))
        mat = recommender.factor_matrix(fb.query, names, context)
        keep = ~np.isnan(mat).any(axis=1)
        sel = names.index(fb.selected)
        if not keep[sel] or keep.sum() < 2:
            continue
        out.append(Sample(mat[keep], int(keep[:sel].sum()), str(fb.id if fb.id is not None else fb.query)))
    return out
