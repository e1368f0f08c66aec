"""The strategy matrix (`sidecar tune --strategies`): which texts should represent each tool in
the index, compared on the labelled set before anything is fitted.

Every strategy of the design (base, prefix, mcp, llm, action and their combinations) indexes
the catalog its own way; each is judged uncalibrated, as the design compared them: a tool scores
its best cosine over the strategy's rows (`CASES_ONLY`: the other views do not depend on the
strategy), and one threshold on the best tool's score is chosen for the objective on the same texts. A row is on the Pareto front when no other row catches as many requests with
as few false fires and ranks as well. The figures flatter every row alike (the threshold is
chosen on the texts it is judged on), so read them side by side, not as a forecast. The
strategy is then set with `[index] user_strategy` / `llm_strategy`, and `tune` fits on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from ..core.catalog import Catalog
from ..config import Config
from ..learn.learned import Ranker
from ..core.pipeline import Pipeline, Request, from_config
from ..store import Store
from .evaluate import Labeled
from .tune import GateScores, Objective, fit_gate

CASES_ONLY = Ranker((0.0, 0.0, 1.0, 0.0))  # a tool's score: its best row cosine
STRATEGIES = ("base", "prefix", "mcp", "llm", "action", "prefix+llm", "mcp+llm", "prefix+action", "llm+action", "mcp+llm+action")


class MatrixRow(msgspec.Struct):
    strategy: str
    tp_rate: float
    fp_rate: float
    top1: float  # the best-scoring tool, over the requests
    rows: int  # vectors in the index: what the strategy costs in memory and cosine time
    threshold: float
    pareto: bool = False


def matrix(items: Sequence[Labeled], catalog: Catalog, cfg: Config, store: Store | None, objective: Objective = Objective(),
           strategies: Sequence[str] = STRATEGIES, progress: Callable[[str], None] | None = None) -> list[MatrixRow]:  # fmt: skip
    """One row per strategy, each judged on every item against the whole catalog."""
    say = progress or (lambda msg: None)
    requests = [Request(i.text, i.source) for i in items]
    rows: list[MatrixRow] = []
    shared: Pipeline | None = None
    for spec in strategies:
        say(f"strategy {spec}: indexing {len(catalog)} tools and judging {len(items)} texts")
        own = msgspec.structs.replace(cfg, index=msgspec.structs.replace(cfg.index, user_strategy=spec, llm_strategy=spec))
        pipe = from_config(own, catalog=catalog, store=store, progress=False, calibration=False, embedder=shared.embedder if shared else None)
        if shared is not None:
            pipe.queries = shared.queries  # each text is embedded once for every strategy
        shared = shared or pipe
        pipe.ranker = CASES_ONLY
        decisions = pipe.detect_batch(requests).decisions
        scores = GateScores([d.kind for d in decisions], [-1.0 if d.score is None else d.score for d in decisions],
                            [i.positive for i in items], [i.positive and d.tool in i.expected for i, d in zip(items, decisions)],
                            [d.tool for d in decisions])  # fmt: skip
        try:
            fit = fit_gate(scores, objective)
            tp, fp, bar = fit.tp_rate, fit.fp_rate, fit.thresholds.fallback
        except ValueError:  # no threshold meets the objective on this strategy's scores
            tp, fp, bar = 0.0, 0.0, float("nan")
        positives = [(i, d) for i, d in zip(items, decisions) if i.positive]
        top1 = float(np.mean([d.tool in i.expected for i, d in positives])) if positives else float("nan")
        index = pipe.index_for("user")
        rows.append(MatrixRow(spec, tp, fp, top1, len(index.texts) + len(index.names), bar))
    for r in rows:
        r.pareto = not any(_dominates(o, r) for o in rows if o is not r)
    return rows


def _dominates(a: MatrixRow, b: MatrixRow) -> bool:
    at_least = a.tp_rate >= b.tp_rate and a.fp_rate <= b.fp_rate and a.top1 >= b.top1
    better = a.tp_rate > b.tp_rate or a.fp_rate < b.fp_rate or a.top1 > b.top1
    return at_least and better


def describe(rows: Sequence[MatrixRow], objective: Objective) -> str:
    lines = [f"strategy matrix (uncalibrated: best row cosine, one threshold chosen for {objective} on these texts; * = Pareto front)"]
    lines.append(f"  {'strategy':<16} {'TP':>6} {'FP':>6} {'top-1':>6} {'vectors':>8}  threshold")
    for r in rows:
        lines.append(f"{'*' if r.pareto else ' '} {r.strategy:<16} {r.tp_rate:>6.1%} {r.fp_rate:>6.1%} {r.top1:>6.1%} {r.rows:>8}  {r.threshold:.4f}")
    return "\n".join(lines)
