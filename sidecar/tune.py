"""Fitting the gate to a model and a catalog from a labelled set.

Two questions, answered from the same scores the pipeline computes:
* which index strategy separates tool requests from everything else best (the matrix), and
* which thresholds the tiered gate should use (the calibration).
Pure numpy over per-item scores; the caller gets the scores from the pipeline.
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from . import patterns as patterns_mod
from .calibration import DEFAULT_LLM_STRATEGY, DEFAULT_USER_STRATEGY, Calibration
from .cases import Strategy
from .catalog import Catalog
from .config import Config
from .evaluate import Labeled, auroc, run
from .gate import Thresholds, ToolThresholds
from .index import ToolIndex
from .pipeline import Pipeline, open_embedder
from .store import Store

# Below these counts a fitted threshold is noise; the caller reports rather than fits.
MIN_POSITIVES = 8
MIN_NEGATIVES = 8


class Row(msgspec.Struct):
    """One line of the strategy matrix."""

    model: str
    strategy: str
    gap: float  # lowest positive score minus highest negative score (> 0: separable)
    threshold: float  # the accuracy-maximising cut
    accuracy: float
    tp_rate: float
    fp_rate: float
    auroc: float
    pareto: bool = False


class Objective(msgspec.Struct, frozen=True):
    """Highest TP rate with FP rate at most `max_fp` (the default), or best balanced accuracy."""

    kind: str = "max_tp"  # "max_tp" | "balanced"
    max_fp: float = 0.05

    @classmethod
    def parse(cls, spec: str) -> Objective:
        """'max_tp', 'max_tp:fp<=0.02', 'balanced'."""
        kind, _, arg = spec.partition(":")
        if kind == "balanced" and not arg:
            return cls("balanced")
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
        raise ValueError(f"unknown objective {spec!r}: use max_tp, max_tp:fp<=0.02 or balanced")

    def __str__(self) -> str:
        return "balanced" if self.kind == "balanced" else f"max_tp:fp<={self.max_fp:g}"

    def value(self, fit: GateFit) -> float:
        """How good a fitted gate is under this objective (for comparing models)."""
        return float(self.better(np.array(fit.tp_rate), np.array(fit.fp_rate)))

    def better(self, tp: np.ndarray, fp: np.ndarray) -> np.ndarray:
        """A score per candidate (higher is better; -inf where infeasible)."""
        if self.kind == "balanced":
            return (tp + 1 - fp) / 2
        return np.where(fp <= self.max_fp + 1e-12, tp, -np.inf)


def best_cut(pos: np.ndarray, neg: np.ndarray) -> tuple[float, float, float, float]:
    """(threshold, accuracy, tp_rate, fp_rate) of the accuracy-maximising cut `score >= t`."""
    cands = _cuts(np.concatenate([pos, neg]))
    tp = (pos[None, :] >= cands[:, None]).mean(axis=1) if len(pos) else np.zeros(len(cands))
    fp = (neg[None, :] >= cands[:, None]).mean(axis=1) if len(neg) else np.zeros(len(cands))
    acc = (tp * len(pos) + (1 - fp) * len(neg)) / max(len(pos) + len(neg), 1)
    i = int(np.argmax(acc))
    return float(cands[i]), float(acc[i]), float(tp[i]), float(fp[i])


def _cuts(scores: np.ndarray) -> np.ndarray:
    """Candidate thresholds: midpoints between distinct scores, plus both ends."""
    u = np.unique(np.round(scores, 4))
    if not len(u):
        return np.array([0.5])
    mids = (u[1:] + u[:-1]) / 2
    return np.concatenate([[u[0] - 1e-3], mids, [u[-1] + 1e-3]])


def matrix_row(model: str, strategy: str, pos: Sequence[float], neg: Sequence[float]) -> Row:
    p, n = np.asarray(pos, float), np.asarray(neg, float)
    gap = float(p.min() - n.max()) if len(p) and len(n) else math.nan
    t, acc, tp, fp = best_cut(p, n)
    return Row(model, strategy, round(gap, 4), round(t, 4), acc, tp, fp, auroc(p, n))


def mark_pareto(rows: list[Row]) -> list[Row]:
    """A row is Pareto-optimal when no other row has TP >= and FP <= with one strictly better."""
    for r in rows:
        r.pareto = not any(
            (o.tp_rate >= r.tp_rate and o.fp_rate <= r.fp_rate) and (o.tp_rate > r.tp_rate or o.fp_rate < r.fp_rate)
            for o in rows
            if o is not r
        )
    return sorted(rows, key=lambda r: (-(r.gap if not math.isnan(r.gap) else -9), -r.accuracy))


class GateScores(msgspec.Struct):
    """Per item, what the pipeline saw: the path kind, the best score, whether its tool was right."""

    path: list[str]  # "blocked" | "high" | "fallback"
    score: list[float]
    positive: list[bool]
    correct: list[bool]  # positive and the top tool is an expected one
    tool: list[str | None] = []  # the best candidate (whose per-tool thresholds apply)

    @classmethod
    def from_decisions(cls, items, decisions) -> GateScores:
        path, score, positive, correct, tool = [], [], [], [], []
        for i, d in zip(items, decisions):
            kind = "blocked" if d.path.startswith("negative:") else ("high" if d.path.startswith("high:") else "fallback")
            path.append(kind)
            score.append(-1.0 if d.score is None else float(d.score))
            positive.append(i.positive)
            correct.append(i.positive and d.tool in i.expected)
            tool.append(d.tool)
        return cls(path, score, positive, correct, tool)

    def subset(self, idx: Sequence[int]) -> GateScores:
        return GateScores(*([getattr(self, f)[i] for i in idx] for f in ("path", "score", "positive", "correct", "tool")))


def fired(s: GateScores, t: Thresholds) -> np.ndarray:
    path = np.asarray(s.path)
    score = np.asarray(s.score)
    tools = s.tool or [None] * len(s.path)
    need = np.array([t.path_threshold("high:" if p == "high" else p, tool) for p, tool in zip(s.path, tools)])
    return (path != "blocked") & (score >= need) & (score >= t.confirm)


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


def fit_gate(s: GateScores, objective: Objective = Objective(), auto_precision: float = 0.9, per_tool: bool = True) -> GateFit:
    """Search the high-pattern and fallback thresholds jointly for the objective; ties go to
    the pair that fires the right tool most, then to the higher (safer) thresholds. `confirm`
    is the lower of the two (the paths' own thresholds decide), `auto` the lowest score at
    which fired decisions were right at least `auto_precision` of the time. With `per_tool`,
    a tool that is the best candidate of enough positives and negatives gets its own pair."""
    pos = np.asarray(s.positive)
    if pos.sum() < MIN_POSITIVES or (~pos).sum() < MIN_NEGATIVES:
        raise ValueError(f"need at least {MIN_POSITIVES} positives and {MIN_NEGATIVES} negatives to fit thresholds")
    found = _search_pair(s, objective)
    if found is None:
        raise ValueError(f"no thresholds meet the objective {objective.kind} (fp <= {objective.max_fp})")
    h, f = found
    confirm = min(h, f)
    tools = _fit_tools(s, objective, h, f) if per_tool else {}
    if tools:
        confirm = min([confirm, *(v for t in tools.values() for v in (t.high, t.fallback) if v is not None)])
    t = Thresholds(high=round(h, 4), fallback=round(f, 4), auto=1.0, confirm=round(confirm, 4), tools=tools)
    t = msgspec.structs.replace(t, auto=round(_auto_cut(s, t, auto_precision), 4))
    return rates(s, t)


def _search_pair(s: GateScores, objective: Objective) -> tuple[float, float] | None:
    """The (high, fallback) pair that best meets `objective` on `s`, or None if none does."""
    path = np.asarray(s.path)
    score = np.asarray(s.score)
    pos = np.asarray(s.positive)
    correct = np.asarray(s.correct)
    live = path != "blocked"
    hi, fb = live & (path == "high"), live & (path == "fallback")
    grid_h = _cuts(score[hi]) if hi.any() else np.array([1.0])
    grid_f = _cuts(score[fb]) if fb.any() else np.array([1.0])
    # fired[h, f, item] without materialising the cube: per path, items over each threshold.
    over_h = score[None, :] >= grid_h[:, None]  # (H, n)
    over_f = score[None, :] >= grid_f[:, None]  # (F, n)
    n_pos, n_neg = max(pos.sum(), 1), max((~pos).sum(), 1)
    tp = (over_h & hi & pos).sum(1)[:, None] + (over_f & fb & pos).sum(1)[None, :]
    fp = (over_h & hi & ~pos).sum(1)[:, None] + (over_f & fb & ~pos).sum(1)[None, :]
    ok = (over_h & hi & correct).sum(1)[:, None] + (over_f & fb & correct).sum(1)[None, :]
    value = objective.better(tp / n_pos, fp / n_neg)
    if not np.isfinite(value).any():
        return None
    # lexicographic: objective, then right-tool count, then higher thresholds
    key = np.stack(np.broadcast_arrays(value, ok, grid_h[:, None] + grid_f[None, :]), -1).reshape(-1, 3)
    best = np.lexsort((key[:, 2], key[:, 1], key[:, 0]))[-1]
    h, f = grid_h[best // len(grid_f)], grid_f[best % len(grid_f)]
    return float(np.clip(h, -1, 1)), float(np.clip(f, -1, 1))


def _fit_tools(s: GateScores, objective: Objective, high: float, fallback: float) -> dict[str, ToolThresholds]:
    """Own thresholds for each tool that is the best candidate of at least MIN_POSITIVES
    positives and MIN_NEGATIVES negatives (where the data allows, and only there), kept when
    they differ from the model's."""
    out: dict[str, ToolThresholds] = {}
    by_tool: dict[str, list[int]] = {}
    for i, (tool, path) in enumerate(zip(s.tool, s.path)):
        if tool is not None and path != "blocked":
            by_tool.setdefault(tool, []).append(i)
    for tool, idx in sorted(by_tool.items()):
        sub = s.subset(idx)
        n_pos = sum(sub.positive)
        if n_pos < MIN_POSITIVES or len(idx) - n_pos < MIN_NEGATIVES:
            continue
        found = _search_pair(sub, objective)
        if found is None:
            continue
        h = round(found[0], 4) if "high" in sub.path else None
        f = round(found[1], 4) if "fallback" in sub.path else None
        own = ToolThresholds(h if h != round(high, 4) else None, f if f != round(fallback, 4) else None)
        if own.high is not None or own.fallback is not None:
            out[tool] = own
    return out


def _auto_cut(s: GateScores, t: Thresholds, precision: float) -> float:
    """Lowest score from which every fired decision above it is right `precision` of the time."""
    f = fired(s, t)
    score = np.asarray(s.score)[f]
    right = np.asarray(s.correct)[f]
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


# --- the study: models x strategies on a labelled set, then the gate fitted on the best ------


class Heldout(msgspec.Struct):
    tp_rate: float
    fp_rate: float
    accuracy: float
    correct_rate: float
    n: int


class Chosen(msgspec.Struct):
    """What `--out` writes (as a calibration) and how it did where it was fitted."""

    model: str
    task_prefixes: bool
    user_strategy: str
    llm_strategy: str
    objective: str
    thresholds: Thresholds
    fit: GateFit


class Study(msgspec.Struct):
    matrix: list[Row]
    chosen: Chosen
    heldout: Heldout
    candidates: list[Chosen]  # the best gate per model / prefix setting, best first
    gate_scores: GateScores  # of the chosen setting, all items (for the plot)
    fit_idx: list[int]
    heldout_idx: list[int]


DEFAULT_STRATEGIES = ("base", "prefix", "mcp", "prefix+mcp", "mcp+llm", "prefix+llm", "action")


def study(
    items: Sequence[Labeled],
    catalog: Catalog,
    models: Sequence[str],
    cfg: Config,
    strategies: Sequence[str] = DEFAULT_STRATEGIES,
    prefix_modes: Sequence[str] = ("auto",),
    objective: Objective = Objective(),
    heldout_fraction: float = 0.3,
    seed: int = 0,
    store: Store | None = None,
    progress: Callable[[str], None] | None = None,
) -> Study:
    """Measure every model x task-prefix setting x strategy on the fit part, fit the gate for
    each model on its best strategies, and report the winner on the part it never saw."""
    say = progress or (lambda msg: None)
    parsed = {str(Strategy.parse(s)): Strategy.parse(s) for s in strategies}
    fit_idx, held_idx = split(len(items), heldout_fraction, seed)
    fit_items = [items[i] for i in fit_idx]
    pos = np.array([i.positive for i in fit_items])
    src = np.array([i.source for i in fit_items])
    pats = patterns_mod.load_dir(cfg.gate.patterns or patterns_mod.PATTERNS_DIR, cfg.gate.regex_timeout_ms / 1000)
    matrix: list[Row] = []
    fits: list[tuple[Chosen, GateScores]] = []
    for model in models:
        for mode in prefix_modes:
            mcfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, name=model, task_prefixes=mode))
            embedder = open_embedder(mcfg, store, progress=progress is not None)
            label = embedder.name + (" +task-prefixes" if embedder.prefixes else "")
            say(f"{label}: embedding {len(fit_items)} texts")
            q = embedder.embed([i.text for i in fit_items], "query").vectors
            best_auc = {"user": (-1.0, cfg.index.user_strategy or DEFAULT_USER_STRATEGY),
                        "llm": (-1.0, cfg.index.llm_strategy or DEFAULT_LLM_STRATEGY)}  # fmt: skip
            for name, strat in parsed.items():
                say(f"{label}: indexing {len(catalog)} tools as {name}")
                best = ToolIndex.build(catalog, embedder, strat, store).tool_scores(q).max(axis=1)
                matrix.append(matrix_row(label, name, best[pos], best[~pos]))
                for source in best_auc:
                    m = src == source
                    a = auroc(best[pos & m], best[~pos & m])
                    if a > best_auc[source][0]:  # NaN (no items of this source) never wins
                        best_auc[source] = (a, name)
            user_s, llm_s = best_auc["user"][1], best_auc["llm"][1]
            say(f"{label}: running the tiered gate (user {user_s}, llm {llm_s})")
            strategies_for = {"user": Strategy.parse(user_s), "llm": Strategy.parse(llm_s)}
            pipe = Pipeline(embedder, catalog, pats, Thresholds(), strategies_for, store)
            scores = GateScores.from_decisions(items, run(pipe, items))
            fitted = fit_gate(scores.subset(fit_idx), objective)
            matrix.append(gate_row(label, f"tiered gate ({user_s} / {llm_s})", scores.subset(fit_idx), fitted))
            chosen = Chosen(embedder.name, embedder.prefixes is not None, user_s, llm_s, str(objective), fitted.thresholds, fitted)
            fits.append((chosen, scores))
    fits.sort(key=lambda cs: (objective.value(cs[0].fit), cs[0].fit.correct_rate), reverse=True)
    chosen, scores = fits[0]
    if held_idx:
        h = rates(scores.subset(held_idx), chosen.thresholds)
        heldout = Heldout(h.tp_rate, h.fp_rate, h.accuracy, h.correct_rate, len(held_idx))
    else:
        heldout = Heldout(math.nan, math.nan, math.nan, math.nan, 0)
    return Study(mark_pareto(matrix), chosen, heldout, [c for c, _ in fits], scores, fit_idx, held_idx)


