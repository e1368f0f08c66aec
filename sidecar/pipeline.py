"""The one flow: text -> patterns -> embedding -> ranker (three views of every tool, blended)
-> gate head (the probability that the text needs a tool) -> gate decision.

The CLI, the server and replay all call `Pipeline.detect_batch`; batching lets the
server embed the spans of many streams in one llama.cpp call.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Sequence

import msgspec
import numpy as np

from . import calibration as calib
from . import catalog as catalog_mod
from . import models
from . import patterns as patterns_mod
from .cases import Strategy
from .catalog import Catalog
from .config import Config
from .embed import Embedder
from .gate import Candidate, Decision, Thresholds, Timing, judge, screen
from .index import ToolIndex
from .learned import GateHead, Ranker, gate_features, nearest, rank_features
from .lexical import LexicalIndex
from .patterns import GatePatterns
from .store import Store, default_path

SOURCES = ("user", "llm")


class Request(msgspec.Struct, frozen=True):
    text: str
    source: str = "user"


class Judged(msgspec.Struct):
    """`judge_batch`'s answer: the decisions, and each request's query vector (None when a
    negative pattern blocked it unembedded), so a recommender need not embed it again."""

    decisions: list[Decision]
    vectors: list[np.ndarray | None]


class Pipeline:
    def __init__(
        self,
        embedder: Embedder,
        catalog: Catalog,
        patterns: GatePatterns,
        thresholds: Thresholds,
        strategies: dict[str, Strategy],
        store: Store | None = None,
        top_k: int = 5,
        thresholds_origin: str = "builtin",
        ranker: Ranker | None = None,
        head: GateHead | None = None,
    ):
        self.embedder = embedder
        self.patterns = patterns
        self.thresholds = thresholds
        self.thresholds_origin = thresholds_origin
        self.strategies = strategies
        self.store = store
        self.top_k = top_k
        self.catalog = catalog
        self.ranker = ranker or Ranker()
        self.head = head  # the gate as a probability; None: thresholds compare raw scores
        self.indexes: dict[str, ToolIndex] = {}
        self.reindex(catalog)

    def reindex(self, catalog: Catalog) -> dict[str, ToolIndex]:
        """(Re)build one index per distinct strategy, embedding only what changed."""
        built: dict[str, ToolIndex] = {}
        for strategy in dict.fromkeys(self.strategies.values()):
            key = str(strategy)
            built[key] = ToolIndex.build(catalog, self.embedder, strategy, self.store, self.indexes.get(key))
        self.indexes, self.catalog = built, catalog
        self.lexical = LexicalIndex(catalog, "bm25")
        return built

    def index_for(self, source: str) -> ToolIndex:
        return self.indexes[str(self.strategies[source])]

    def rank_batch(self, requests: Sequence[Request], k: int = 10, vector: np.ndarray | None = None) -> list[list[Candidate]]:
        """The ranking alone, gate aside: what a tool search on demand returns. `vector`: a
        single request's embedding when the caller already has it."""
        if vector is not None and len(requests) == 1:
            vectors = np.asarray(vector, np.float32)[None, :]
        else:
            vectors = self.embedder.embed([r.text for r in requests], "query").vectors
        return [self._top(v.scores[0], v.index, q, k) for v, q in zip(self.views(requests, vectors), vectors)]

    def views(self, requests: Sequence[Request], vectors: np.ndarray) -> list[Views]:
        """Every tool's per-view scores and the ranker's blend, per request (each against
        the index of its source's strategy)."""
        out: list[Views | None] = [None] * len(requests)
        bm25 = np.vstack([self.lexical.scores(r.text) for r in requests]) if requests else np.zeros((0, len(self.catalog)))
        for source in SOURCES:
            rows = [i for i, r in enumerate(requests) if r.source == source]
            if not rows:
                continue
            index = self.index_for(source)
            cosine, cases = index.views(vectors[rows])
            lex = bm25[rows]  # an index keeps catalog order, as the lexical index does
            scores = self.ranker.score(rank_features(cosine, lex, cases))
            for j, i in enumerate(rows):
                out[i] = Views(index, scores[j : j + 1], cosine[j : j + 1], cases[j : j + 1], lex[j : j + 1])
        return out  # type: ignore[return-value]

    @staticmethod
    def _top(scores: np.ndarray, index: ToolIndex, vector: np.ndarray, k: int) -> list[Candidate]:
        """The k best tools, each with its case row closest to the text."""
        k = min(k, len(scores))
        if k == 0:
            return []
        top = np.argpartition(-scores, k - 1)[:k] if k < len(scores) else np.arange(len(scores))
        return [Candidate(index.names[t], round(float(scores[t]), 4), index.closest_case(t, vector))
                for t in top[np.argsort(-scores[top], kind="stable")]]  # fmt: skip

    def detect(self, text: str, source: str = "user") -> Decision:
        return self.detect_batch([Request(text, source)])[0]

    def detect_batch(self, requests: Sequence[Request]) -> list[Decision]:
        return self.judge_batch(requests).decisions

    def judge_batch(self, requests: Sequence[Request]) -> Judged:
        if not requests:
            return Judged([], [])
        t0 = time.perf_counter()
        screens = []
        for r in requests:
            if r.source not in SOURCES:
                raise ValueError(f"source must be one of {SOURCES}, not {r.source!r}")
            screens.append(screen(r.text, r.source, self.patterns))
        t_regex = time.perf_counter()
        todo = [i for i, s in enumerate(screens) if not s.blocked]
        embedded = self.embedder.embed([requests[i].text for i in todo], "query")
        t_embed = time.perf_counter()
        live = [requests[i] for i in todo]
        views = self.views(live, embedded.vectors)
        candidates = {i: self._top(v.scores[0], v.index, q, self.top_k) for i, v, q in zip(todo, views, embedded.vectors)}
        confidence = dict(zip(todo, self.confidence(live, embedded.vectors, views, [screens[i] for i in todo])))
        t_cos = time.perf_counter()
        n = len(requests)
        share = Timing(
            regex=(t_regex - t0) * 1000 / n,
            embed=(t_embed - t_regex) * 1000 / max(len(todo), 1) if todo else 0.0,
            cosine=(t_cos - t_embed) * 1000 / max(len(todo), 1) if todo else 0.0,
        )
        out = []
        truncated = dict(zip(todo, embedded.truncated))
        for i, (r, s) in enumerate(zip(requests, screens)):
            timing = Timing(share.regex, share.embed if i in candidates else 0.0, share.cosine if i in candidates else 0.0)
            timing.total = timing.regex + timing.embed + timing.cosine
            d = judge(r.text, r.source, s, candidates.get(i, []), self.thresholds, timing, confidence.get(i))
            d.truncated = truncated.get(i, False)
            out.append(d)
        rows = dict(zip(todo, embedded.vectors))
        return Judged(out, [rows.get(i) for i in range(n)])

    def confidence(self, requests: Sequence[Request], vectors: np.ndarray, views: Sequence[Views], screens) -> list[float | None]:
        """The gate head's probability that each text needs a tool (None without a head)."""
        if self.head is None or not requests:
            return [None] * len(requests)
        return self.head.probability(self.gate_inputs(requests, vectors, views, screens, self._exemplars)).tolist()

    @property
    def head(self) -> GateHead | None:
        return self._head

    @head.setter
    def head(self, head: GateHead | None) -> None:
        self._head = head
        self._exemplars = head.exemplars.arrays() if head is not None else None  # decoded once

    def gate_inputs(self, requests: Sequence[Request], vectors: np.ndarray, views: Sequence[Views], screens,
                    exemplars: tuple[np.ndarray, np.ndarray] | None, exclude_self: bool = False) -> np.ndarray:  # fmt: skip
        """The gate head's features (learned.GATE_SCALARS, then the embedding). `exclude_self`:
        a text that is one of the exemplars is not its own nearest neighbour (fitting)."""
        tool_ex, none_ex = exemplars if exemplars is not None else (np.zeros((0, vectors.shape[1]), np.float32),) * 2
        return gate_features(
            np.vstack([v.scores for v in views]),
            np.vstack([v.cosine for v in views]),
            np.vstack([v.cases for v in views]),
            np.vstack([v.bm25 for v in views]),
            np.array([r.source == "llm" for r in requests], float),
            np.array([s.path.startswith("high:") for s in screens], float),
            vectors,
            nearest(vectors, tool_ex, exclude_self),
            nearest(vectors, none_ex, exclude_self),
        )


