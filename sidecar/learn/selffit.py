"""A catalog fits its own part of the gate and the ranker from what it says about itself, when
it is indexed: no labelled data, numpy, seconds (issue 30).

The built-in calibration learned "what a request looks like" from the project's corpus, whose
catalogs carry no example `cases`: its ranker gives the classifier view no weight and its gate
head never saw a catalog of intents (Banking77 untuned: right intent first 76.8%, 49% of the
out-of-scope queries fired, gate AUROC 0.62). A catalog whose tools carry their own cases says
far more about itself than that, and this module reads it:

* **Its own gate.** The classifier's best probability separates a catalog's requests from the
  rest, if the bar is right. Both sides come from the cases alone: each case judged by a
  classifier fitted without it (out of fold: a request this catalog answers) and each case
  judged by a classifier fitted without its whole tool (leave tools out: a request that looks
  like the catalog's and that it does not answer). A logistic map of the best probability's
  logit fitted on those two sets is the gate's probability; the bar is where their balanced
  accuracy peaks, and `auto` where 97% of what fires is in scope. Chosen on the tuning splits of
  Banking77 and HWU64 (never their test splits): balanced accuracy 0.825 / 0.803 with nomic,
  against a bar at the cases' 5th percentile (0.675 / 0.597); adding the nearest-case cosine or
  the margin as features fitted the simulation better and the real queries worse.
* **Its own ranker weights**, fitted (`RankerFit`) on the cases' views with the classifier's
  out-of-fold logits and each case's nearest *other* case, so a view that only works on the
  texts it was fitted on gets no credit.

Cases *written* for a catalog (the shipped packs, a case writer: core/casebook.py) fit the
ranker only; the gate judges the catalog as shipped (`Pipeline.gate_views`). A gate read off
written cases was measured and lost: each held-out server's own tools
(`fixtures/corpus/heldout-own.jsonl`, nomic) fired on 39% of chat turns (AUROC 0.967 -> 0.665),
since cases written from a description say how a tool is asked, not what a turn that needs no
tool looks like. The ranker they fit put the right tool first 93.3% of the time, against 77.1%
on the descriptions (docs/benchmarks.md, "One server's tools").

Applies where the built-in calibration is in force (a calibration file or explicit thresholds
are the user's word and win) and the index fits a classifier; `[index] self_fit = false` turns it
off. Memoised per catalog content, like the classifier.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import orjson

from ..core.gate import Thresholds
from ..core.arguments import SymbolicIndex
from .learned import RANK_FEATURES, ClassifierFit, Ranker, RankerFit, adapt, classifier_view, fit_logistic, held_views, logit, rank_features

if TYPE_CHECKING:
    from ..core.index import ToolIndex
    from ..core.lexical import LexicalIndex
    from ..store.base import Store

SIMILARITY_VIEWS = ("cosine", "lexical", "cases", "classifier")  # the nearer, the likelier: never weighed below 0
FIT_VERSION = 2  # a change to how a fit is made: fits kept in a store before it are made again
AUTO_PRECISION = 0.97  # of simulated fires in scope, from which a fire is injected without asking


class CasesGate(msgspec.Struct, frozen=True):
    """The probability that a text is one of the catalog's requests: sigmoid(slope * logit(best
    classifier probability) + bias), with the catalog's own thresholds on it."""

    slope: float
    bias: float
    thresholds: Thresholds

    def probability(self, logits: np.ndarray) -> np.ndarray:
        """(n,) from the classifier's (n, tools) logits."""
        return 1.0 / (1.0 + np.exp(-(self.slope * logit(best_probability(logits)) + self.bias)))


class OwnFit(msgspec.Struct, frozen=True):
    """What a catalog fitted of itself: its ranker (the built-in adapter kept) and its gate."""

    ranker: Ranker
    gate: CasesGate | None  # None: cases written for it (packs, a writer), its gate stays the built-in head
    rows: int  # cases it was fitted on
    seconds: float


