"""Fitting a calibration from a labelled set: the ranker's view weights and query adapter, the
gate head, and the threshold on its probability, chosen on out-of-fold probabilities. `fit`
returns the `Calibration` with how it did: the part held out is judged by an engine built from
it (`judge_heldout`), exactly as `eval` and `serve` judge, beside the simplest baselines.
"""

from __future__ import annotations

import math
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import msgspec
import numpy as np

from ..core.calibration import Calibration, builtin
from ..core.catalog import SEP, Catalog
from ..config import Config
from ..engine import Sidecar
from .evaluate import Labeled, auroc, baselines, description_vectors, gate_report, ranking_report, score, simple_gate, simple_gate_features
from ..core.gate import PathKind, Thresholds, fires, route
from ..core.index import embed_cached, wants_classifier
from ..learn.learned import ADAPTER_HELD_VIEWS, FLOOR_SHARE, GATE_SCALARS, RANK_FEATURES, AdapterFit, Examples, Exemplars, GateHead, GateHeadFit, Known, Ranker, RankerFit, held_views, match, rank_features
from ..core.lexical import LexicalIndex
from ..core.pipeline import Pipeline, Request, Views, from_config
from ..store import Store

# Below these counts a fitted threshold is noise; the caller reports rather than fits.
MIN_POSITIVES = 8
MIN_NEGATIVES = 8


class Objective(msgspec.Struct, frozen=True):
    """Highest TP rate with FP rate at most `max_fp` (the default), best balanced accuracy, or
    best F1 (which weighs the labelled set's own mix of positives and negatives)."""

    kind: str = "max_tp"  # "max_tp" | "balanced" | "f1"
    max_fp: float = 0.05
    positive_share: float = 0.5  # for f1: the share of positives it is computed at

    @classmethod
    def parse(cls, spec: str) -> Objective:
        """'max_tp', 'max_tp:fp<=0.02', 'balanced'."""
        kind, _, arg = spec.partition(":")
        if kind in ("balanced", "f1") and not arg:
            return cls(kind)
        if kind == "max_tp":
            if not arg:
                return cls()
            if arg.startswith("fp<="):
                try:
                    v = float(arg[4:])
                except ValueError:
                    v = -1.0
                if 0.0 <= v <= 1.0:
                    return cls("max_tp", v)
        raise ValueError(f"unknown objective {spec!r}: use max_tp, max_tp:fp<=0.02, balanced or f1")

    def __str__(self) -> str:
        return self.kind if self.kind in ("balanced", "f1") else f"max_tp:fp<={self.max_fp:g}"

    def value(self, fit: GateFit) -> float:
        """How good a fitted gate is under this objective (for comparing models)."""
        return float(self.better(np.array(fit.tp_rate), np.array(fit.fp_rate)))

    def better(self, tp: np.ndarray, fp: np.ndarray) -> np.ndarray:
        """A score per candidate (higher is better; -inf where infeasible)."""
        if self.kind == "balanced":
            return (tp + 1 - fp) / 2
        if self.kind == "f1":
            p = self.positive_share
            return 2 * p * tp / np.maximum(p * tp + p + (1 - p) * fp, 1e-12)
        return np.where(fp <= self.max_fp + 1e-12, tp, -np.inf)


def _cuts(scores: np.ndarray) -> np.ndarray:
    """Candidate thresholds: each distinct score (fire from it up), and one step over the top
    (fire none) where thresholds reach: a score of 1 cannot be left out. Scores are at the
    gate's 4 places, so a threshold chosen here is stored as is and fires in `judge` exactly
    the texts it fired in the search (a midpoint rounded to 4 places could fall on either
    side of a score)."""
    u = np.unique(scores)
    if not len(u):
        return np.array([0.5])
    return np.unique(np.append(u, min(round(float(u[-1]) + 1e-4, 4), 1.0)))  # thresholds live in [-1, 1]


class GateScores(msgspec.Struct):
    """Per item, what the pipeline saw: the path kind, the best score, whether its tool was right."""

    path: list[PathKind]
    score: list[float]
    positive: list[bool]
    correct: list[bool]  # positive and the top tool is an expected one
    tool: list[str | None] = []  # the best candidate (whose per-tool thresholds apply)

    def __post_init__(self) -> None:
        self.score = [round(float(x), 4) for x in self.score]  # as `judge` compares them



def fired(s: GateScores, t: Thresholds) -> np.ndarray:
    return fires(s.path, np.asarray(s.score), t, s.tool or None)


class GateFit(msgspec.Struct):
    thresholds: Thresholds
    tp_rate: float
    fp_rate: float
    accuracy: float
    correct_rate: float


def rates(s: GateScores, t: Thresholds) -> GateFit:
    f = fired(s, t)
    pos = np.asarray(s.positive)
    correct = np.asarray(s.correct)
    tp = f[pos].mean() if pos.any() else math.nan
    fp = f[~pos].mean() if (~pos).any() else math.nan
    acc = float((f == pos).mean())
    return GateFit(t, float(tp), float(fp), acc, float((f & correct)[pos].mean()) if pos.any() else math.nan)