class Views(msgspec.Struct):
    """One text against one index: the ranker's blend and the raw views it blends, (1, tools)."""

    index: ToolIndex
    scores: np.ndarray
    cosine: np.ndarray
    cases: np.ndarray
    bm25: np.ndarray


def open_embedder(cfg: Config, store: Store | None, progress: bool = True, calibration: calib.Calibration | None = None) -> Embedder:
    """Resolve (and provision, if allowed) the configured model and load it. Task prefixes:
    the config's on/off, else what a calibration measured, else the model's measured default."""
    dest = pathlib.Path(cfg.model.dir) if cfg.model.dir else None
    resolved = models.resolve(cfg.model.name, dest=dest, auto_pull=cfg.model.pull, progress=progress)
    spec = resolved.spec
    if spec is not None and spec.sha256:
        identity = spec.sha256
    elif store is not None:
        identity = store.file_sha256(resolved.path)
    else:
        identity = models.file_sha256(resolved.path)
    prefixes = spec.task_prefixes if spec else None
    use = cfg.model.task_prefixes
    if use == "auto":
        cal, _ = calib.in_force(resolved.name, calibration)
        on = cal.task_prefixes if cal is not None and cal.task_prefixes is not None else True
        use = "on" if on else "off"
    if use == "off":
        prefixes = None
    return Embedder(
        resolved.path,
        name=resolved.name,
        identity=identity,
        threads=cfg.model.threads,
        prefixes=prefixes,
        max_tokens=spec.n_ctx if spec else None,
    )