class SelfFit(msgspec.Struct, frozen=True):
    """Hyper-parameters of the self-fit, in one place."""

    folds: int = 5
    max_rows: int = 3000  # cases sampled for the folds: each fold refits the classifier
    max_tools: int = 500  # past it, no self-fit: ten fits of (rows, dim) x (dim, tools) weights stop taking seconds
    classifier: ClassifierFit = msgspec.field(default_factory=ClassifierFit)
    seed: int = 0

    def fit(self, index: ToolIndex, lexical: LexicalIndex, symbolic: SymbolicIndex, base: Ranker, gate: bool = True) -> OwnFit:
        """`gate=False`: the ranker alone (no leave-tools-out folds)."""
        t0 = time.perf_counter()
        rng = np.random.default_rng(self.seed)
        x, y, tools = index.matrix, index.row_tool, len(index.names)
        rows = np.sort(rng.choice(len(y), self.max_rows, replace=False)) if len(y) > self.max_rows else np.arange(len(y))
        x, y = x[rows], y[rows]
        inside, logits = self._out_of_fold(x, y, tools, rng)
        own_gate = _gate(inside, self._leave_tools_out(x, y, tools, rng)) if gate else None
        ranker = self._ranker(index, lexical, symbolic, base, rows, logits)
        return OwnFit(ranker, own_gate, len(rows), time.perf_counter() - t0)

    def _out_of_fold(self, x: np.ndarray, y: np.ndarray, tools: int, rng) -> tuple[np.ndarray, np.ndarray]:
        """Each case's best probability, and its logits, from a classifier fitted without it."""
        folds = rng.integers(0, self.folds, len(y))
        logits = np.zeros((len(y), tools), np.float32)
        for f in range(self.folds):
            test = folds == f
            if test.any() and (~test).any():
                logits[test] = self.classifier.fit(x[~test], y[~test], tools).logits(x[test])
        return best_probability(logits), logits

    def _leave_tools_out(self, x: np.ndarray, y: np.ndarray, tools: int, rng) -> np.ndarray:
        """Each case's best probability from a classifier fitted on the other tools only: a
        request in the catalog's style that the catalog does not answer."""
        fold_of = rng.permutation(tools) % self.folds
        out = np.zeros(len(y))
        for f in range(self.folds):
            keep = np.flatnonzero(fold_of != f)
            held = np.isin(y, np.flatnonzero(fold_of == f))
            if len(keep) < 2 or not held.any():
                continue
            column = np.full(tools, -1)
            column[keep] = np.arange(len(keep))
            clf = self.classifier.fit(x[~held], column[y[~held]], len(keep))
            out[held] = best_probability(clf.logits(x[held]))
        return out

    def _ranker(self, index: ToolIndex, lexical: LexicalIndex, symbolic: SymbolicIndex, base: Ranker, rows: np.ndarray, logits: np.ndarray) -> Ranker:
        """View weights fitted on the sampled cases: cosine, BM25, nearest other case of each
        tool, the classifier's out-of-fold log-probabilities and the action views; the built-in
        adapter kept."""
        q = adapt(index.matrix[rows], base.adapter.matrix() if base.adapter is not None else None)
        cosine = q @ index.primary.T
        cases = np.zeros_like(cosine)
        for lo in range(0, len(rows), 256):  # (256, all rows) at a time: a big catalog has tens of thousands
            sims = q[lo : lo + 256] @ index.matrix.T
            sims[np.arange(len(sims)), rows[lo : lo + 256]] = -1.0  # a case is not its own nearest case
            cases[lo : lo + 256] = np.maximum.reduceat(sims, index.starts, axis=1)
        bm25 = np.vstack([lexical.scores(index.texts[r]) for r in rows])
        features = rank_features(cosine, bm25, cases, logits, symbolic.views([index.texts[r] for r in rows]), symbolic.servers)
        # The HELD_VIEWS keep the built-in weights (`held_views`): on a tool's own cases the
        # word and server views look surer than on requests.
        held = held_views(base, features.shape[-1])
        targets = [[int(t)] for t in index.row_tool[rows]]
        weights = RankerFit().weights(features, targets, fixed=held)
        # A similarity view weighed below 0 would rank a tool lower the nearer a text is to it
        # (and a lesson from traffic, which adds to the cases view, would push its tool down):
        # held at 0 and the rest fitted again.
        negative = [j for j, v in enumerate(RANK_FEATURES) if v in SIMILARITY_VIEWS and weights[j] < 0]
        if negative:
            held = [0.0 if j in negative else h for j, h in enumerate(held)]
            weights = RankerFit().weights(features, targets, fixed=held)
        return Ranker(weights, base.adapter)


def best_probability(logits: np.ndarray) -> np.ndarray:
    """The classifier's highest softmax probability per text."""
    return np.exp(classifier_view(logits, logits.shape).max(axis=1)) if logits.shape[1] else np.zeros(len(logits))


