"""Measuring the pipeline on a labelled set: how well the gate separates, how well tools rank.

Everything here is pure arithmetic over decisions the one pipeline produced, so `eval`,
`tune` and the tests all judge the same outputs the server would send.
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

import msgspec
import numpy as np

from .. import jsonl
from ..core import ranking
from ..core.catalog import Catalog
from ..core.gate import Decision
from ..core.ranking import percentiles
from ..learn.traffic import transcript_turns

if TYPE_CHECKING:
    from ..engine import Sidecar
    from ..transcripts import Conversation


class LabeledError(ValueError):
    """A labelled file is unusable; the message names file:line."""


class Labeled(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    text: str
    expect: str | list[str] | None = None  # null: no tool should fire
    source: Literal["user", "llm"] = "user"
    kind: str | None = None  # what sort of text a "no tool" item is (small talk, an offer, ...)
    group: str | None = None  # what the text was written about (a server): `tune` holds a group out whole
    offered: list[str] | None = None  # judged against only these tools (BFCL's protocol); None: the whole catalog
    id: str | int | None = None  # the source set's own name for the item, kept for reading misses
    calls: list[str] | None = None  # every tool the turn called, in order: the set an inject should hold
    domain: str | None = None  # the source set's split (Seal-Tools: "in" / "out" of its tuning domains)

    @property
    def expected(self) -> frozenset[str]:
        if self.expect is None:
            return frozenset()
        return frozenset([self.expect] if isinstance(self.expect, str) else self.expect)

    @property
    def positive(self) -> bool:
        return self.expect is not None


_decoder = msgspec.json.Decoder(Labeled)


def read_labeled(path: str | pathlib.Path, catalog: Catalog | None = None) -> list[Labeled]:
    """Read a JSONL labelled set; with a catalog, every expected tool must be in it."""
    items = []
    for where, item in jsonl.read(path, _decoder, LabeledError):
        if not item.text.strip():
            raise LabeledError(f"{where}: empty text")
        if isinstance(item.expect, list) and not item.expect:
            raise LabeledError(f"{where}: expect is an empty list (use null for 'no tool')")
        if catalog is not None:
            unknown = sorted(t for t in item.expected if catalog.get(t) is None)
            if unknown:
                raise LabeledError(f"{where}: expected tool(s) not in the catalog: {', '.join(unknown)}")
            if unknown := sorted(t for t in item.offered or () if catalog.get(t) is None):
                raise LabeledError(f"{where}: offered tool(s) not in the catalog: {', '.join(unknown)}")
            if unknown := sorted(t for t in set(item.calls or ()) if catalog.get(t) is None):
                raise LabeledError(f"{where}: called tool(s) not in the catalog: {', '.join(unknown)}")
        if item.offered is not None and not item.expected <= set(item.offered):
            raise LabeledError(f"{where}: expected tool(s) not among the offered ones: {', '.join(sorted(item.expected - set(item.offered)))}")
        items.append(item)
    if not items:
        raise LabeledError(f"{path}: no labelled items")
    return items


def from_transcripts(conversations: Sequence[Conversation]) -> list[Labeled]:
    """Chat logs as labelled data (`tune --transcripts`): each user turn expects the tools the
    model called before the next user turn, in the order first called, or none where it called
    none (`traffic.transcript_turns`, the pairing the server learns from). Free labels from
    traffic every chat app already keeps; a turn with empty text is left out."""
    return [Labeled(t.text, None if not t.calls else t.calls[0] if len(t.calls) == 1 else list(t.calls), "user", id=t.ref)
            for t in transcript_turns(conversations)]  # fmt: skip


def against_whole_catalog(items: Sequence[Labeled], command: str) -> Sequence[Labeled]:
    """`items`, refused if any offers its own tools: `command` judges every text against the
    whole catalog, so it would fit or measure what the labels do not say."""
    if offering := sum(i.offered is not None for i in items):
        raise LabeledError(f"{command} judges every text against the whole catalog, but {offering} item(s) offer their own tools; "
                           "`sidecar eval` reads them (each against its own)")
    return items


# --- the gate ---------------------------------------------------------------------------------


class GateReport(msgspec.Struct):
    tp_rate: float  # positives on which the gate fired
    fp_rate: float  # negatives on which it fired
    accuracy: float
    balanced_accuracy: float
    auroc: float  # of the gate score (blocked = -1): how well it separates at any threshold
    correct_rate: float  # positives on which it fired and would inject an expected tool first
    positives: int
    negatives: int


def gate_score(d: Decision) -> float:
    """One number per decision for threshold-free measures: a blocked text scores -1."""
    if d.kind == "negative" or d.score is None:
        return -1.0
    return d.score


def auroc(pos: Sequence[float], neg: Sequence[float]) -> float:
    """P(a random positive outscores a random negative), ties counting half."""
    if not len(pos) or not len(neg):
        return math.nan
    scores = np.concatenate([np.asarray(pos, float), np.asarray(neg, float)])
    order = scores.argsort(kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    # average ranks over ties
    i = 0
    while i < len(scores):
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    r_pos = ranks[: len(pos)].sum()
    return float((r_pos - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def _rate(n: int, d: int) -> float:
    return n / d if d else math.nan


def gate_report(items: Sequence[Labeled], decisions: Sequence[Decision], first: Sequence[str | None] | None = None) -> GateReport:
    """`first`: per item, the tool that would be injected first when the gate fires (default:
    the gate's own best candidate)."""
    first = first if first is not None else [d.tool for d in decisions]
    pos = [(i, d, f) for i, d, f in zip(items, decisions, first) if i.positive]
    neg = [d for i, d in zip(items, decisions) if not i.positive]
    tp = sum(d.fired for _, d, _ in pos)
    fp = sum(d.fired for d in neg)
    correct = sum(d.fired and f in i.expected for i, d, f in pos)
    tpr, fpr = _rate(tp, len(pos)), _rate(fp, len(neg))
    return GateReport(
        tp_rate=tpr,
        fp_rate=fpr,
        accuracy=_rate(tp + len(neg) - fp, len(items)),
        balanced_accuracy=(tpr + (1 - fpr)) / 2,
        auroc=auroc([gate_score(d) for _, d, _ in pos], [gate_score(d) for d in neg]),
        correct_rate=_rate(correct, len(pos)),
        positives=len(pos),
        negatives=len(neg),
    )


# --- ranking ----------------------------------------------------------------------------------


class RankingReport(msgspec.Struct):
    top1: float
    top3: float
    mrr: float
    ndcg_at_10: float = msgspec.field(name="ndcg@10")
    coverage: float  # expected tools ranked first for at least one of their items
    n: int


def ranking_report(items: Sequence[Labeled], rankings: Sequence[Sequence[str]]) -> RankingReport:
    """Over positives only; rankings are tool names, best first."""
    rows = [(i, list(r)) for i, r in zip(items, rankings) if i.positive]
    hits = [ranking.first_hit(r, i.expected) for i, r in rows]
    expected_tools = set().union(*(i.expected for i, _ in rows)) if rows else set()
    top_tools = {r[0] for i, r in rows if r and r[0] in i.expected}
    n = len(rows)
    return RankingReport(
        top1=ranking.hit_rate(hits, 1),
        top3=ranking.hit_rate(hits, 3),
        mrr=ranking.mrr(hits),
        ndcg_at_10=_rate(sum(ranking.ndcg(r, i.expected, 10) for i, r in rows), n),
        coverage=_rate(len(top_tools), len(expected_tools)),
        n=n,
    )


def detected(pipe, items: Sequence[Labeled], batch: int = 16, on_batch: Callable[[int], None] | None = None) -> tuple[list[Decision], list]:
    """Decisions and each item's query vector (None where a negative pattern blocked it
    unembedded), so ranking the same items need not embed them again."""
    from ..core.pipeline import Request

    out: list[Decision] = []
    vectors: list = []
    for lo in range(0, len(items), batch):
        chunk = items[lo : lo + batch]
        j = pipe.detect_batch([Request(i.text, i.source) for i in chunk])
        out.extend(j.decisions)
        vectors.extend(j.vectors)
        if on_batch:
            on_batch(len(chunk))
    return out, vectors


class BaselineReport(msgspec.Struct):
    kind: str  # "cosine" (query vs description, same model), "bm25", "tfidf"
    ranking: RankingReport


class Report(msgspec.Struct):
    n: int
    model: str
    strategy: str
    thresholds: dict[str, float]
    thresholds_origin: str
    gate: GateReport
    ranking: RankingReport  # what the sidecar injects first: the recommender over the ranker
    latency_ms: dict[str, float]
    ranking_by: str = "ranker"
    ranking_ranker: RankingReport | None = None  # the fitted ranker alone, before history
    baselines: list[BaselineReport] = []  # computed in the same run, on the same items
    gate_baseline: GateBaseline | None = None  # one threshold on plain cosine, same items
    by_source: dict[str, SourceReport] = {}  # the same figures for user turns and reply clauses apart
    sets: SetReport | None = None  # items with `calls`: the injected tools against every tool called
    set_baselines: dict[str, SetReport] = {}


class SetReport(msgspec.Struct):
    """The tools injected against the set a turn called (items with `calls`), summed over items:
    recall, the called tools that were injected; precision, the injected tools that were called;
    exact, the share of items whose inject is the called set. A silent gate injects nothing."""

    recall: float
    precision: float
    exact: float
    injected_per_item: float
    called_per_item: float
    n: int


def set_report(called: Sequence[Sequence[str]], injected: Sequence[Sequence[str]]) -> SetReport:
    hits = want = given = exact = 0
    for c, inj in zip(called, injected):
        c, inj = set(c), list(dict.fromkeys(inj))
        hits += len(c.intersection(inj))
        want += len(c)
        given += len(inj)
        exact += c == set(inj)
    n = len(called)
    return SetReport(_rate(hits, want), _rate(hits, given), _rate(exact, n), _rate(given, n), _rate(want, n), n)


class SourceReport(msgspec.Struct):
    """The gate and the injected ranking over one source's items: user turns and reply
    clauses fail differently, and one average hides which."""

    gate: GateReport
    ranking: RankingReport


def by_source(items: Sequence[Labeled], decisions: Sequence[Decision], first: Sequence[str | None],
              ranked: Sequence[Sequence[str]]) -> dict[str, SourceReport]:  # fmt: skip
    """`ranked`: the positives' rankings, in item order."""
    ranks = iter(ranked)
    rows = [(i, d, f, next(ranks) if i.positive else []) for i, d, f in zip(items, decisions, first)]
    out = {}
    for source in ("user", "llm"):
        mine = [r for r in rows if r[0].source == source]
        if mine:
            its, ds, fs, rs = zip(*mine)
            out[source] = SourceReport(gate_report(its, ds, fs), ranking_report(its, rs))
    return out


class GateBaseline(msgspec.Struct):
    """The simplest gate: one threshold on the best plain cosine to a description. Its best
    balanced accuracy is picked on the items themselves, so it flatters the baseline."""

    auroc: float
    best_balanced_accuracy: float


def description_vectors(pipe, progress: bool = False) -> np.ndarray:
    """(tools, dim): each tool's description embedded as a document with the same model, and
    nothing else (no cases, no name words): what plain cosine compares a text with. Whole
    descriptions, so the first time a catalog takes minutes (ALL.json's 605 with nomic: ~5 on
    these 2 cores): `progress` shows a bar on stderr while any are embedded (the store keeps them)."""
    from ..core.index import embed_cached

    descriptions = [(t.description or "").strip() or t.name for t in pipe.catalog]
    if not descriptions:
        return np.zeros((0, pipe.embedder.dim), np.float32)
    label = f"embedding {len(set(descriptions))} tool descriptions for the plain-cosine baseline" if progress else None
    docs, _ = embed_cached(pipe.embedder, pipe.store, list(dict.fromkeys(descriptions)), "document", progress=label)
    return np.vstack([docs[x] for x in descriptions])


def query_vectors(pipe, items: Sequence[Labeled], vectors: Sequence[np.ndarray | None] | None = None, progress: bool = False) -> np.ndarray:
    """(items, dim): each item's text embedded as a query by the pipeline's model. `vectors`:
    what judging the items made (`Scored.vectors`), so a text is embedded once for every
    figure. A text judged without one (a negative pattern blocked it, the screen settled it)
    was still ranked (`score` ranks every item), which left its vector in the pipeline's
    query cache: it is read from there, embedded only where the cache no longer has it."""
    from .. import progress as progress_mod

    known = {i.text: v for i, v in zip(items, vectors or ()) if v is not None}
    missing = [t for t in dict.fromkeys(i.text for i in items) if t not in known]
    if missing:
        with progress_mod.slow_step(f"embedding {len(missing)} texts judged without a vector, for the baselines", progress):
            known.update(zip(missing, pipe.queries.embed(pipe.embedder, missing).vectors))
    return np.vstack([known[i.text] for i in items]) if items else np.zeros((0, pipe.embedder.dim), np.float32)


def simple_gate_features(cosines: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """The learned baseline's inputs: the best plain cosine, its margin over the second, the
    mean of the best five, then the text's embedding."""
    top = -np.sort(-cosines, axis=1)[:, :5] if cosines.shape[1] else np.zeros((len(cosines), 1))
    second = top[:, 1] if top.shape[1] > 1 else top[:, 0]
    return np.hstack([np.stack([top[:, 0], top[:, 0] - second, top.mean(axis=1)], axis=1), vectors]).astype(np.float64)


SIMPLE_GATE_L2 = (10.0, 100.0, 1000.0)  # on the embedding's columns, chosen out of fold


def simple_gate(x: np.ndarray, y: np.ndarray, folds: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """The gate a careful user would try first: logistic regression on `simple_gate_features`
    (standardised, L2 1 on the three scores, on the embedding the value of SIMPLE_GATE_L2 with
    the best out-of-fold AUROC over `folds`). Returns its probability function."""
    from ..learn.learned import fit_logistic

    def fit(rows: np.ndarray, l2: float) -> Callable[[np.ndarray], np.ndarray]:
        mu, sd = x[rows].mean(axis=0), x[rows].std(axis=0) + 1e-6
        w, b = fit_logistic((x[rows] - mu) / sd, y[rows], np.where(np.arange(x.shape[1]) < 3, 1.0, l2))
        return lambda v: 1.0 / (1.0 + np.exp(-(((v - mu) / sd) @ w + b)))

    def oof(l2: float) -> float:
        p = np.zeros(len(y))
        for f in np.unique(folds):
            test = folds == f
            if (~test).any() and len(np.unique(y[~test])) == 2:
                p[test] = fit(~test, l2)(x[test])
        return auroc(p[y > 0], p[y == 0])

    best = max(SIMPLE_GATE_L2, key=oof)
    return fit(np.ones(len(y), bool), best)


def offers(items: Sequence[Labeled], catalog: Catalog) -> dict[Catalog | None, list[int]]:
    """Item positions by the tools they are judged against: None for the whole catalog, else
    the tools an item offers, in the catalog's order (BFCL judges each query against only its
    own functions)."""
    groups: dict[frozenset[str] | None, list[int]] = {}
    for k, item in enumerate(items):
        groups.setdefault(None if item.offered is None else frozenset(item.offered), []).append(k)
    return {None if names is None else Catalog([t for t in catalog if t.name in names]): at for names, at in groups.items()}


def each_offer(host, items: Sequence[Labeled]):
    """(`host` over the tools a group of items is judged against, the group's positions), per
    group: `host` itself for the whole catalog. `host`: a Sidecar."""
    for offered, at in offers(items, host.catalog).items():
        yield (host if offered is None else host.with_catalog(offered, persist=False)), at


def baselines(pipe, items: Sequence[Labeled], k: int = 10, vectors: Sequence[np.ndarray | None] | None = None,
              progress: bool = False) -> tuple[list[BaselineReport], GateBaseline, dict[int, list[str]]]:  # fmt: skip
    """The simplest rankings, same run, same items: plain cosine of the text against each
    tool's description with the same model, BM25 and TF-IDF over name, description and
    parameter names; each item against the tools it is judged against. `vectors`: the items'
    query vectors judging made (`query_vectors`); `progress`: bars on stderr for what takes time."""
    from .. import progress as progress_mod
    from ..core.lexical import LexicalIndex

    names = np.asarray([t.name for t in pipe.catalog])
    column = {n: j for j, n in enumerate(names)}
    sims = query_vectors(pipe, items, vectors, progress) @ description_vectors(pipe, progress).T
    best = np.full(len(items), -1.0)  # nothing to compare with: the lowest score
    cosine: dict[int, list[str]] = {}
    lexical: dict[str, dict[int, list[str]]] = {"bm25": {}, "tfidf": {}}
    groups = offers(items, pipe.catalog)
    shown = progress_mod.bar(len(items), "baselines: plain cosine, BM25 and TF-IDF", progress and len(groups) > 1)
    for offered, at in groups.items():
        shown.update(len(at))
        tools = pipe.catalog if offered is None else offered
        cols = np.asarray([column[t.name] for t in tools], int)
        if not len(cols):
            continue
        sub = sims[np.ix_(at, cols)]
        best[at] = sub.max(axis=1)
        asks = [(j, row) for j, row in zip(at, sub) if items[j].positive]
        cosine.update((j, list(names[cols[np.argsort(-row, kind="stable")[:k]]])) for j, row in asks)
        for kind, ranked in lexical.items():
            index = LexicalIndex(tools, kind)
            ranked.update((j, [n for n, _ in index.rank(items[j].text, k)]) for j, _ in asks)
    positives = [i for i in items if i.positive]
    in_order = lambda ranked: [ranked.get(j, []) for j, i in enumerate(items) if i.positive]  # noqa: E731
    pos = np.array([i.positive for i in items])
    cuts = np.unique(best)
    balanced = max((((best[pos] >= c).mean() if pos.any() else 0) + ((best[~pos] < c).mean() if (~pos).any() else 0)) / 2 for c in cuts)
    shown.close()
    gate = GateBaseline(auroc(best[pos], best[~pos]), float(balanced))
    out = [BaselineReport("cosine", ranking_report(positives, in_order(cosine)))]
    out += [BaselineReport(kind, ranking_report(positives, in_order(ranked))) for kind, ranked in lexical.items()]
    return out, gate, cosine


class Scored(msgspec.Struct):
    """What the sidecar made of each item: the gate's decision, the tool it injects (or would,
    had it fired) first, and for positives the ranker's and the recommender's rankings."""

    decisions: list[Decision]
    first: list[str | None]
    ranker: list[list[str]]  # positives only, in item order
    ranked: list[list[str]]  # positives only: what would be injected, best first
    injected: list[list[str]] = []  # every item: the tools `serve` would inject (none where the gate is silent)
    vectors: list = []  # every item: its text's query vector as judged (None: blocked by a pattern, or settled by the screen)


def score(engine: Sidecar, items: Sequence[Labeled], k: int = 10, bar=None, batch: int = 16) -> Scored:
    """Run every item through `Sidecar.judge`, as `serve` judges a user turn: the gate (with
    the cascade, where one is configured) over every item, the recommender's ranking
    (history-neutral unless the engine has a metrics store) over every positive, fired or not,
    and the fitted ranker's alone beside it. An item that offers tools is judged by the same
    engine over just those."""
    from ..core.pipeline import Request

    tick = bar.update if bar is not None else None
    decisions: list[Decision | None] = [None] * len(items)
    first: list[str | None] = [None] * len(items)
    ranker: dict[int, list[str]] = {}
    ranked: dict[int, list[str]] = {}
    injected: list[list[str]] = [[] for _ in items]
    vectors: list[np.ndarray | None] = [None] * len(items)
    margin, most = engine.cfg.server.inject_margin, engine.cfg.server.max_inject_tools
    for own, at in each_offer(engine, items):
        for lo in range(0, len(at), batch):
            chunk = at[lo : lo + batch]
            requests = [Request(items[j].text, items[j].source) for j in chunk]
            for j, request, judgement in zip(chunk, requests, own.judge(requests, top=k, rank_silent=True)):
                decisions[j], vectors[j] = judgement.decision, judgement.vector
                tools = [r.tool for r in judgement.ranked.results]
                first[j] = tools[0] if tools else None  # injected first, or would be had the gate fired
                injected[j] = [r.tool for r in judgement.inject(margin, most)]
                if items[j].positive:
                    ranked[j] = tools
                    ranker[j] = [c.tool for c in own.pipeline.rank_batch([request], k, judgement.vector)[0]]
            if tick:
                tick(len(chunk) + sum(items[j].positive for j in chunk))
    if bar is not None:
        bar.close()
    return Scored(decisions, first, [ranker[j] for j in sorted(ranker)], [ranked[j] for j in sorted(ranked)], injected, vectors)  # type: ignore[arg-type]


def report(engine: Sidecar, items: Sequence[Labeled], scored: Scored, k: int = 10, progress: bool = False) -> Report:
    """Gate figures over every item; ranking figures over the positives: what the sidecar
    injects first, the ranker alone, and the baselines of `baselines` (on the vectors judging
    made: each text is embedded once). `progress`: bars on stderr while baselines embed."""
    pipe = engine.pipeline
    positives = [i for i in items if i.positive]
    decisions = scored.decisions
    base, gate_base, cosine = baselines(pipe, items, k, scored.vectors, progress)
    with_calls = [j for j, i in enumerate(items) if i.calls]
    sets, set_base = None, {}
    if with_calls:
        called = [items[j].calls for j in with_calls]
        sets = set_report(called, [scored.injected[j] for j in with_calls])
        set_base = {"cosine top-k (k = tools called)": set_report(called, [cosine.get(j, [])[: len(set(c))] for j, c in zip(with_calls, called)]),
                    "cosine top-3": set_report(called, [cosine.get(j, [])[:3] for j in with_calls])}  # fmt: skip
    return Report(
        n=len(items),
        model=pipe.embedder.name + (" +task-prefixes" if pipe.embedder.prefixes else ""),
        strategy=f"user={pipe.strategies['user']} llm={pipe.strategies['llm']}",
        thresholds=msgspec.to_builtins(pipe.thresholds_in_force[0]),
        thresholds_origin=pipe.thresholds_in_force[1],
        gate=gate_report(items, decisions, scored.first),
        ranking=ranking_report(positives, scored.ranked),
        ranking_by=f"recommender ({engine.recommender.cfg.mode})",
        ranking_ranker=ranking_report(positives, scored.ranker),
        latency_ms=percentiles([d.timing_ms.total for d in decisions]),
        baselines=base,
        gate_baseline=gate_base,
        by_source=by_source(items, decisions, scored.first, scored.ranked),
        sets=sets,
        set_baselines=set_base,
    )


def evaluate(engine: Sidecar, items: Sequence[Labeled], k: int = 10, bar=None) -> Report:
    return report(engine, items, score(engine, items, k, bar), k)


# --- per item ---------------------------------------------------------------------------------

Verdict = Literal["right", "wrong_tool", "missed", "false_fire", "silent"]


class Outcome(msgspec.Struct, omit_defaults=True):
    """One item as the sidecar judged it: what `eval --items` writes, so a miss can be read
    rather than inferred from a rate."""

    text: str
    source: str
    verdict: Verdict  # right: fired with an expected tool first; wrong_tool: fired with another
    fired: bool
    probability: float | None  # the gate's score (None: a negative pattern blocked it)
    path: str
    expect: list[str] | None = None
    first: str | None = None  # the tool injected first, or that would have been had it fired
    rank: int | None = None  # of the best-placed expected tool in the injected ranking (None: not in it)
    top: list[str] = []  # the injected ranking's first three
    kind: str | None = None
    group: str | None = None
    id: str | int | None = None
    injected: list[str] = []  # what `serve` would inject (none where the gate is silent)
    calls: list[str] | None = None


def outcomes(items: Sequence[Labeled], scored: Scored) -> list[Outcome]:
    ranked = iter(scored.ranked)
    out = []
    for item, d, first, injected in zip(items, scored.decisions, scored.first, scored.injected):
        if item.positive:
            order = next(ranked)
            verdict = ("right" if first in item.expected else "wrong_tool") if d.fired else "missed"
            rank, expect, top = ranking.first_hit(order, item.expected), sorted(item.expected), order[:3]
        else:
            rank, verdict, expect, top = None, "false_fire" if d.fired else "silent", None, []
        out.append(Outcome(item.text, item.source, verdict, d.fired, d.score, d.path, expect, first, rank, top, item.kind, item.group, item.id,
                           injected, item.calls))  # fmt: skip
    return out


def describe(r: Report) -> str:
    g, k = r.gate, r.ranking
    lines = [
        f"{r.n} items ({g.positives} need a tool, {g.negatives} do not) · {r.model} · {r.strategy}",
        f"thresholds ({r.thresholds_origin}): " + ", ".join(f"{a}={v:.3f}" for a, v in r.thresholds.items() if a != "tools")
        + (f", own thresholds for {len(r.thresholds['tools'])} tool(s)" if r.thresholds.get("tools") else ""),
        f"gate     TP {g.tp_rate:.1%}  FP {g.fp_rate:.1%}  accuracy {g.accuracy:.1%}  balanced {g.balanced_accuracy:.1%}  "
        f"AUROC {g.auroc:.3f}  fired with the right tool {g.correct_rate:.1%}",
        f"ranking  top1 {k.top1:.1%}  top3 {k.top3:.1%}  MRR {k.mrr:.3f}  nDCG@10 {k.ndcg_at_10:.3f}  coverage {k.coverage:.1%}  ({r.ranking_by})",
        f"latency  p50 {r.latency_ms['p50']:.1f} ms  p99 {r.latency_ms['p99']:.1f} ms",
    ]
    if r.ranking_ranker is not None and r.ranking_by != "ranker":
        c = r.ranking_ranker
        lines.append(f"ranker   top1 {c.top1:.1%}  top3 {c.top3:.1%}  MRR {c.mrr:.3f}  nDCG@10 {c.ndcg_at_10:.3f}  coverage {c.coverage:.1%}")
    for source, b in r.by_source.items():
        lines.append(f"  {source:<5}  TP {b.gate.tp_rate:.1%}  FP {b.gate.fp_rate:.1%}  AUROC {b.gate.auroc:.3f}  "
                     f"top1 {b.ranking.top1:.1%}  MRR {b.ranking.mrr:.3f}  ({b.gate.positives} need a tool, {b.gate.negatives} do not)")
    if r.gate_baseline is not None:
        lines.append(f"cosine   gate AUROC {r.gate_baseline.auroc:.3f}  best balanced {r.gate_baseline.best_balanced_accuracy:.1%}  (baseline: one threshold on plain cosine)")
    if r.sets is not None:
        t = r.sets
        lines.append(f"sets     recall {t.recall:.1%}  precision {t.precision:.1%}  exact {t.exact:.1%}  "
                     f"({t.injected_per_item:.2f} injected, {t.called_per_item:.2f} called per item, {t.n} items with calls)")
        for name, b in r.set_baselines.items():
            lines.append(f"  {name}: recall {b.recall:.1%}  precision {b.precision:.1%}  exact {b.exact:.1%}  (baseline)")
    for b in r.baselines:
        c = b.ranking
        lines.append(f"{b.kind:<8} top1 {c.top1:.1%}  top3 {c.top3:.1%}  MRR {c.mrr:.3f}  nDCG@10 {c.ndcg_at_10:.3f}  coverage {c.coverage:.1%}  (baseline)")
    return "\n".join(lines)
