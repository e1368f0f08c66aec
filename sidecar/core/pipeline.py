"""The one flow: text -> patterns -> embedding -> ranker (five or six views of every tool, blended)
-> gate head (the probability that the text needs a tool) -> gate decision.

The CLI, the server and replay all reach it through `Sidecar.judge`; batching lets the
server embed the spans of many streams in one llama.cpp call, and `QueryCache` keeps texts
seen before from being embedded again.
"""

from __future__ import annotations

import contextlib
import copy
import math
import pathlib
import threading
import time
from collections.abc import Sequence

import cachetools
import msgspec
import numpy as np

from . import calibration as calib
from . import catalog as catalog_mod
from . import models
from . import patterns as patterns_mod
from .. import progress as progress_mod
from .arguments import SymbolicIndex
from .casebook import CaseBook, book_for
from .cases import Strategy
from .catalog import Catalog, Tool
from ..config import Config
from .embed import Embedded, Embedder
from .gate import Candidate, Decision, Request, Route, Thresholds, Timing, decide, route
from .index import MIN_OWN_CASES, ToolIndex, one_blas_thread, stored_tools
from ..learn.learned import GATE_SCALARS, RANK_FEATURES, Examples, GateHead, Known, Ranker, adapt, classifier_view, gate_features, logit, neighbourhood, rank_features
from .lexical import LexicalIndex
from .patterns import GatePatterns, Unsettled
from ..learn.selffit import OwnFit, own_fit
from ..store import Store, open_store
from ..learn.traffic import Learned

SOURCES = ("user", "llm")
COLD_AT_ONCE = 32  # tools a start may embed before serving (a few seconds); past it, serve and proxy start on the stored ones


class Detected(msgspec.Struct):
    """`detect_batch`'s answer: the decisions, each request's query vector (None when a
    negative pattern blocked it unembedded) and the views of every tool it was ranked on, so
    a recommender need neither embed it nor score the catalog again."""

    decisions: list[Decision]
    vectors: list[np.ndarray | None]
    views: list[Views | None] = []  # empty: none kept