def gate_row(model: str, name: str, s: GateScores, fitted: GateFit) -> Row:
    """The tiered gate as one matrix row: its separation and its fitted operating point."""
    live = [(sc, p) for sc, p, k in zip(s.score, s.positive, s.path) if k != "blocked"]
    pos = [sc for sc, p in live if p]
    neg = [sc for sc, p in live if not p]
    gap = round(float(min(pos) - max(neg)), 4) if pos and neg else math.nan
    gs = [sc if k != "blocked" else -1.0 for sc, k in zip(s.score, s.path)]
    auc = auroc([g for g, p in zip(gs, s.positive) if p], [g for g, p in zip(gs, s.positive) if not p])
    return Row(model, name, gap, fitted.thresholds.fallback, fitted.accuracy, fitted.tp_rate, fitted.fp_rate, auc)


def write_calibration(chosen: Chosen, path: str | pathlib.Path) -> None:
    """What `--calibration` reads: the model, its thresholds and strategies, and the evidence."""
    cal = Calibration(chosen.model, chosen.thresholds, chosen.task_prefixes, chosen.user_strategy, chosen.llm_strategy)
    doc = msgspec.to_builtins(cal) | {"objective": chosen.objective, "fit": msgspec.to_builtins(chosen.fit)}
    doc["fit"].pop("thresholds", None)
    pathlib.Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(doc)) + b"\n")


