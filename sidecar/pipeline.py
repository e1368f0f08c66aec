"""The one flow: text -> patterns -> embedding -> cosine top-k -> gate decision.

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
    ):
        self.embedder = embedder
        self.patterns = patterns
        self.thresholds = thresholds
        self.thresholds_origin = thresholds_origin
        self.strategies = strategies
        self.store = store
        self.top_k = top_k
        self.catalog = catalog
        self.indexes: dict[str, ToolIndex] = {}
        self.reindex(catalog)

    def reindex(self, catalog: Catalog) -> dict[str, ToolIndex]:
        """(Re)build one index per distinct strategy, embedding only what changed."""
        built: dict[str, ToolIndex] = {}
        for strategy in dict.fromkeys(self.strategies.values()):
            key = str(strategy)
            built[key] = ToolIndex.build(catalog, self.embedder, strategy, self.store, self.indexes.get(key))
        self.indexes, self.catalog = built, catalog
        return built

    def index_for(self, source: str) -> ToolIndex:
        return self.indexes[str(self.strategies[source])]

    def rank_batch(self, requests: Sequence[Request], k: int = 10) -> list[list[Candidate]]:
        """The semantic ranking alone, gate aside: what a tool search on demand returns."""
        vectors = self.embedder.embed([r.text for r in requests], "query").vectors
        return self._search(vectors, [r.source for r in requests], k)

    def _search(self, vectors, sources: Sequence[str], k: int) -> list[list[Candidate]]:
        """Top-k per vector, each against the index of its source's strategy."""
        out: list[list[Candidate]] = [[] for _ in sources]
        for source in SOURCES:
            rows = [i for i, s in enumerate(sources) if s == source]
            if rows:
                for i, c in zip(rows, self.index_for(source).search(vectors[rows], k)):
                    out[i] = c
        return out

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
        found = self._search(embedded.vectors, [requests[i].source for i in todo], self.top_k)
        candidates = dict(zip(todo, found))
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
            d = judge(r.text, r.source, s, candidates.get(i, []), self.thresholds, timing)
            d.truncated = truncated.get(i, False)
            out.append(d)
        rows = dict(zip(todo, embedded.vectors))
        return Judged(out, [rows.get(i) for i in range(n)])


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


def from_config(cfg: Config, *, catalog: Catalog | None = None, progress: bool = True, store: Store | None = None) -> Pipeline:
    """Everything the config names, loaded and validated, as a ready pipeline."""
    calibration = calib.read(cfg.calibration) if cfg.calibration else None
    pats = patterns_mod.load_dir(cfg.gate.patterns or patterns_mod.PATTERNS_DIR, cfg.gate.regex_timeout_ms / 1000)
    cat = catalog if catalog is not None else catalog_mod.load(cfg.catalogs)
    if store is None:
        store = Store(cfg.store or default_path())
    embedder = open_embedder(cfg, store, progress, calibration)
    thresholds, origin = calib.thresholds_for(embedder.name, cfg.gate, calibration)
    cal, _ = calib.in_force(embedder.name, calibration)
    strategies = {
        "user": Strategy.parse(cfg.index.user_strategy or (cal and cal.user_strategy) or calib.DEFAULT_USER_STRATEGY),
        "llm": Strategy.parse(cfg.index.llm_strategy or (cal and cal.llm_strategy) or calib.DEFAULT_LLM_STRATEGY),
    }
    return Pipeline(embedder, cat, pats, thresholds, strategies, store, cfg.index.top_k, origin)