class QueryCache:
    """Query embeddings of texts seen before, least recently used first out, at most `size`
    (0: off): a user turn sent again, a clause every stream repeats ("Sure, I can help with
    that.") or a span judged again after a reconnect is not embedded twice. Keyed by the text
    alone: a query's vector depends on neither its source nor the catalog, so the pipelines
    `with_catalog` derives (same model) share one cache. Counts what it saved (/metrics)."""

    def __init__(self, size: int):
        self.size = size
        self._lru: cachetools.LRUCache[str, tuple[np.ndarray, bool]] = cachetools.LRUCache(max(size, 1))
        self._lock = threading.Lock()  # the model thread and tool searches on other threads
        self._model: str | None = None  # the identity of the model the vectors came from
        self.hits = 0  # texts answered from the cache (embeddings skipped)
        self.misses = 0  # texts embedded

    def __len__(self) -> int:
        return len(self._lru) if self.size else 0

    def keep(self, embedder: Embedder, texts: Sequence[str], vectors: np.ndarray) -> None:
        """Hold `embedder`'s vectors of `texts`, embedded elsewhere (`tune` embeds its whole set
        at once), for the texts judged next; not counted as hits or misses, and their truncation
        is not known (False)."""
        if not self.size:
            return
        with self._lock:
            if self._model != embedder.identity:
                self._lru.clear()
                self._model = embedder.identity
            for t, v in zip(texts, vectors):
                self._lru[t] = (np.array(v, np.float32), False)

    def embed(self, embedder: Embedder, texts: Sequence[str]) -> Embedded:
        """`embedder.embed(texts, "query")`, embedding only texts neither cached nor repeated
        earlier in `texts`; rows are copies, so a cached vector never pins a whole batch."""
        if not self.size:
            with self._lock:
                self.misses += len(texts)
            return embedder.embed(list(texts), "query")
        distinct = list(dict.fromkeys(texts))
        with self._lock:
            if self._model != embedder.identity:  # another model's vectors mean nothing here
                self._lru.clear()
                self._model = embedder.identity
            found = {t: hit for t in distinct if (hit := self._lru.get(t)) is not None}
        todo = [t for t in distinct if t not in found]
        if todo:
            fresh = embedder.embed(todo, "query")
            with self._lock:
                for t, v, cut in zip(todo, fresh.vectors, fresh.truncated):
                    found[t] = self._lru[t] = (v.copy(), cut)
        with self._lock:
            self.hits += len(texts) - len(todo)
            self.misses += len(todo)
        vectors = np.vstack([found[t][0] for t in texts]) if texts else np.zeros((0, embedder.dim), np.float32)
        return Embedded(vectors.astype(np.float32, copy=False), [found[t][1] for t in texts])


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
        query_cache: int = 0,
        examples: Examples | None = None,
        progress: bool = False,
        self_fit: bool = False,
        casebook: CaseBook | None = None,
        whole: Catalog | None = None,
        replies_commit: bool = False,
    ):
        self.embedder = embedder
        self.replies_commit = replies_commit  # the model's text fires only on a commitment (gate.route)
        self.queries = QueryCache(query_cache)
        self.patterns = patterns
        self.thresholds = thresholds
        self.thresholds_origin = thresholds_origin
        self.strategies = strategies
        self.store = store
        self.top_k = top_k
        self.catalog = catalog
        self.ranker = ranker or Ranker()
        self.head = head  # the gate as a probability; None: thresholds compare raw scores
        self.examples = examples  # labelled requests a classifier over own cases learns from too
        self.self_fit = self_fit  # a catalog with own cases fits its own ranker and gate (sidecar/learn/selffit.py)
        self.own: dict[str, OwnFit] = {}  # by index strategy
        self.casebook = casebook  # written cases for tools whose catalog ships none (core/casebook.py)
        self.learned: Learned | None = None  # what user turns taught (sidecar/learn/traffic.py): applied to user texts
        self.indexes: dict[str, ToolIndex] = {}
        # Tools whose cases were written for them (by name: the tool as its catalog shipped it),
        # and one index per strategy of the catalog as shipped, that the gate judges by.
        self.written: dict[str, Tool] = {}
        self.described: dict[str, ToolIndex] = {}
        # The catalog to serve; `catalog` is the part indexed: all of it, but while serve and
        # proxy add the tools a start found no vectors for (serve/completion.py)
        self.whole = whole if whole is not None else catalog
        self.reindex(catalog, progress=progress, partial=len(self.whole) != len(catalog))

    def reindex(self, catalog: Catalog, persist: bool = True, progress: bool = False, partial: bool = False) -> dict[str, ToolIndex]:
        """(Re)build one index per distinct strategy, embedding only what changed (and, with
        `persist`, keeping it in the store). `progress`: bars on stderr while it embeds. Tools
        with too few cases of their own get the case book's first. `partial`: `catalog` is a
        part of `whole` indexed so far (serve/completion.py): no self-fit until the whole is in."""
        if not partial:
            self.whole = catalog
        if self.casebook is not None:
            filled = self.casebook.fill(catalog, MIN_OWN_CASES)
            self.written = {t.name: t for t in catalog if filled.get(t.name) is not t}
            catalog = filled
        else:  # a catalog built of this one's tools (a client's, an offered subset) keeps what was written
            self.written = {n: t for n, t in self.written.items() if catalog.get(n) is not None}
        written = bool(self.written)
        built: dict[str, ToolIndex] = {}
        described: dict[str, ToolIndex] = {}
        # The index reads each description without what many of the whole catalog's say
        # (Catalog.shared); what is served keeps it.
        shared = self.whole.shared
        indexed = catalog_mod.distinct(catalog, shared)
        shipped = catalog_mod.distinct(Catalog([self.written.get(t.name, t) for t in catalog], catalog.sources), shared) if written else None
        for strategy in dict.fromkeys(self.strategies.values()):
            key = str(strategy)
            built[key] = ToolIndex.build(indexed, self.embedder, strategy, self.store, self.indexes.get(key), persist, self.examples,
                                         progress)  # fmt: skip
            if shipped is not None:  # as a start on the descriptions indexed them: in the store after one
                previous = self.described.get(key) or self.indexes.get(key)
                described[key] = ToolIndex.build(shipped, self.embedder, strategy, self.store, previous, persist, self.examples, progress)
        self.indexes, self.described, self.catalog = built, described, catalog
        self.lexical = LexicalIndex.bm25_of(indexed, self.store if persist else None)  # a restart reads it back
        self.symbolic = SymbolicIndex(list(indexed))
        self.own = {}
        for key, index in built.items():
            if self.self_fit and index.classifier is not None and not partial:
                with progress_mod.slow_step(f"fitting the catalog's own {'ranker' if written else 'gate and ranker'} on {len(index.texts)} cases", progress):
                    own = own_fit(index, self.lexical, self.symbolic, self.ranker, self.embedder.identity, index.names, store=self.store,
                                 gate=not written)  # fmt: skip
                if own is not None:
                    self.own[key] = own
        return built

    @property
    def pending(self) -> list[Tool]:
        """The tools of `whole` not indexed yet."""
        return [t for t in self.whole if self.catalog.get(t.name) is None]

    def own_for(self, source: str) -> OwnFit | None:
        """What the catalog fitted of itself in the index `source` texts are judged against."""
        return self.own.get(str(self.strategies[source]))

    @property
    def thresholds_without_lesson(self) -> tuple[Thresholds, str]:
        """The thresholds a user turn is held to before any lesson from traffic, and where they
        came from: the catalog's own gate where it fitted one, else the calibration's."""
        own = self.own_for("user")
        if own is not None and own.gate is not None:
            return own.gate.thresholds, self.thresholds_origin + "+self-fit"
        return self.thresholds, self.thresholds_origin

    @property
    def thresholds_in_force(self) -> tuple[Thresholds, str]:
        """The thresholds a user turn is held to, and where they came from: those without a
        lesson (`thresholds_without_lesson`), with a bar learned from traffic where one is."""
        t, origin = self.thresholds_without_lesson
        if self.learned is not None and self.learned.bar is not None:
            return self.learned.thresholds(t), origin + "+traffic"
        return t, origin

    def _thresholds(self, source: str) -> Thresholds:
        if source == "user":
            return self.thresholds_in_force[0]
        own = self.own_for(source)
        return own.gate.thresholds if own and own.gate else self.thresholds

    def with_catalog(self, catalog: Catalog, persist: bool = True, beside: bool = False, partial: bool = False) -> Pipeline:
        """The same pipeline over another catalog (model, patterns, thresholds, ranker, gate head
        and store shared): its indexes reuse this one's unchanged tools and the store's
        embedding cache, so only new tool texts are embedded. This pipeline is untouched.
        `beside`: the new texts are embedded on the model's second context (`Embedder.beside`),
        so a catalog built on another thread holds up no judging on the model thread. Without
        `persist` (a client's own tools, e.g. a session's hello) no written cases are added:
        their vectors would be embedded again on every such catalog, a dozen a tool."""
        clone = copy.copy(self)
        if not persist:
            clone.casebook = None
        with self.embedder.beside() if beside else contextlib.nullcontext():
            clone.reindex(catalog, persist, partial=partial)  # rebinds the clone's indexes and catalog
        return clone

    def index_for(self, source: str) -> ToolIndex:
        return self.indexes[str(self.strategies[source])]

    def rank_batch(self, requests: Sequence[Request], k: int = 10, vector: np.ndarray | None = None) -> list[list[Candidate]]:
        """The ranking alone, gate aside: what a tool search on demand returns. `vector`: a
        single request's embedding when the caller already has it."""
        if vector is not None and len(requests) == 1:
            vectors = np.asarray(vector, np.float32)[None, :]
        else:
            vectors = self.queries.embed(self.embedder, [r.text for r in requests]).vectors
        return [self._top(v.scores[0], v.index, q, k) for v, q in zip(self.views(requests, vectors), vectors)]

    def views(self, requests: Sequence[Request], vectors: np.ndarray, exclude_self: bool = False, described: bool = False) -> list[Views]:
        """Every tool's per-view scores and the ranker's blend, per request (each against
        the index of its source's strategy). A lesson from traffic adds, for user turns, the
        turns that called each tool: to the cases view, and as a view of its own that its
        ranker weighs; for a reply, the tool of a reply span said before (`said_before`).
        `exclude_self`: a text that is one of those turns is not its own case.
        `described`: against the catalog as shipped (no written cases) with the built-in
        ranker, as the gate head judges (`gate_views`)."""
        out: list[Views | None] = [None] * len(requests)
        bm25 = np.vstack([self.lexical.scores(r.text) for r in requests]) if requests else np.zeros((0, len(self.catalog)))
        for source in SOURCES:
            rows = [i for i, r in enumerate(requests) if r.source == source]
            if not rows:
                continue
            index = self.described[str(self.strategies[source])] if described else self.index_for(source)
            cosine, cases = index.views(adapt(vectors[rows], self._adapter))
            logits = index.logits(vectors[rows])
            lex = bm25[rows]  # an index keeps catalog order, as the lexical index does
            learned = self.learned if source == "user" else None
            if learned is not None:
                seen = learned.cases(vectors[rows], index.names, exclude_self)
                cases = np.maximum(cases, seen)
            words = self.symbolic.views([requests[i].text for i in rows])
            features = rank_features(cosine, lex, cases, logits, words, self.symbolic.servers)
            if learned is not None:
                features = np.concatenate([features, np.maximum(seen, 0.0)[..., None]], axis=-1)
            if learned is not None and learned.weights is not None:
                scores = features @ learned.weights
            else:
                own = None if described else self.own_for(source)
                scores = (own.ranker if own else self.ranker).score(features[..., : len(RANK_FEATURES)])
            if source == "llm" and self.learned is not None and len(self.learned.replies) and not described:
                scores = said_before(scores, self.learned.cases(vectors[rows], index.names, exclude_self, source))
            for j, i in enumerate(rows):
                out[i] = Views(index, scores[j : j + 1], cosine[j : j + 1], cases[j : j + 1], lex[j : j + 1],
                               None if logits is None else logits[j : j + 1], features[j], words[j : j + 1], self.symbolic.servers)  # fmt: skip
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
        return self.detect_batch([Request(text, source)]).decisions[0]

    def settle(self, request: Request, within: float) -> Decision | None:
        """The decision on a text the patterns block, found within `within` seconds of CPU
        time a pattern set; None when it needs the model (or the patterns took longer: the model
        thread, whose searches have the full budget, decides it). A reply's clause that commits
        to nothing is most of a stream's spans, and judged here it waits for no batch of
        embeddings (`detect_batch` decides it alike)."""
        t0 = time.perf_counter()
        try:
            r = self.route(request, within)
        except Unsettled:
            return None
        if not r.blocked:
            return None
        took = (time.perf_counter() - t0) * 1000
        return decide(request.text, request.source, r, [], self._thresholds(request.source), Timing(regex=took, total=took))

    def detect_batch(self, requests: Sequence[Request]) -> Detected:
        if not requests:
            return Detected([], [])
        t0 = time.perf_counter()
        routes = [self.route(r) for r in requests]
        t_regex = time.perf_counter()
        todo = [i for i, s in enumerate(routes) if not s.blocked]
        embedded = self.queries.embed(self.embedder, [requests[i].text for i in todo])
        t_embed = time.perf_counter()
        live = [requests[i] for i in todo]
        views, ranked, probability = self.scored(live, embedded.vectors, [routes[i] for i in todo])
        candidates, confidence = dict(zip(todo, ranked)), dict(zip(todo, probability))
        t_cos = time.perf_counter()
        n = len(requests)
        share = Timing(
            regex=(t_regex - t0) * 1000 / n,
            embed=(t_embed - t_regex) * 1000 / max(len(todo), 1) if todo else 0.0,
            cosine=(t_cos - t_embed) * 1000 / max(len(todo), 1) if todo else 0.0,
        )
        out = []
        truncated = dict(zip(todo, embedded.truncated))
        bars = {source: self._thresholds(source) for source in {r.source for r in requests}}  # once a batch, not a text
        for i, (r, s) in enumerate(zip(requests, routes)):
            timing = Timing(share.regex, share.embed if i in candidates else 0.0, share.cosine if i in candidates else 0.0)
            timing.total = timing.regex + timing.embed + timing.cosine
            d = decide(r.text, r.source, s, candidates.get(i, []), bars[r.source], timing, confidence.get(i))
            d.truncated = truncated.get(i, False)
            out.append(d)
        rows, seen = dict(zip(todo, embedded.vectors)), dict(zip(todo, views))
        return Detected(out, [rows.get(i) for i in range(n)], [seen.get(i) for i in range(n)])

    def scored(self, requests: Sequence[Request], vectors: np.ndarray, routes: Sequence[Route]) -> tuple[list[Views], list[list[Candidate]], list[float | None]]:
        """Embedded, unblocked requests' views, ranked candidates and gate probability: the
        catalog's own gate where it fitted one, else the gate head (None without either). A
        few requests' products (the adapter, the gate's exemplars) run on one BLAS thread, as
        the index's do: on 2 busy cores OpenBLAS spreading nomic's 768x768 adapter product over
        both made it ~30 ms a turn where one thread takes ~0.3 ms (py-spy, bench/proxy_latency.py
        without model.blas_threads)."""
        with one_blas_thread(len(requests)):
            return self._scored(requests, vectors, routes)

    def _scored(self, requests: Sequence[Request], vectors: np.ndarray, routes: Sequence[Route]) -> tuple[list[Views], list[list[Candidate]], list[float | None]]:
        views = self.views(requests, vectors)
        candidates = [self._top(v.scores[0], v.index, q, self.top_k) for v, q in zip(views, vectors)]
        owns = [own.gate if (own := self.own_for(r.source)) else None for r in requests]
        confidence: list[float | None] = [None if o is None else float(o.probability(v.logits)[0]) for o, v in zip(owns, views)]
        rest = [k for k, o in enumerate(owns) if o is None]  # the gate head judges the others, and only them
        judged = self.gate_views([requests[k] for k in rest], vectors[rest], [views[k] for k in rest])
        head = self.confidence([requests[k] for k in rest], vectors[rest], judged, [routes[k] for k in rest])
        for k, c in zip(rest, head):
            confidence[k] = c
        learned = self.learned
        if learned is not None and learned.gate is not None:  # recalibrated on the user's own turns
            users = [k for k, r in enumerate(requests) if r.source == "user" and confidence[k] is not None]
            if users:
                p = learned.gate.probability(np.array([confidence[k] for k in users]), *learned.near(vectors[users]))
                for k, c in zip(users, p):
                    confidence[k] = float(c)
        for k, r in enumerate(requests):
            if r.prior and confidence[k] is not None:
                confidence[k] = shifted(confidence[k], r.prior)
        return views, candidates, confidence

    def gate_views(self, requests: Sequence[Request], vectors: np.ndarray, views: Sequence[Views]) -> Sequence[Views]:
        """What the gate head judges: `views`, but where cases were written for the catalog its
        views as shipped. The head learned "needs a tool" from catalogs of descriptions; written
        cases, a dozen short requests a tool, match any short question better than a description
        does, and judged on them it fired on 39% of the chat turns of the held-out servers (AUROC
        0.967 -> 0.665, nomic, each server's own tools). They rank; they do not gate."""
        return self.views(requests, vectors, described=True) if self.described and len(requests) else views

    def probabilities(self, requests: Sequence[Request], vectors: np.ndarray) -> tuple[np.ndarray, list[str | None]]:
        """Texts already embedded: each one's gate probability (the best tool's match without a
        gate head; 0 when a pattern blocks it) and best tool. What learning from traffic scores."""
        routes = [self.route(r) for r in requests]
        _, ranked, confidence = self.scored(requests, vectors, routes)
        p = [0.0 if s.blocked else (c if c is not None else (r[0].score if r else 0.0)) for s, r, c in zip(routes, ranked, confidence)]
        return np.array(p, float), [r[0].tool if r else None for r in ranked]

    @property
    def bar_in_force(self) -> float:
        """What a user turn on no pattern's path must reach to fire."""
        return self.thresholds_in_force[0].fallback

    def route(self, request: Request, within: float | None = None) -> Route:
        """What the patterns say of a text. A negative match blocks, unless the gate head was
        fitted with it as a feature: then the head weighs it."""
        if request.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, not {request.source!r}")
        return route(request.text, request.source, self.patterns, self._weigh_negatives, self.replies_commit, within)

    def confidence(self, requests: Sequence[Request], vectors: np.ndarray, views: Sequence[Views], routes) -> list[float | None]:
        """The gate head's probability that each text needs a tool (None without a head)."""
        if self.head is None or not requests:
            return [None] * len(requests)
        known = self._exemplars if self.learned is None else self._known_with(self.learned)
        return self.head.probability(self.gate_inputs(requests, vectors, views, routes, known)).tolist()

    def _known_with(self, learned: Learned) -> Known:
        """The head's exemplars and the turns learned from, decoded once per lesson."""
        if self._known_cache[0] is not learned:
            base = self._exemplars
            flags = lambda a, n: None if a is None else np.concatenate([a, np.zeros(n, bool)])  # noqa: E731  (a user turn: no pattern path)
            self._known_cache = (learned, Known(np.vstack([base.tool, learned.called]), np.vstack([base.none, learned.silent]),
                                                flags(base.tool_high, len(learned.called)), flags(base.none_high, len(learned.silent))))  # fmt: skip
        return self._known_cache[1]

    @property
    def ranker(self) -> Ranker:
        return self._ranker

    @ranker.setter
    def ranker(self, ranker: Ranker) -> None:
        self._ranker = ranker
        self._adapter = ranker.adapter.matrix() if ranker.adapter is not None else None  # decoded once

    @property
    def head(self) -> GateHead | None:
        return self._head

    @head.setter
    def head(self, head: GateHead | None) -> None:
        self._head = head
        self._exemplars = head.exemplars.arrays() if head is not None else None  # decoded once
        self._known_cache: tuple[Learned | None, Known | None] = (None, None)
        self._weigh_negatives = head is not None and "negative" in head.features

    def gate_inputs(self, requests: Sequence[Request], vectors: np.ndarray, views: Sequence[Views], routes,
                    exemplars: Known | None, exclude_self: bool = False,
                    names: Sequence[str] | None = None) -> np.ndarray:  # fmt: skip
        """The gate head's features (learned.GATE_SCALARS, then the embedding). `exclude_self`:
        a text that is one of the exemplars is not its own nearest neighbour (fitting)."""
        known = exemplars if exemplars is not None else Known(*(np.zeros((0, vectors.shape[1]), np.float32),) * 2)
        llm = np.array([r.source == "llm" for r in requests], float)
        high = np.array([s.kind == "high" for s in routes], float)
        # A reply's path says its tense ("I'll save it" vs "I've saved it"); a user turn's (an
        # imperative or a question) does not, and splitting its neighbours cost Banking77 (tuned)
        # 0.004 of gate AUROC with MiniLM. So only LLM texts look on their own path.
        path = np.where(llm > 0, high, np.nan)
        return gate_features(
            np.vstack([v.scores for v in views]),
            np.vstack([v.cosine for v in views]),
            np.vstack([v.cases for v in views]),
            np.vstack([v.bm25 for v in views]),
            llm,
            high,
            vectors,
            neighbourhood(vectors, known, exclude_self, path),
            np.vstack([classifier_view(v.logits, v.cosine.shape) for v in views]),
            np.array([s.negative for s in routes], float),
            names or (self.head.features if self.head is not None else GATE_SCALARS),
        )