def fit_gate(s: GateScores, objective: Objective = Objective(), auto_precision: float = 0.97) -> GateFit:
    """The one threshold for every live path that best meets `objective` (ties go to the one
    that fires the right tool most, then to the higher, safer one); `confirm` is that bar,
    `auto` the lowest score at which fired decisions needed a tool at least `auto_precision`
    of the time. One bar for both paths: the gate head already reads the path (its `high`
    feature), and a second, searched bar chased the folds (held-out TP 84.9% -> 83.7% when
    "look at/into/through" joined the high patterns). No per-tool bars: on out-of-fold
    probabilities they over-fit a tool's few texts (Banking77 test TP 89.7% -> 87.0%), and a
    probability already means the same for every tool."""
    pos = np.asarray(s.positive)
    if pos.sum() < MIN_POSITIVES or (~pos).sum() < MIN_NEGATIVES:
        raise ValueError(f"need at least {MIN_POSITIVES} positives and {MIN_NEGATIVES} negatives to fit thresholds")
    score = np.asarray(s.score)
    live = np.asarray(s.path) != "negative"
    correct = np.asarray(s.correct)
    grid = _cuts(score[live]) if live.any() else np.array([1.0])
    over = (score[None, :] >= grid[:, None]) & live  # (G, n)
    n_pos, n_neg = max(pos.sum(), 1), max((~pos).sum(), 1)
    objective = msgspec.structs.replace(objective, positive_share=float(n_pos / (n_pos + n_neg)))
    value = objective.better((over & pos).sum(1) / n_pos, (over & ~pos).sum(1) / n_neg)
    if not np.isfinite(value).any():
        raise ValueError(f"no thresholds meet the objective {objective.kind} (fp <= {objective.max_fp})")
    bar = float(grid[np.lexsort((grid, (over & correct).sum(1), value))[-1]])
    t = Thresholds(high=bar, fallback=bar, auto=1.0, confirm=bar)
    return rates(s, msgspec.structs.replace(t, auto=_auto_cut(s, t, auto_precision)))


def _auto_cut(s: GateScores, t: Thresholds, precision: float) -> float:
    """Lowest score from which the fired decisions above it needed a tool `precision` of the
    time: above it the sidecar injects without asking."""
    f = fired(s, t)
    score = np.asarray(s.score)[f]
    right = np.asarray(s.positive)[f]
    if not len(score):
        return max(t.confirm, 1.0)
    order = np.argsort(-score)
    cum = np.cumsum(right[order]) / np.arange(1, len(order) + 1)
    ok = np.nonzero(cum >= precision)[0]
    if not len(ok):
        return 1.0
    # the longest prefix (from the top) that keeps precision
    k = ok[-1]
    return float(max(score[order][k], t.confirm))