def from_config(cfg: Config, *, catalog: Catalog | None = None, progress: bool = True, store: Store | None = None,
                calibration: bool = True) -> Pipeline:  # fmt: skip
    """Everything the config names, loaded and validated, as a ready pipeline. With
    `calibration=False` (what `tune` fits from) no calibration applies: cosine thresholds, the
    default ranker, no gate head, plain derived cases."""
    cal_file = calib.read(cfg.calibration) if cfg.calibration and calibration else None
    pats = patterns_mod.load_dir(cfg.gate.patterns or patterns_mod.PATTERNS_DIR, cfg.gate.regex_timeout_ms / 1000)
    cat = catalog if catalog is not None else catalog_mod.load(cfg.catalogs)
    if store is None:
        store = Store(cfg.store or default_path())
    embedder = open_embedder(cfg, store, progress, cal_file)
    if calibration:
        thresholds, origin = calib.thresholds_for(embedder.name, cfg.gate, cal_file)
        cal, _ = calib.in_force(embedder.name, cal_file)
    else:
        thresholds, origin, cal = Thresholds(), "uncalibrated", None
    strategies = {
        "user": Strategy.parse(cfg.index.user_strategy or (cal and cal.user_strategy) or calib.DEFAULT_USER_STRATEGY),
        "llm": Strategy.parse(cfg.index.llm_strategy or (cal and cal.llm_strategy) or calib.DEFAULT_LLM_STRATEGY),
    }
    ranker, head = (cal.ranker, cal.head) if cal is not None else (None, None)
    return Pipeline(embedder, cat, pats, thresholds, strategies, store, cfg.index.top_k, origin, ranker, head)