class Views(msgspec.Struct):
    """One text against one index: the ranker's blend and the raw views it blends, (1, tools)."""

    index: ToolIndex
    scores: np.ndarray
    cosine: np.ndarray
    cases: np.ndarray
    bm25: np.ndarray
    logits: np.ndarray | None = None  # the index's classifier, if it has one
    features: np.ndarray | None = None  # (tools, views) what the ranker blended (a lesson from traffic: one view more)
    symbolic: np.ndarray | None = None  # (1, tools, 3) the action, clash and argument views (arguments.SymbolicIndex)
    servers: np.ndarray | None = None  # (tools,) each tool's server (learned.server_ids)


# How near a reply span must lie to one learned from for its reply's tool to come first: the
# few words a reply commits with ("let me check") lie near spans of every tool.
REPLY_NEAR = 0.85


def said_before(scores: np.ndarray, seen: np.ndarray) -> np.ndarray:
    """Ranker scores of reply spans, with the tool of the nearest learned reply span first
    where that span is within REPLY_NEAR: the agent said nearly this before and then called
    it (`seen`: (spans, tools), each tool's best cosine over the learned spans that called it).
    An agent words its steps the same way each time; the catalog's descriptions do not."""
    best = seen.argmax(axis=1)
    near = seen[np.arange(len(seen)), best] >= REPLY_NEAR
    out = scores.copy()
    rows = np.flatnonzero(near)
    out[rows, best[rows]] = scores[rows].max(axis=1) + 1e-3
    return out