def split(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Reproducible (fit, held-out) index lists."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    k = int(round(n * fraction))
    return sorted(perm[k:].tolist()), sorted(perm[:k].tolist())




# --- fitting: the ranker's weights, the gate head, then the thresholds on its probability ----


class Heldout(msgspec.Struct):
    """The finished pipeline on the part never fitted, beside the simplest gates and rankings
    of the same run on the same texts: if the learned parts lose to them, they should go."""

    tp_rate: float
    fp_rate: float
    accuracy: float
    correct_rate: float
    n: int
    top1: float = math.nan  # ranking, over the held-out positives
    mrr: float = math.nan
    auroc: float = math.nan  # the gate head's
    cosine_auroc: float = math.nan  # baseline: one threshold on the best plain cosine to a description
    simple_auroc: float = math.nan  # baseline: evaluate.simple_gate, fitted on the fit part
    cosine_top1: float = math.nan  # baseline rankings: plain cosine, BM25
    bm25_top1: float = math.nan


class Fitted(msgspec.Struct):
    """What `--out` writes (as a calibration) and how it did."""

    calibration: Calibration
    objective: str
    fit: GateFit  # thresholds chosen on out-of-fold probabilities of the fit part
    heldout: Heldout  # the part never fitted, judged by the finished pipeline
    gate_scores: GateScores  # out-of-fold, fit part (for the plot)
    fit_items: int
    seconds: float
    start: str = "none"  # what the gate head started from (see `_starts`)
    starts: dict[str, float] = {}  # each start tried: the objective's out-of-fold value
    before: Heldout | None = None  # the same held-out part judged by the calibration in force before this tune
    before_origin: str = ""  # where that came from: "builtin", "calibration" (the config's file), "uncalibrated"


MAX_EXEMPLARS = 1000  # per class: bounds the calibration file (float16) and the per-text cost
FOLDS = 5


def fit(
    items: Sequence[Labeled],
    catalog: Catalog,
    cfg: Config,
    objective: Objective = Objective(),
    heldout_fraction: float = 0.3,
    seed: int = 0,
    store: Store | None = None,
    progress: Callable[[str], None] | None = None,
    l2: float = 1.0,
    l2_embedding: float = 1000.0,
    start: str = "auto",
    absent_share: float = 0.0,
) -> Fitted:
    """Fit the ranker and the gate head on one part of `items`, choose thresholds on
    out-of-fold probabilities (a head judged on texts it was fitted on looks better than it
    is), and report the finished pipeline on the part it never saw. `absent_share` of the
    requests also teach the head once as "needs none", against a catalog without their
    tools (`_against_parts`)."""
    t0 = time.perf_counter()
    say = progress or (lambda msg: None)
    fit_idx, held_idx = split(len(items), heldout_fraction, seed)
    fit_items = [items[i] for i in fit_idx]
    pos = np.array([i.positive for i in fit_items])
    if pos.sum() < MIN_POSITIVES or (~pos).sum() < MIN_NEGATIVES:
        raise ValueError(f"need at least {MIN_POSITIVES} positives and {MIN_NEGATIVES} negatives to fit the gate")
    # The catalog as shipped, without written cases (packs, a writer): the gate judges on it
    # (`Pipeline.gate_views`), so the head must learn on it. Fitted on pack-filled views, the
    # corpus' head leaned on cases the served gate never sees: held-out servers TP 78.5% ->
    # 63.6%, AUROC 0.891 -> 0.865 (docs/benchmarks.md, "save a text file").
    pipe = from_config(cfg, catalog=catalog, store=store, progress=progress is not None, calibration=False, cases=False)
    vectors = query_vectors(pipe, [i.text for i in items], progress is not None)
    requests = [Request(i.text, i.source) for i in fit_items]
    q = vectors[fit_idx]
    routes = [route(r.text, r.source, pipe.patterns, weigh_negatives=True) for r in requests]
    high = np.array([s.kind == "high" for s in routes])
    y = pos.astype(float)
    # Stacking: the gate head learns from features each text gets from a ranker, an adapter
    # and exemplars fitted without it (without its whole server, where there are servers).
    # Features from a ranker that has seen the text look surer than a new catalog's will, and
    # thresholds chosen on them let through less than they promise.
    offers = Offers(pipe, fit_items)
    plain = offers.views(pipe.views(requests, q))  # the default ranker's (no adapter): the views every ranker is fitted on
    features = np.stack([offers.widen(k, rank_features(v.cosine, v.bm25, v.cases, v.logits, v.symbolic, v.servers)[0]) for k, v in enumerate(plain)])
    position = {n: k for k, n in enumerate(offers.names)}
    targets = [[position[t] for t in i.expected] for i in fit_items]
    folds = _folds(fit_items, [offers.best_tool(k, v) for k, v in enumerate(plain)], seed)
    starts = _starts(pipe.embedder.name, start)
    pools = {c.pool: c.extra for c in starts}  # the exemplar sets the features are computed against
    x = {pool: np.zeros((len(fit_items), len(GATE_SCALARS) + q.shape[1])) for pool in pools}
    x_part = {pool: np.zeros_like(x[pool]) for pool in pools}
    x_absent = {pool: np.zeros_like(x[pool]) for pool in pools}
    absent = pos & (np.random.default_rng(seed + 1).random(len(fit_items)) < absent_share)
    tools = np.full((3, len(fit_items)), "", object)  # each row's best tool, out of fold: whole catalog, part, part without its tools
    for f in range(FOLDS):
        train, test = np.flatnonzero(folds != f), np.flatnonzero(folds == f)
        if not len(test):
            continue
        say(f"fold {f + 1}/{FOLDS}: fitting the ranker and the query adapter without {len(test)} texts")
        pipe.ranker = _fit_ranker(pipe, q, features, targets, train[pos[train]], offers.matrix)
        fold_own = _exemplars(q[train], pos[train], high[train], seed)
        known = {pool: fold_own.plus(extra).arrays() for pool, extra in pools.items()}
        sub, subreq, subroutes = [fit_items[k] for k in test], [requests[k] for k in test], [routes[k] for k in test]
        wide = pipe.views(subreq, q[test])
        views = offers.views(wide, test)
        for pool in pools:
            x[pool][test] = offers.gate_inputs(subreq, q[test], views, subroutes, known[pool])
        # Each text once more against a smaller catalog (a random part of its servers): users
        # bring 5 tools or 500, and a request the catalog does not cover must stay silent.
        parts, _, tools[1, test] = _against_parts(offers, test, sub, subreq, q[test], wide, subroutes, list(known.values()),
                                                  np.random.default_rng(seed + f))  # fmt: skip
        for pool, xp in zip(pools, parts):
            x_part[pool][test] = xp
        if (at := np.flatnonzero(absent[test])).size:  # positions in this fold's lists
            gone = test[at]
            parts, absent[gone], tools[2, gone] = _against_parts(offers, gone, [sub[k] for k in at], [subreq[k] for k in at], q[gone],
                                                                 [wide[k] for k in at], [subroutes[k] for k in at], list(known.values()),
                                                                 np.random.default_rng(seed + f), absent=True)  # fmt: skip
            for pool, xp in zip(pools, parts):
                x_absent[pool][gone] = xp
        tools[0, test] = [offers.best_tool(k, v) for k, v in zip(test, views)]
    say(f"fitting the ranker and the query adapter on {int(pos.sum())} tool requests")
    ranker = pipe.ranker = _fit_ranker(pipe, q, features, targets, np.flatnonzero(pos), offers.matrix)
    own = _exemplars(q, pos, high, seed)
    pooled = {pool: own.plus(extra) for pool, extra in pools.items()}  # what a head keeps for its neighbourhood
    say(f"fitting the gate head on {2 * len(fit_items) + int(absent.sum())} rows ({FOLDS}-fold for the thresholds)")
    both = lambda pool, m: (np.vstack([x[pool][m], x_part[pool][m], x_absent[pool][m & absent]]),  # noqa: E731
                            np.concatenate([y[m], y[m], np.zeros(int((m & absent).sum()))]))
    # The thresholds are chosen on every row the head learns from, out of fold: each text
    # against the whole catalog and against a part of it (and, with `absent_share`, against a
    # part without its tools). On the whole-catalog rows alone the bar suited hundreds of tools
    # and caught fewer requests among one server's few (docs/benchmarks.md, "One server's tools").
    kinds = np.array([s.kind for s in routes], object)
    rows = np.concatenate([np.arange(len(fit_items))] * 2 + [np.flatnonzero(absent)])  # the fit text of each row
    row_y = np.concatenate([y, y, np.zeros(int(absent.sum()))]) > 0
    row_tool = np.concatenate([tools[0], tools[1], tools[2, absent]])
    correct = [bool(p and t in fit_items[k].expected) for k, p, t in zip(rows, row_y, row_tool)]

    # The match floor, on the requests' out-of-fold features against the whole catalog (the
    # same for every pool: the exemplars do not enter them).
    floor = float(np.quantile(match(next(iter(x.values()))[pos], GATE_SCALARS), FLOOR_SHARE)) if pos.any() else None

    def head_of(c: Start, rows: np.ndarray) -> GateHead:
        k = c.strength
        head = GateHeadFit(k * l2, k * l2_embedding).fit(*both(c.pool, rows), pooled[c.pool], prior=c.head)
        return msgspec.structs.replace(head, floor=floor)

    # Out of fold, for the thresholds and, where the model has a built-in calibration, to
    # choose what the fit starts from (the objective's value on texts each head never saw).
    tried: dict[str, float] = {}
    chosen = starts[0]  # replaced in the loop by a start that does better out of fold
    for c in starts:  # ties keep the earlier, simpler start
        row_x = both(c.pool, np.ones(len(fit_items), bool))[0]  # rows in the order of `rows`
        p = np.full(len(rows), -1.0)
        for f in range(FOLDS):
            train, test = folds != f, folds[rows] == f
            if train.sum() and test.sum():
                p[test] = head_of(c, train).probability(row_x[test])
        tried[c.name] = _oof_value(GateScores(kinds[rows].tolist(), p.tolist(), row_y.tolist(), correct), objective)
        if c is chosen or tried[c.name] > tried[chosen.name]:
            chosen, oof = c, p
    if len(starts) > 1:
        say("start: " + ", ".join(f"{n} {v:.3f}" for n, v in tried.items()) + f" out of fold ({objective}): {chosen.name}")
    head = head_of(chosen, np.ones(len(fit_items), bool))
    scores = GateScores(
        path=kinds[rows].tolist(),
        score=oof.tolist(),
        positive=row_y.tolist(),
        correct=correct,
        tool=row_tool.tolist(),
    )
    fitted = fit_gate(scores, objective)
    examples = _examples(fit_items, q, catalog)
    cal = Calibration(pipe.embedder.name, fitted.thresholds, pipe.embedder.prefixes is not None,
                      str(pipe.strategies["user"]), str(pipe.strategies["llm"]), ranker, head, examples)  # fmt: skip
    heldout, before, before_origin = Heldout(math.nan, math.nan, math.nan, math.nan, 0), None, ""
    if held_idx:
        held = [items[i] for i in held_idx]
        simple = simple_gate(simple_gate_features(offers.only_offered(q @ description_vectors(pipe, progress is not None).T), q), y, folds)
        say(f"judging the {len(held_idx)} held-out texts on an engine built from the calibration, and the baselines")
        heldout = judge_heldout(_engine(cfg, catalog, store, pipe, cal, held, vectors[held_idx]), held, vectors[held_idx], simple)
        old = _engine(cfg, catalog, store, pipe, True, held, vectors[held_idx])  # the config's calibration file, else the built-in
        before_origin = old.pipeline.thresholds_origin
        say(f"judging them on the calibration in force before this tune ({before_origin})")
        before = judge_heldout(old, held)
    return Fitted(cal, str(objective), fitted, heldout, scores, len(fit_idx), time.perf_counter() - t0, chosen.name, tried, before, before_origin)


def _engine(cfg: Config, catalog: Catalog, store: Store | None, pipe: Pipeline, calibration: Calibration | bool, held: Sequence[Labeled],
            vectors: np.ndarray) -> Sidecar:  # fmt: skip
    """An engine over `pipe`'s model with `calibration` (True: the one in force without this
    tune), its query cache holding the held-out texts' vectors: judging them embeds nothing again."""
    engine = Sidecar(cfg, from_config(cfg, catalog=catalog, store=store, progress=False, calibration=calibration, embedder=pipe.embedder), store, None)
    engine.pipeline.queries.keep(pipe.embedder, [i.text for i in held], vectors)
    return engine


def judge_heldout(engine: Sidecar, held: Sequence[Labeled], vectors: np.ndarray | None = None,
                  simple: Callable[[np.ndarray], np.ndarray] | None = None) -> Heldout:  # fmt: skip
    """The part never fitted, judged by `engine` as `eval` and `serve` judge (`evaluate.score`),
    with `simple` beside the baselines of the same texts: one threshold on plain cosine, the
    `simple` gate fitted on the fit part (the texts' `vectors` are its inputs), plain cosine and
    BM25 rankings. Without it, the engine's own figures alone (the baselines' stay NaN)."""
    scored = score(engine, held)
    g = gate_report(held, scored.decisions, scored.first)
    r = ranking_report([i for i in held if i.positive], scored.ranked)
    if simple is None or vectors is None:
        return Heldout(g.tp_rate, g.fp_rate, g.accuracy, g.correct_rate, len(held), r.top1, r.mrr, g.auroc)
    ranked, cosine_gate, _ = baselines(engine.pipeline, held, vectors=scored.vectors)
    base = {b.kind: b.ranking.top1 for b in ranked}
    cosines = Offers(engine.pipeline, held).only_offered(vectors @ description_vectors(engine.pipeline).T)
    p = simple(simple_gate_features(cosines, vectors))
    yh = np.array([i.positive for i in held])
    return Heldout(g.tp_rate, g.fp_rate, g.accuracy, g.correct_rate, len(held), r.top1, r.mrr,
                   g.auroc, cosine_gate.auroc, auroc(p[yh], p[~yh]), base["cosine"], base["bm25"])  # fmt: skip


class Start(NamedTuple):
    """What the gate head's fit starts from: the tune's own texts alone (`none`); pooled with
    the built-in calibration's exemplars, so that "close to a known request / to known talk"
    is measured against thousands of texts, not a few hundred (`exemplars`); and also pulled
    toward the built-in head's weights (`head`)."""

    name: str
    extra: Exemplars | None = None
    head: GateHead | None = None
    strength: float = 1.0  # the L2 factor, with a head to be pulled toward

    @property
    def pool(self) -> str:
        return "own" if self.extra is None else "pooled"


START_WORDS = {"none": "these texts alone", "exemplars": "+ the built-in exemplars", "head": "+ the built-in head"}
PRIOR_STRENGTH = 100.0  # a head fitted on a few hundred texts stays near the built-in one


def _starts(model: str, start: str) -> list[Start]:
    """The starts `fit` tries, keeping the one with the best out-of-fold objective: with
    `auto`, the built-in calibration's where the model has one (held-out servers, tuned on
    half of their texts and judged on the other, at the head's former L2 of 100: gate AUROC
    0.971 alone, 0.980 pooled; an intent set, whose out-of-scope queries are requests too,
    keeps its own: HWU64 test AUROC 0.968 alone, 0.963 pooled, 0.860 pulled); `none` fits from the texts alone (as the
    built-in calibrations themselves are fitted)."""
    if start not in ("auto", "none"):
        raise ValueError(f"unknown start {start!r}: use auto or none")
    own = [Start("none")]
    base = builtin(model) if start == "auto" else None
    if base is None or base.head is None or list(base.head.features) != list(GATE_SCALARS):
        return own
    return own + [Start("exemplars", base.head.exemplars), Start("head", base.head.exemplars, base.head, PRIOR_STRENGTH)]


def _oof_value(scores: GateScores, objective: Objective) -> float:
    """The objective's value at the best shared threshold on out-of-fold scores (-inf where
    no threshold meets it)."""
    try:
        return objective.value(fit_gate(scores, objective))
    except ValueError:
        return -math.inf


def _folds(items: Sequence[Labeled], nearest: Sequence[str], seed: int) -> np.ndarray:
    """A fold per item: whole servers per fold when the positives span at least FOLDS servers
    (a calibration meets catalogs it has not seen), else at random. A text that needs no tool
    goes with its `group` (the server it was written about: a question about Jira epics
    belongs with the Jira requests, since a new catalog's near misses come with its tools);
    in a set that names no groups, with the server of its `nearest` tool; in a set that names
    some, a text without one is talk of no server's (small talk, thanks) and takes a random
    fold, as it comes with every catalog."""
    rng = np.random.default_rng(seed)
    random = rng.integers(0, FOLDS, len(items))
    servers = sorted({server_of(min(i.expected)) for i in items if i.positive and SEP in min(i.expected)})
    if len(servers) < FOLDS:  # one server's tools (an intent set): the tools are the ones it will meet
        return random
    grouped = any(i.group for i in items)
    owners = sorted({*servers, *(i.group for i in items if i.group)})
    fold_of = dict(zip(owners, rng.permutation(len(owners)) % FOLDS))

    def owner(item: Labeled, near: str) -> str | None:
        if item.group:
            return item.group
        if item.positive:
            return server_of(min(item.expected))
        return None if grouped else server_of(near)

    return np.array([fold_of.get(owner(i, t), r) for i, t, r in zip(items, nearest, random)])


def _fit_ranker(pipe: Pipeline, q: np.ndarray, features: np.ndarray, targets: Sequence[Sequence[int]], rows: np.ndarray,
                offered: np.ndarray | None = None) -> Ranker:  # fmt: skip
    """The view weights, then the query adapter with those weights held, on the tool requests
    `rows` (`features`: their unadapted views; `targets`: their tools' positions in the user
    index; `offered`: the tools each text was judged against, None for all). Without any, the
    default ranker."""
    if not len(rows):
        return Ranker()
    index = pipe.index_for("user")
    feats, wanted = features[rows], [targets[k] for k in rows]
    shown = None if offered is None else offered[rows]
    base = builtin(pipe.embedder.name)
    held = held_views(base.ranker if base is not None else None, feats.shape[-1])
    ranker = Ranker(RankerFit().weights(feats, wanted, shown, fixed=held))  # the action views' weights are the built-in's
    fixed = ranker.score(feats * np.isin(RANK_FEATURES, ADAPTER_HELD_VIEWS))  # the blend's part the adapter holds
    adapter = AdapterFit().fit(q[rows], index.primary, index.matrix, index.starts, fixed, wanted, ranker.weights, offered=shown)
    return Ranker(ranker.weights, adapter)


MAX_EXAMPLES = 100  # per tool: the classifier's rows stay a few per tool's own cases


def _examples(items: Sequence[Labeled], q: np.ndarray, catalog: Catalog) -> Examples | None:
    """The fit part's requests for exactly one tool, for a catalog that fits a classifier on its
    tools' own cases (None otherwise: derived phrases are no examples to learn from)."""
    if not wants_classifier(catalog):
        return None
    count: dict[str, int] = {}
    rows, tools = [], []
    for k, item in enumerate(items):
        if len(item.expected) == 1:
            (tool,) = item.expected
            if count.setdefault(tool, 0) < MAX_EXAMPLES:
                count[tool] += 1
                rows.append(k)
                tools.append(tool)
    return Examples.of(tools, q[rows]) if rows else None


class Offers:
    """The tools each fit text was judged against: the whole catalog, or the ones its line
    offers (BFCL's protocol; a log of what each chat was offered). A text's views narrow to
    its tools, BM25 taken over those alone, as `eval` judges it (`Sidecar.with_catalog`)."""

    def __init__(self, pipe: Pipeline, items: Sequence[Labeled]):
        self.pipe, self.texts = pipe, [i.text for i in items]
        self.names = np.asarray(pipe.index_for("user").names)
        column = {n: j for j, n in enumerate(self.names)}
        self.masks: list[np.ndarray | None] = []
        for i in items:
            mask = None
            if i.offered is not None:
                mask = np.zeros(len(self.names), bool)
                mask[[column[t] for t in i.offered]] = True
            self.masks.append(mask)
        whole = np.ones(len(self.names), bool)
        # (texts, tools): what each text's softmax ranges over; None where every text has every tool
        self.matrix = None if all(m is None for m in self.masks) else np.vstack([whole if m is None else m for m in self.masks])
        self._lexicals: dict[bytes, LexicalIndex] = {}

    def only_offered(self, scores: np.ndarray) -> np.ndarray:
        """(texts, tools) scores with -1 (no cosine is lower) for tools a text was not offered."""
        return scores if self.matrix is None else np.where(self.matrix, scores, -1.0)

    def allowed(self, k: int) -> np.ndarray:
        m = self.masks[k]
        return np.ones(len(self.names), bool) if m is None else m

    def views(self, views: Sequence[Views], at: Sequence[int] | None = None) -> list[Views]:
        """Each text's views (text positions `at`, all by default) over its own tools."""
        at = range(len(views)) if at is None else at
        return [v if self.masks[k] is None else self.narrow(v, self.texts[k], self.masks[k]) for k, v in zip(at, views)]

    def narrow(self, v: Views, text: str, mask: np.ndarray) -> Views:
        """Whole-catalog views `v` of `text` over the tools of `mask`, scored by the pipe's ranker."""
        key = np.packbits(mask).tobytes()
        if key not in self._lexicals:
            self._lexicals[key] = LexicalIndex(Catalog([t for t, m in zip(self.pipe.catalog, mask) if m]), "bm25")
        cosine, cases = v.cosine[:, mask], v.cases[:, mask]
        bm25 = self._lexicals[key].scores(text)[None, :] if mask.any() else np.zeros((1, 0), np.float32)
        logits = None if v.logits is None else v.logits[:, mask]  # renormalised over these tools by rank_features
        words = None if v.symbolic is None else v.symbolic[:, mask]
        servers = None if v.servers is None else v.servers[mask]
        return Views(v.index, self.pipe.ranker.score(rank_features(cosine, bm25, cases, logits, words, servers)), cosine, cases, bm25, logits,
                     symbolic=words, servers=servers)  # fmt: skip

    def widen(self, k: int, row: np.ndarray) -> np.ndarray:
        """Text k's per-tool rows over its own tools, placed at their catalog positions (zeros elsewhere)."""
        if (m := self.masks[k]) is None:
            return row
        out = np.zeros((len(m), *row.shape[1:]), row.dtype)
        out[m] = row
        return out

    def best_tool(self, k: int, v: Views) -> str:
        return self.best_within(self.allowed(k), v)

    def best_within(self, mask: np.ndarray, v: Views) -> str:
        """The first tool of views `v` over the tools of `mask` ("" over none)."""
        return str(self.names[mask][int(np.argmax(v.scores[0]))]) if v.scores.shape[1] else ""

    def gate_inputs(self, requests, q: np.ndarray, views: Sequence[Views], routes, known: Known) -> np.ndarray:
        """The gate head's fit rows for `views`, each against its own tools (batched by how many)."""
        out = np.zeros((len(views), len(GATE_SCALARS) + q.shape[1]))
        widths = np.array([v.scores.shape[1] for v in views])
        for width in np.unique(widths):
            rows = np.flatnonzero(widths == width)
            out[rows] = self.pipe.gate_inputs([requests[j] for j in rows], q[rows], [views[j] for j in rows], [routes[j] for j in rows],
                                              known, exclude_self=True, names=GATE_SCALARS)  # fmt: skip
        return out


PARTS = 16  # distinct smaller catalogs the texts are spread over


def _against_parts(offers: Offers, at: Sequence[int], items, requests, q, views, routes, knowns: Sequence[Known], rng,
                   absent: bool = False) -> tuple[list[np.ndarray], np.ndarray, list[str]]:  # fmt: skip
    """Gate features of each text (positions `at`; whole-catalog `views`) against a smaller
    catalog: one of PARTS random sets of servers (of single tools, for a one-server catalog),
    plus the text's own expected tools, within the tools it was offered. Users bring 5 tools
    or 500; the head should mean the same for both. With `absent`, the part leaves out the
    servers of the text's tools instead: a request the catalog does not answer, which should
    stay silent (BFCL's irrelevant requests, an intent set's out-of-scope ones). Also
    returned: which texts had any tool left to be judged against, and each one's best tool there."""
    pipe = offers.pipe
    group = np.asarray([server_of(n) for n in offers.names])
    servers = np.unique(group)
    xs = [np.zeros((len(items), len(GATE_SCALARS) + q.shape[1])) for _ in knowns]
    part_of = rng.integers(0, PARTS, len(items))
    parts = [np.isin(group, rng.choice(servers, size=int(rng.integers(1, max(2, len(servers) // 2 + 1))), replace=False)) for _ in range(PARTS)]
    judged = np.ones(len(items), bool)
    best = [""] * len(items)
    for k, item in enumerate(items):
        allowed = offers.allowed(at[k])
        own = np.isin(group, [server_of(t) for t in item.expected])
        mask = (parts[part_of[k]] | own) & allowed
        mask = mask if mask.any() else allowed  # a text needing none, offered nothing of the part: all it was offered
        if absent:  # the part less the text's servers; all it was offered less them, where the part was only those
            mask = parts[part_of[k]] & ~own & allowed
            mask = mask if mask.any() else ~own & allowed
            if not mask.any():
                judged[k] = False
                continue
        part = offers.narrow(views[k], requests[k].text, mask)
        best[k] = offers.best_within(mask, part)
        for x, kn in zip(xs, knowns):
            x[k] = pipe.gate_inputs([requests[k]], q[k : k + 1], [part], [routes[k]], kn, exclude_self=True, names=GATE_SCALARS)[0]
    return xs, judged, best


def server_of(tool: str) -> str:
    return tool.split(SEP)[0] if SEP in tool else tool


def query_vectors(pipe: Pipeline, texts: Sequence[str], progress: bool = False) -> np.ndarray:
    distinct = list(dict.fromkeys(texts))
    label = f"{pipe.embedder.name}: embedding {len(distinct)} texts" if progress else None  # shown only where the store lacks some
    found, _ = embed_cached(pipe.embedder, pipe.store, distinct, "query", progress=label)
    return np.vstack([found[t] for t in texts]) if texts else np.zeros((0, pipe.embedder.dim), np.float32)


def _exemplars(q: np.ndarray, pos: np.ndarray, high: np.ndarray, seed: int) -> Exemplars:
    """At most MAX_EXEMPLARS texts per class, with their paths. The smaller path's texts are
    kept whole (up to half the class), since each text is compared only with its own path's."""
    rng = np.random.default_rng(seed)

    def pick(rows: np.ndarray) -> np.ndarray:
        if len(rows) <= MAX_EXEMPLARS:
            return rows
        groups = sorted((rows[high[rows]], rows[~high[rows]]), key=len)
        few = groups[0] if len(groups[0]) <= MAX_EXEMPLARS // 2 else rng.choice(groups[0], MAX_EXEMPLARS // 2, replace=False)
        rest = rng.choice(groups[1], MAX_EXEMPLARS - len(few), replace=False)
        return np.sort(np.concatenate([few, rest]))

    t, n = pick(np.flatnonzero(pos)), pick(np.flatnonzero(~pos))
    return Exemplars.of(q[t], q[n], high[t], high[n])


def write_calibration(fitted: Fitted, path: str | pathlib.Path) -> None:
    """What `--calibration` reads: the model, its thresholds, ranker and gate head, and the evidence."""
    doc = msgspec.to_builtins(fitted.calibration) | {
        "objective": fitted.objective,
        "fit": msgspec.to_builtins(fitted.fit),
        "heldout": msgspec.to_builtins(fitted.heldout),
        "before": msgspec.to_builtins(fitted.before),
        "before_origin": fitted.before_origin,
        "start": fitted.start,
        "starts": fitted.starts,
    }
    doc["fit"].pop("thresholds", None)
    pathlib.Path(path).write_bytes(msgspec.json.encode(doc) + b"\n")


def describe(f: Fitted) -> str:
    c, t, h, r = f.calibration, f.calibration.thresholds, f.heldout, f.calibration.ranker
    return "\n".join([
        f"{c.model}{' +task-prefixes' if c.task_prefixes else ''}: fitted on {f.fit_items} items in {f.seconds:.0f} s, objective {f.objective}",
        "  ranker weights: " + ", ".join(f"{v} {w:.3f}" for v, w in zip(("cosine", "bm25", *RANK_FEATURES[2:]), r.weights))
        + (", after a query adapter" if r.adapter is not None else ""),
        f"  thresholds (probabilities): high {t.high:.3f}, fallback {t.fallback:.3f}, confirm {t.confirm:.3f}, auto {t.auto:.3f}",
        f"  out-of-fold on the fit part (each text against the catalog and against a part of it): TP {f.fit.tp_rate:.1%}, "
        f"FP {f.fit.fp_rate:.1%}, accuracy {f.fit.accuracy:.1%}, right tool {f.fit.correct_rate:.1%}",
    ] + ([
        f"  gate head started from: {START_WORDS[f.start]} (out of fold, {f.objective}: "
        + ", ".join(f"{START_WORDS[n]} {v:.3f}" for n, v in f.starts.items()) + ")",
    ] if len(f.starts) > 1 else []) + (heldout_table(f) if h.n else []))  # fmt: skip


ORIGIN_WORDS = {"builtin": "built-in", "calibration": "the config's calibration file", "uncalibrated": "uncalibrated"}


def heldout_table(f: Fitted) -> list[str]:
    """The held-out part, one row a method on the same texts: this tune, the calibration in
    force before it (what tuning bought), and the baselines (what any of it buys)."""
    h, b = f.heldout, f.before
    pct = lambda v: "–" if math.isnan(v) else f"{v:.1%}"  # noqa: E731
    num = lambda v: "–" if math.isnan(v) else f"{v:.3f}"  # noqa: E731
    nan = math.nan
    base, _, extra = f.before_origin.partition("+")
    rows = [("this tune", h.tp_rate, h.fp_rate, h.auroc, h.correct_rate, h.top1, h.mrr)]
    if b is not None:
        rows.append((f"before this tune ({ORIGIN_WORDS.get(base, base)}{', config thresholds' if extra else ''})",
                     b.tp_rate, b.fp_rate, b.auroc, b.correct_rate, b.top1, b.mrr))  # fmt: skip
    rows += [("plain cosine (one threshold)", nan, nan, h.cosine_auroc, nan, h.cosine_top1, nan),
             ("logistic regression on the embedding and cosine", nan, nan, h.simple_auroc, nan, nan, nan),
             ("BM25", nan, nan, nan, nan, h.bm25_top1, nan)]  # fmt: skip
    width = max(len(r[0]) for r in rows)
    head = f"    {'':<{width}}  {'TP':>6}  {'FP':>6}  {'AUROC':>6}  {'right tool':>10}  {'top1':>6}  {'MRR':>6}"
    lines = [f"  held out ({h.n} items, never fitted; each judged as eval judges it; right tool: fired with an expected tool first):", head]
    lines += [f"    {n:<{width}}  {pct(tp):>6}  {pct(fp):>6}  {num(au):>6}  {pct(rt):>10}  {pct(t1):>6}  {num(mrr):>6}" for n, tp, fp, au, rt, t1, mrr in rows]
    return lines