def _gate(inside: np.ndarray, outside: np.ndarray) -> CasesGate:
    """The logistic map fitted on in-scope (1) and simulated out-of-scope (0) rows, its bar at
    their best balanced accuracy, `auto` where AUTO_PRECISION of the rows fired are in scope."""
    z = np.concatenate([logit(inside), logit(outside)])
    y = np.concatenate([np.ones(len(inside)), np.zeros(len(outside))])
    mu, sd = float(z.mean()), float(z.std()) + 1e-9
    w, b = fit_logistic(((z - mu) / sd)[:, None], y, np.ones(1))
    slope, bias = float(w[0]) / sd, float(b) - float(w[0]) * mu / sd
    p_in = 1.0 / (1.0 + np.exp(-(slope * logit(inside) + bias)))
    p_out = 1.0 / (1.0 + np.exp(-(slope * logit(outside) + bias)))
    cuts = np.unique(np.round(np.concatenate([p_in, p_out]), 4))
    balanced = [((p_in >= c).mean() + (p_out < c).mean()) / 2 for c in cuts]
    bar = float(cuts[int(np.argmax(balanced))])
    auto = next((float(c) for c in cuts if c >= bar and _precision(p_in, p_out, c) >= AUTO_PRECISION), 1.0)
    return CasesGate(slope, bias, Thresholds(high=bar, fallback=bar, auto=max(auto, bar), confirm=bar))


def _precision(p_in: np.ndarray, p_out: np.ndarray, cut: float) -> float:
    fired_in, fired_out = int((p_in >= cut).sum()), int((p_out >= cut).sum())
    return fired_in / (fired_in + fired_out) if fired_in + fired_out else math.nan


_fits: dict[tuple, OwnFit] = {}  # the last few, by model and catalog content (a reindex of an unchanged catalog refits nothing)

SCHEMA = """
CREATE TABLE IF NOT EXISTS self_fits (
    key TEXT PRIMARY KEY,
    body BLOB NOT NULL,
    created REAL NOT NULL
);
"""


class _Kept(msgspec.Struct, frozen=True):
    """An OwnFit as the store keeps it: the ranker's weights alone (its adapter is the base's)."""

    weights: tuple[float, ...]
    gate: CasesGate | None
    rows: int
    seconds: float


def own_fit(index: ToolIndex, lexical: LexicalIndex, symbolic: SymbolicIndex, base: Ranker, model: str, names: Sequence[str],
            fit: SelfFit = SelfFit(), store: Store | None = None, gate: bool = True) -> OwnFit | None:  # fmt: skip
    """`fit.fit`, memoised by model, index content, base ranker and hyper-parameters, here and
    in `store` (a restart on an unchanged catalog refits nothing: the fit is seconds of the
    start); None for a catalog of more than `fit.max_tools` tools (it keeps the built-in
    calibration). `gate=False` fits the ranker alone: for cases written for the catalog rather
    than shipped with it (see the module's note)."""
    if len(names) > fit.max_tools:
        return None
    key = (model, str(index.strategy), tuple(index.entries[n].hash for n in names), base.weights, base.adapter is not None, gate)
    if key in _fits:
        return _fits[key]
    digest = hashlib.sha256(orjson.dumps([FIT_VERSION, list(map(str, key)), msgspec.json.encode(fit).decode(), _adapter_digest(base)])).hexdigest()
    own = _read(store, digest, base)
    if own is None:
        own = fit.fit(index, lexical, symbolic, base, gate)
        _write(store, digest, own)
    while len(_fits) >= 4:
        _fits.pop(next(iter(_fits)))
    _fits[key] = own
    return own


def _adapter_digest(base: Ranker) -> str:
    return "" if base.adapter is None else hashlib.sha256(msgspec.msgpack.encode(base.adapter)).hexdigest()


def _read(store: Store | None, digest: str, base: Ranker) -> OwnFit | None:
    if store is None:
        return None
    store.ensure_schema(SCHEMA)
    rows = store.query("SELECT body FROM self_fits WHERE key = ?", (digest,))
    if not rows:
        return None
    try:
        kept = msgspec.json.decode(bytes(rows[0][0]), type=_Kept)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None  # written by another version: fitted again
    return OwnFit(Ranker(kept.weights, base.adapter), kept.gate, kept.rows, kept.seconds)


def _write(store: Store | None, digest: str, own: OwnFit) -> None:
    if store is None:
        return
    body = msgspec.json.encode(_Kept(own.ranker.weights, own.gate, own.rows, own.seconds))
    store.write(lambda tx: tx.execute(
        "INSERT INTO self_fits (key, body, created) VALUES (?, ?, ?) ON CONFLICT (key) DO UPDATE SET body = excluded.body, created = excluded.created",
        (digest, body, time.time())))  # fmt: skip
