"""The strategy matrix (`sidecar tune --strategies`): every strategy of the design, compared on
the labelled set before anything is fitted.

The index strategies (base, prefix, mcp, llm, action and their combinations, `prefix+mcp` the
design's choice for production) decide which texts represent each tool; each is judged as the
design compared them, embedding only and uncalibrated: a tool scores its best cosine over the
strategy's rows (`CASES_ONLY`: the other views do not depend on the strategy), and one
threshold on the best tool's score is chosen for the objective on the same texts. Two rows add
the gate the design builds on top: `+negative` (the negative patterns block, on the production
index) and `tiered`, the product's own gate, calibrated, with its tiers (`tiered` fires at
either tier, `tiered:auto` counts only what it injects without asking), judged on the same
texts with the thresholds it ships with. A row is on the Pareto front when no other row
catches as many requests with as few false fires and ranks as well; the winner is the row the
objective scores best (ties: better ranking, fewer false fires, fewer vectors), so it is on the
front. The uncalibrated rows' thresholds are chosen on the texts they are judged on, which
flatters them; read the rows side by side, not as a forecast. An index strategy is then set
with `[index] user_strategy` / `llm_strategy`, and `tune` fits on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from ..core.catalog import Catalog
from ..config import Config
from ..engine import Sidecar
from ..core.gate import PathKind
from ..learn.learned import Ranker
from ..core.pipeline import Pipeline, Request, from_config
from ..store import Store
from .evaluate import Labeled, score
from .tune import GateScores, Objective, fit_gate

CASES_ONLY = Ranker((0.0, 0.0, 1.0, 0.0))  # a tool's score: its best row cosine
PRODUCTION = "prefix+mcp"  # the design's choice for production
INDEX_STRATEGIES = ("base", "prefix", "mcp", "llm", "action", PRODUCTION, "prefix+llm", "mcp+llm", "prefix+action", "llm+action", "mcp+llm+action")
NEGATIVE = f"{PRODUCTION}+negative"  # the production index, the negative patterns blocking
TIERED, TIERED_AUTO = "tiered", "tiered:auto"  # the product's calibrated gate: either tier, the auto tier alone
STRATEGIES = (*INDEX_STRATEGIES, NEGATIVE, TIERED, TIERED_AUTO)


class MatrixRow(msgspec.Struct):
    strategy: str
    tp_rate: float
    fp_rate: float
    top1: float  # the best-scoring tool (for `tiered`, the one injected first), over the requests
    rows: int  # vectors in the index: what the strategy costs in memory and cosine time
    threshold: float  # a cosine for the uncalibrated rows, a probability for `tiered`
    gate: str = "cosine"  # "cosine" (one threshold, chosen here), "cosine+negative", or the calibration's origin
    same_as: str | None = None  # an earlier strategy that indexes the very same texts (`mcp` names the tool, as `prefix+mcp` does)
    pareto: bool = False
    winner: bool = False


def matrix(items: Sequence[Labeled], catalog: Catalog, cfg: Config, store: Store | None, objective: Objective = Objective(),
           strategies: Sequence[str] = INDEX_STRATEGIES, progress: Callable[[str], None] | None = None) -> list[MatrixRow]:  # fmt: skip
    """One row per index strategy, the `+negative` row beside the production strategy's, and
    the product's tiered gate; each judged on every item against the whole catalog."""
    say = progress or (lambda msg: None)
    requests = [Request(i.text, i.source) for i in items]
    rows: list[MatrixRow] = []
    shared: Pipeline | None = None
    indexed: dict[tuple[str, ...], str] = {}  # each distinct set of indexed texts, by the first strategy that made it
    for spec in strategies:
        say(f"strategy {spec}: indexing {len(catalog)} tools and judging {len(items)} texts")
        pipe = _uncalibrated(spec, catalog, cfg, store, shared)
        shared = shared or pipe
        best = [ranked[0] if ranked else None for ranked in pipe.rank_batch(requests, k=1)]
        rows.append(_cosine_row(spec, items, best, ["fallback"] * len(items), _vectors(pipe), objective))
        first = indexed.setdefault(tuple(pipe.index_for("user").texts), spec)
        rows[-1].same_as = first if first != spec else None
        if spec == PRODUCTION:
            kinds: list[PathKind] = [pipe.route(r).kind for r in requests]  # no gate head: a negative match blocks
            rows.append(_cosine_row(NEGATIVE, items, best, kinds, _vectors(pipe), objective, "cosine+negative"))
    say(f"the tiered gate: judging {len(items)} texts with the calibration in force")
    rows += _tiered_rows(items, catalog, cfg, store, shared)
    mark(rows, objective)
    return rows


def _uncalibrated(spec: str, catalog: Catalog, cfg: Config, store: Store | None, shared: Pipeline | None) -> Pipeline:
    """A pipeline on `spec`'s index with no calibration, scoring a tool by its best row cosine;
    the model and the texts' embeddings are `shared`'s, so each text is embedded once."""
    own = msgspec.structs.replace(cfg, index=msgspec.structs.replace(cfg.index, user_strategy=spec, llm_strategy=spec))
    pipe = from_config(own, catalog=catalog, store=store, progress=False, calibration=False, embedder=shared.embedder if shared else None)
    if shared is not None:
        pipe.queries = shared.queries
    pipe.ranker = CASES_ONLY
    return pipe