def describe(s: Study) -> str:
    head = f"{'model':<34} {'strategy':<36} {'gap':>7} {'thresh':>7} {'acc':>6} {'TP':>6} {'FP':>6} {'AUROC':>6}  pareto"
    lines = [head, "-" * len(head)]
    for r in s.matrix:
        lines.append(
            f"{r.model:<34} {r.strategy:<36} {r.gap:>7.3f} {r.threshold:>7.3f} {r.accuracy:>6.1%} {r.tp_rate:>6.1%} "
            f"{r.fp_rate:>6.1%} {r.auroc:>6.3f}  {'*' if r.pareto else ''}"
        )
    c, t, h = s.chosen, s.chosen.thresholds, s.heldout
    lines += [
        "",
        f"chosen: {c.model}{' +task-prefixes' if c.task_prefixes else ''}, user {c.user_strategy}, llm {c.llm_strategy}, objective {c.objective}",
        f"  thresholds: high {t.high:.3f}, fallback {t.fallback:.3f}, confirm {t.confirm:.3f}, auto {t.auto:.3f}"
        + (f"; own thresholds for {len(t.tools)} tool(s): " + ", ".join(sorted(t.tools)[:5]) + (" ..." if len(t.tools) > 5 else "") if t.tools else ""),
        f"  fitted on {len(s.fit_idx)} items: TP {c.fit.tp_rate:.1%}, FP {c.fit.fp_rate:.1%}, accuracy {c.fit.accuracy:.1%}, right tool {c.fit.correct_rate:.1%}",
        f"  held out ({h.n} items, never fitted): TP {h.tp_rate:.1%}, FP {h.fp_rate:.1%}, accuracy {h.accuracy:.1%}, right tool {h.correct_rate:.1%}",
    ]
    return "\n".join(lines)