def shifted(p: float, log_odds: float) -> float:
    """`p` with `log_odds` added to its logit (a prior the text alone does not carry)."""
    return 1.0 / (1.0 + math.exp(-(float(logit(p)) + log_odds)))


def open_embedder(cfg: Config, store: Store | None, progress: bool = True, calibration: calib.Calibration | None = None) -> Embedder:
    """Resolve (and provision, if allowed) the configured model and load it. Task prefixes:
    the config's on/off, else what a calibration measured, else the model's measured default."""
    dest = pathlib.Path(cfg.model.dir) if cfg.model.dir else None
    digest = store.file_sha256 if store is not None else models.file_sha256  # the store hashes a file once per size and mtime
    resolved = models.resolve(cfg.model.name, dest=dest, auto_pull=cfg.model.pull, progress=progress, digest=digest)
    spec = resolved.spec
    identity = spec.sha256 if spec is not None and spec.sha256 else digest(resolved.path)
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
        bulk=cfg.model.bulk_threads,
        idle_cores=cfg.model.idle_cores,
        prefixes=prefixes,
        max_tokens=spec.n_ctx if spec else None,
    )


def from_config(cfg: Config, *, catalog: Catalog | None = None, progress: bool = True, store: Store | None = None,
                calibration: bool | calib.Calibration = True, embedder: Embedder | None = None, cases: bool = True,
                at_once: bool = False) -> Pipeline:  # fmt: skip
    """Everything the config names, loaded and validated, as a ready pipeline. `calibration`:
    the config's file, else the model's built-in (True); none at all (False: what `tune` fits
    from: cosine thresholds, the default ranker, no gate head, plain derived cases); or the one
    given (what `tune` judges its held-out part with). `embedder`: a model already loaded.
    `cases=False`: no written cases yet, whatever `[cases] fill` says (serve and proxy add
    them after they are ready: serve/completion.py). `at_once`: when more than COLD_AT_ONCE of
    the catalog's tools are not in the store yet, index only those that are (seconds): the
    rest stay `pending` for serve and proxy to add while they answer."""
    if isinstance(calibration, calib.Calibration):
        cal_file = calibration
    else:
        cal_file = calib.read(cfg.calibration) if cfg.calibration and calibration else None
    pats = patterns_mod.load_dir(cfg.gate.patterns, cfg.gate.regex_timeout_ms / 1000)
    cat = catalog if catalog is not None else catalog_mod.load(cfg.catalogs)
    if store is None:
        store = open_store(cfg.store)
    if embedder is None:
        with progress_mod.slow_step(f"loading {cfg.model.name}", progress):
            embedder = open_embedder(cfg, store, progress, cal_file)
    if calibration is not False:
        thresholds, origin = calib.thresholds_for(embedder.name, cfg.gate, cal_file)
        cal, _ = calib.in_force(embedder.name, cal_file)
    else:
        thresholds, origin, cal = Thresholds(), "uncalibrated", None
    strategies = {
        "user": Strategy.parse(cfg.index.user_strategy or (cal and cal.user_strategy) or calib.DEFAULT_USER_STRATEGY),
        "llm": Strategy.parse(cfg.index.llm_strategy or (cal and cal.llm_strategy) or calib.DEFAULT_LLM_STRATEGY),
    }
    ranker, head, examples = (cal.ranker, cal.head, cal.examples) if cal is not None else (None, None, None)
    self_fit = cfg.index.self_fit and origin == "builtin"  # a calibration file or explicit thresholds are the user's word
    casebook = book_for(store, cfg.cases.packs) if cfg.cases.fill and cases else None
    whole = cat
    if at_once:
        indexed = catalog_mod.distinct(cat)  # as reindex reads it
        warm = set.intersection(*(stored_tools(indexed, embedder, s, store) for s in set(strategies.values())))
        if len(cat) - len(warm) > COLD_AT_ONCE:
            cat = Catalog([t for t in cat if t.name in warm], cat.sources)
    return Pipeline(embedder, cat, pats, thresholds, strategies, store, cfg.index.top_k, origin, ranker, head, cfg.index.query_cache, examples,
                    progress=progress, self_fit=self_fit, casebook=casebook, whole=whole,
                    replies_commit=cfg.gate.replies == "commit")  # fmt: skip