def _vectors(pipe: Pipeline) -> int:
    index = pipe.index_for("user")
    return len(index.texts) + len(index.names)


def _cosine_row(spec: str, items: Sequence[Labeled], best, kinds: list[PathKind], vectors: int, objective: Objective,
                gate: str = "cosine") -> MatrixRow:  # fmt: skip
    """One threshold on the best tool's cosine, chosen for `objective` on these texts (blocked
    texts, `kinds` "negative", never fire); top-1 is the index's ranking, blocked or not."""
    tools = [b.tool if b else None for b in best]
    scores = GateScores(kinds, [b.score if b else -1.0 for b in best], [i.positive for i in items],
                        [i.positive and t in i.expected for i, t in zip(items, tools)], tools)  # fmt: skip
    try:
        fit = fit_gate(scores, objective)
        tp, fp, bar = fit.tp_rate, fit.fp_rate, fit.thresholds.fallback
    except ValueError:  # no threshold meets the objective on this strategy's scores
        tp, fp, bar = 0.0, 0.0, float("nan")
    return MatrixRow(spec, tp, fp, _top1(items, tools), vectors, bar, gate)


def _tiered_rows(items: Sequence[Labeled], catalog: Catalog, cfg: Config, store: Store | None, shared: Pipeline | None) -> list[MatrixRow]:
    """The product's gate as `eval` judges it: patterns, the calibrated ranker and gate head,
    and the thresholds the calibration in force ships with (the model's built-in one unless
    the config names a file), at either tier and at the auto tier alone. The model is
    `shared`'s, unless a calibration file is named (it may embed with other task prefixes)."""
    mine = shared.embedder if shared is not None and not cfg.calibration else None
    pipe = from_config(cfg, catalog=catalog, store=store, progress=False, embedder=mine)
    if mine is not None:
        pipe.queries = shared.queries
    scored = score(Sidecar(cfg, pipe, store, None), items)
    bars, origin = pipe.thresholds_in_force
    pos = np.array([i.positive for i in items])
    fired = np.array([d.fired for d in scored.decisions])
    auto = np.array([d.tier == "auto" for d in scored.decisions])
    top1, vectors = _top1(items, scored.first), _vectors(pipe)
    return [
        MatrixRow(TIERED, _share(fired, pos), _share(fired, ~pos), top1, vectors, bars.confirm, origin),
        MatrixRow(TIERED_AUTO, _share(auto, pos), _share(auto, ~pos), top1, vectors, bars.auto, origin),
    ]


def _share(hit: np.ndarray, among: np.ndarray) -> float:
    return float(hit[among].mean()) if among.any() else float("nan")


def _top1(items: Sequence[Labeled], first: Sequence[str | None]) -> float:
    right = [t in i.expected for i, t in zip(items, first) if i.positive]
    return float(np.mean(right)) if right else float("nan")


def mark(rows: Sequence[MatrixRow], objective: Objective) -> None:
    """`pareto` on the rows no other row beats on TP, FP and top-1; `winner` on the one row the
    objective scores best, ties to the better ranking, then fewer false fires, then fewer vectors."""
    for r in rows:
        r.pareto = not any(_dominates(o, r) for o in rows if o is not r)
    if rows:
        best = max(rows, key=lambda r: (objective.better(np.array(r.tp_rate), np.array(r.fp_rate)), r.top1, -r.fp_rate, -r.rows))
        best.winner = True


def _dominates(a: MatrixRow, b: MatrixRow) -> bool:
    at_least = a.tp_rate >= b.tp_rate and a.fp_rate <= b.fp_rate and a.top1 >= b.top1
    better = a.tp_rate > b.tp_rate or a.fp_rate < b.fp_rate or a.top1 > b.top1
    return at_least and better


def describe(rows: Sequence[MatrixRow], objective: Objective) -> str:
    lines = [
        f"strategy matrix (index strategies uncalibrated: best row cosine, one threshold chosen for {objective} on these texts;",
        f"  {NEGATIVE}: negative patterns block; {TIERED}: the calibrated gate as shipped, either tier, {TIERED_AUTO}: auto tier alone)",
        "  * = Pareto front, < = winner under the objective",
    ]
    lines.append(f"    {'strategy':<20} {'TP':>6} {'FP':>6} {'top-1':>6} {'vectors':>8}  threshold")
    for r in rows:
        mark_ = ("*" if r.pareto else " ") + ("<" if r.winner else " ")
        scale = "" if r.gate.startswith("cosine") else f" (probability, {r.gate})"
        same = f" (the texts of {r.same_as})" if r.same_as else ""
        lines.append(f"{mark_}  {r.strategy:<20} {r.tp_rate:>6.1%} {r.fp_rate:>6.1%} {r.top1:>6.1%} {r.rows:>8}  {r.threshold:.4f}{scale}{same}")
    return "\n".join(lines)
