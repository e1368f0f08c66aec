"""Rank a catalog's tools for a query on relevance and history, and suggest stand-ins for a
tool that just failed.

Built over a loaded `Pipeline`: its embedder embeds the query, its semantic index scores the
tools (nothing is embedded or indexed again), and `sidecar.core.lexical` supplies BM25. The
history comes from a `MetricsStore`. Scoring, intent and filters are pure; this module
gathers the facts (vectors, metrics, clock) and hands them over.

    query ─► intent ─► retrieval: vector top-N ∪ BM25 top-N ∪ inverted (term, action, domain)
          ─► context filters ─► relevance x intent adjustment ─► multi-factor score ─► top
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Literal

import cachetools
import msgspec
import numpy as np

from ..core.catalog import Catalog, Tool
from ..config import RecommendConfig
from ..core.lexical import LexicalIndex
from ..core.pipeline import Request, Views
from ..learn.learned import TEMPERATURE
from ..store.metrics import CallCount, MetricsStore, ToolMetrics, key_of
from ..protocol import FallbackSuggestion
from ..store import StoreError
from . import filters as F
from . import intent as I
from . import scoring as S
from .learn import assign_variant

Mode = Literal["semantic", "lexical", "hybrid"]
MODES = ("semantic", "lexical", "hybrid")
# Inverted-index hit weights: a shared term says more than a shared verb, a verb more than a domain.
TERM_HIT, ACTION_HIT, DOMAIN_HIT = 1.0, 0.6, 0.25


class Factors(msgspec.Struct):
    """The five scored factors (each in 0..1) and what the first was made of. `relevance` is the
    factor of that name in `[recommend.weights]`: how well the tool fits the text, among the
    candidates (a why says "fit"); a tool's relevance, as shown, is the whole weighted score."""

    relevance: float
    success: float
    popularity: float
    performance: float
    rating: float
    semantic: float | None  # the ranker's blend for the query (cosine, best case cosine, BM25): not a bounded cosine
    lexical: float | None  # BM25, relative to the best BM25 score of the query
    intent: float  # the intent adjustment's multiplier (1 = none)
    calls: int  # calls on record (under min_calls: priors stood in)


class Recommendation(msgspec.Struct):
    """One ranked tool. `score` orders the ranking (relevance factor and history, weighted);
    `relevance` is what a user is shown: the probability that this is the tool the text asks
    for among the catalog's (`fit_probability`), which moves with the match where the score of
    the best tool with no history is the same whatever the text."""

    tool: str
    score: float
    why: str
    factors: Factors
    relevance: float = 0.0


class Recommendations(msgspec.Struct):
    query: str
    results: list[Recommendation]
    mode: str = "hybrid"
    variant: str | None = None
    cached: bool = False
    candidates: int = 0  # tools scored (after the filters)
    excluded: dict[str, str] = {}  # retrieved tools the context filtered out, with the reason
    timing_ms: float = 0.0


Fallback = FallbackSuggestion  # one struct: what `fallbacks()` returns is what an `ack` carries


class _State:
    """What the recommender derives from one catalog (rebuilt when the pipeline reindexes)."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        self.tools: list[Tool] = list(catalog)
        self.names = [t.name for t in self.tools]
        self.pos = {n: i for i, n in enumerate(self.names)}
        self.keys = [key_of(catalog, n) for n in self.names]
        self.profiles = [I.profile(t) for t in self.tools]
        self.tags = [F.tool_tags(t) for t in self.tools]
        servers = sorted({k[0] for k in self.keys})
        self.server_ids = {s: i for i, s in enumerate(servers)}
        self.server_of = np.asarray([self.server_ids[k[0]] for k in self.keys], np.int64)
        inv: dict[str, dict[str, list[int]]] = {"term": {}, "action": {}, "domain": {}}
        for i, p in enumerate(self.profiles):
            for t in p.terms:
                inv["term"].setdefault(t, []).append(i)
            for v in p.verbs:
                inv["action"].setdefault(v, []).append(i)
            for d in p.domains:
                inv["domain"].setdefault(d, []).append(i)
        self.inverted = {kind: {k: np.asarray(v, np.int64) for k, v in d.items()} for kind, d in inv.items()}
        self._lexical: LexicalIndex | None = None
        self.static_masks: collections.OrderedDict[bytes, tuple[np.ndarray, list[str | None]]] = collections.OrderedDict()
        self.index_maps: dict[int, tuple[object, np.ndarray]] = {}
        self.centroids: dict[int, tuple[object, np.ndarray]] = {}
        self.lock = threading.Lock()

    @property
    def lexical(self) -> LexicalIndex:
        with self.lock:
            if self._lexical is None:
                self._lexical = LexicalIndex.bm25_of(self.catalog)  # the pipeline's, built once
            return self._lexical


log = logging.getLogger("sidecar.recommend")
# What the metrics say about availability and rate limits (`_facts`) is read again when the
# store's generation changed, or after this many seconds of the recommender's clock (the
# windows move on); per agent, for the FACTS_AGENTS latest. Read once a ranking before: three
# queries over the window's calls, 40-120 ms beside a busy event loop (bench/metrics_store.py).
FACTS_TTL_S = 1.0
FACTS_AGENTS = 1024


class Recommender:
    """`recommend()` ranks; `fallbacks()` suggests stand-ins for a failed tool. Thread-safe:
    the server may call it from its executor while the event loop records calls."""

    def __init__(self, pipeline, metrics: MetricsStore | None = None, cfg: RecommendConfig | None = None, clock=None):
        self.pipeline = pipeline
        self.metrics = metrics
        self.cfg = cfg or RecommendConfig()
        self.clock = clock or (metrics.clock if metrics is not None else time.time)  # one clock with the store
        self._state: _State | None = None
        self._cache: collections.OrderedDict[tuple, tuple[float, int, weakref.ref, weakref.ref | None, Recommendations]] = collections.OrderedDict()
        self._history: tuple[int, dict] | None = None
        self._facts_read: cachetools.LRUCache[str | None, tuple[int, float, F.Facts]] = cachetools.LRUCache(FACTS_AGENTS)
        self._lock = threading.Lock()
        self.history_errors = 0  # rankings made on neutral history because the store could not be read
        self._said_down = 0.0

    # --- public ------------------------------------------------------------------------

    def weights_for(self, agent: str | None) -> tuple[str | None, S.Weights]:
        """The A/B arm an agent is in and its weights (no arms configured: everyone gets
        `recommend.weights`, variant None)."""
        if not self.cfg.variants or agent is None:
            return None, self.cfg.weights
        name = assign_variant(agent, list(self.cfg.variants))
        return name, self.cfg.variants[name]

    def recommend(
        self,
        query: str,
        context: F.Context | None = None,
        top: int | None = None,
        mode: Mode | None = None,
        *,
        weights: S.Weights | None = None,
        query_vector: np.ndarray | None = None,
        views: Views | None = None,
    ) -> Recommendations:
        """The `top` best tools for `query`, best first, each with its score, factors and a why.
        `query_vector`: the query's embedding when the caller already has it (the server's
        gate embedded the same text); `views`: the pipeline's views of it, against the index
        of `context.source`, when the gate already scored them (`Detected.views`). `weights`
        overrides the agent's variant (no caching)."""
        t0 = time.perf_counter()
        ctx = context or F.Context()
        top = top or self.cfg.top
        mode = mode or self.cfg.mode
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        if not query.strip():
            raise ValueError("no query to recommend for")
        state = self._current_state()
        generation = self._generation()
        variant, w = (None, weights) if weights is not None else self.weights_for(ctx.agent)
        key = (query, mode, top, variant, msgspec.json.encode(ctx))
        now = self.clock()
        if weights is None and self.cfg.cache_ttl_s > 0:
            with self._lock:
                hit = self._cache.get(key)
                if hit is not None:
                    at, gen, cat, lesson, res = hit
                    # a lesson swapped in from traffic ranks user turns anew: what it replaced is stale
                    if gen == generation and cat() is state.catalog and _same(lesson, self.pipeline.learned) and now - at < self.cfg.cache_ttl_s:
                        self._cache.move_to_end(key)
                        return msgspec.structs.replace(res, cached=True, timing_ms=(time.perf_counter() - t0) * 1000)
                    del self._cache[key]
        res = self._rank(state, query, ctx, top, mode, w, query_vector, views, generation, now)
        res.variant = variant
        res.timing_ms = (time.perf_counter() - t0) * 1000
        if weights is None and self.cfg.cache_ttl_s > 0 and generation is not None:  # a blind ranking is not kept
            with self._lock:
                # by weak reference: an entry never asked again must not keep a replaced catalog or
                # lesson alive (a lesson is its turns' vectors, 15 MB at the default 5,000: a soak
                # with learning on grew 12 MB a minute, flat with learning off)
                lesson = self.pipeline.learned
                self._cache[key] = (now, generation, weakref.ref(state.catalog), None if lesson is None else weakref.ref(lesson), res)
                while len(self._cache) > self.cfg.cache_size:
                    self._cache.popitem(last=False)
        return res

    def factor_matrix(self, query: str, names: Sequence[str], context: F.Context | None = None, mode: Mode | None = None) -> np.ndarray:
        """(len(names), 5) factor values (FACTORS order) of the named tools for `query`, as
        `recommend` would score them; rows of tools not in the catalog are NaN. What weight
        tuning replays feedback through."""
        ctx = context or F.Context()
        state = self._current_state()
        generation = self._generation()
        extra = [state.pos[n] for n in names if n in state.pos]
        scored = self._score(state, query, ctx, mode or self.cfg.mode, generation, self.clock(), extra=extra, filtered=False)
        out = np.full((len(names), len(S.FACTORS)), np.nan)
        for r, n in enumerate(names):
            row = scored["rows"].get(state.pos.get(n, -1))
            if row is not None:
                out[r] = row[0]
        return out

    def fallbacks(self, failed_tool: str, context: F.Context | None = None, max_n: int | None = None) -> list[Fallback]:
        """Tools that could stand in for `failed_tool` (a catalog name, or server__tool):
        similar by embedding, weighted by success rate and recency, same server preferred,
        tools that contradict its action (a reader for a failed writer) discounted. The
        failed tool's own server is not excluded for failing: its other tools may work."""
        ctx = context or F.Context()
        max_n = self.cfg.max_fallbacks if max_n is None else max_n
        state = self._current_state()
        pos = state.pos.get(failed_tool)
        if pos is None:
            server, bare = key_of(None, failed_tool)
            pos = next((i for i, k in enumerate(state.keys) if k == (server, bare) or (not server and k[1] == bare)), None)
        if pos is None or max_n <= 0 or len(state.tools) < 2:
            return []
        failed_server = state.keys[pos][0]
        cents = self._centroids(state, ctx.source)
        sims = cents @ cents[pos]
        sims[pos] = -np.inf
        generation = self._generation()
        allowed = self._allowed(state, ctx, self._facts(ctx, generation), exempt_server=failed_server)
        sims = np.where(allowed, sims, -np.inf)
        pool = [int(i) for i in np.argsort(-sims, kind="stable")[: max(self.cfg.candidates, max_n)] if np.isfinite(sims[i])]
        history = self._history_for(None, generation)
        now = self.clock()
        failed = state.tools[pos]
        as_intent = I.analyze(" ".join(I.words(failed.bare_name)))
        out = []
        for i in pool:
            m = history["totals"].get(state.keys[i])
            judged = m is not None and m.call_count >= self.cfg.min_calls
            rate = m.success_rate if judged else None
            success = rate if rate is not None else self.cfg.priors.success
            last_ok = m.last_success_at if m is not None else None
            if judged:
                recency = 0.5 + 0.5 * math.exp(-max(now - last_ok, 0.0) / S.DAY_S / 30.0) if last_ok else 0.5
            else:
                recency = 0.75  # unknown: between a tool just used and one long idle
            same = state.keys[i][0] == failed_server and failed_server != ""
            adj = S.intent_adjustment(as_intent, state.profiles[i], self.cfg.intent)
            penalty = math.prod(1 - p for p in _penalty_shares(adj, self.cfg.intent))
            score = max(float(sims[i]), 0.0) * success * recency * penalty * (self.cfg.same_server_boost if same else 1.0)
            parts = [f"similar to {failed.bare_name} ({float(sims[i]):.2f})"]
            if same:
                parts.append("same server")
            parts.append(f"{rate:.0%} success over {m.call_count} calls" if rate is not None else "no track record yet")
            parts.extend(adj.penalties)
            out.append(Fallback(state.names[i], round(score, 4), round(float(sims[i]), 4),
                                None if rate is None else round(rate, 4), "; ".join(parts)))  # fmt: skip
        out.sort(key=lambda f: (-f.score, f.tool))
        return out[:max_n]

    # --- ranking -------------------------------------------------------------------------

    def _rank(self, state, query, ctx, top, mode, w, query_vector, views, generation, now) -> Recommendations:
        scored = self._score(state, query, ctx, mode, generation, now, query_vector=query_vector, views=views)
        rows = scored["rows"]
        results = []
        for i, (values, info) in rows.items():
            score = S.combine(w, values)
            results.append((score, i, values, info))
        results.sort(key=lambda r: (-r[0], state.names[r[1]]))
        out = []
        for score, i, values, info in results[:top]:
            f = Factors(*(round(v, 4) for v in values), semantic=info["semantic"], lexical=info["lexical"],
                        intent=round(info["adj"].multiplier, 4), calls=info["calls"])  # fmt: skip
            out.append(Recommendation(state.names[i], round(score, 4), _why(f, info, w, self.cfg), f, round(info["probability"], 4)))
        return Recommendations(query, out, mode, candidates=len(rows), excluded=scored["excluded"])

    def _score(self, state: _State, query: str, ctx: F.Context, mode: str, generation: int | None, now: float,
               query_vector=None, extra: Sequence[int] = (), filtered: bool = True, views: Views | None = None) -> dict:  # fmt: skip
        """Retrieve candidates and compute every candidate's five factor values."""
        n = len(state.tools)
        if n == 0:
            return {"rows": {}, "excluded": {}}
        intent = I.analyze(query)
        share = {"semantic": 1.0, "lexical": 0.0, "hybrid": self.cfg.semantic_share}[mode]
        sem = lex = None
        if share > 0:
            if query_vector is None:  # through the query cache: a text the gate blocked unembedded is ranked (eval) and searched again
                query_vector = self.pipeline.queries.embed(self.pipeline.embedder, [query]).vectors[0]
            sem = self._semantic(state, query, ctx.source, np.asarray(query_vector, np.float32), views)
        if share < 1:
            raw_lex = state.lexical.scores(query).astype(np.float64)
            top_lex = float(raw_lex.max()) if n else 0.0
            lex = raw_lex / top_lex if top_lex > 0 else np.zeros(n)
        # One relevance scale for every mode: cosine units (lexical alone: 0..1).
        if sem is None:
            base = lex
        elif lex is None:
            base = sem
        else:
            base = share * sem + (1 - share) * lex * max(float(sem.max()), 0.0)
        facts = self._facts(ctx, generation) if filtered else F.Facts()
        static = self._static(state, ctx)[1] if filtered else []  # each tool's reason, if the context's globs or tags exclude it
        allowed = self._allowed(state, ctx, facts) if filtered else np.ones(n, bool)
        k = self.cfg.candidates
        picked: dict[int, None] = {}
        excluded: dict[str, str] = {}
        for scores in (s for s in (sem, lex) if s is not None):
            for i in _top(scores, k, positive=scores is lex):
                if allowed[i]:
                    picked[int(i)] = None
                elif state.names[i] not in excluded:
                    excluded[state.names[i]] = self._reason(state, int(i), ctx, facts, static)
            masked = np.where(allowed, scores, -np.inf)
            for i in _top(masked, k, positive=scores is lex):  # refill what the filters took
                picked[int(i)] = None
        for i in self._inverted(state, intent, base, allowed, k):
            picked[int(i)] = None
        for i in extra:
            picked[int(i)] = None
        if not picked:
            return {"rows": {}, "excluded": excluded}
        cand = np.fromiter(picked, np.int64)
        adjs = [S.intent_adjustment(intent, state.profiles[i], self.cfg.intent) for i in cand]
        adjusted = base[cand] * np.asarray([a.multiplier for a in adjs])
        # Stretch to 0..1 between the catalog's typical score (the median: what an unrelated
        # tool gets) and the best adjusted candidate, so relevance spans the range the
        # history factors do instead of the few hundredths raw cosines differ by.
        floor = float(np.median(base))
        best = float(adjusted.max())
        if best - floor > 1e-9:
            relevance = np.clip((adjusted - floor) / (best - floor), 0.0, 1.0)
        else:  # nothing stands out (e.g. no BM25 match at all): relevance cannot separate them
            relevance = np.full(len(cand), 1.0 if best > 0 else 0.0)
        probability = fit_probability(base, cand, adjusted)
        said = _surface(I.words(query))
        hist = self._history_for(ctx.agent, generation)
        histories = [self._tool_history(state, int(i), hist) for i in cand]
        typical = self._typical_popularity(histories, now)
        rows = {}
        for j, i in enumerate(cand):
            h = histories[j]
            hf = S.history_factors(h, now, self.cfg.priors, self.cfg.min_calls, typical)
            values = (float(relevance[j]), hf.success, hf.popularity, hf.performance, hf.rating)
            info = {
                "semantic": None if sem is None else round(float(sem[i]), 4),
                "lexical": None if lex is None else round(float(lex[i]), 4),
                "adj": adjs[j],
                "probability": float(probability[j]),
                "matched": _readable(adjs[j].matched, said, _surface(I.words(state.tools[i].bare_name))),
                "calls": h.calls,
                "prior": hf.prior,
                "history": h,
            }
            rows[int(i)] = (values, info)
        return {"rows": rows, "excluded": excluded}

    def _semantic(self, state: _State, query: str, source: str, vector: np.ndarray, views: Views | None = None) -> np.ndarray:
        """Every catalog tool's relevance as the pipeline ranks it, in catalog order (on
        `views` when the gate scored them already)."""
        if views is None:
            views = self.pipeline.views([Request(query, source)], vector[None, :])[0]
        index = views.index
        per_index = views.scores[0].astype(np.float64)
        with state.lock:
            cached = state.index_maps.get(id(index))
            if cached is None or cached[0] is not index:
                order = np.asarray([state.pos.get(nm, -1) for nm in index.names], np.int64)
                cached = (index, order)
                state.index_maps[id(index)] = cached
        order = cached[1]
        out = np.full(len(state.tools), float(per_index.min()) if per_index.size else 0.0)
        ok = order >= 0
        out[order[ok]] = per_index[ok]
        return out

    def _inverted(self, state: _State, intent: I.Intent, base: np.ndarray, allowed: np.ndarray, k: int) -> np.ndarray:
        """Tools sharing a term, an (expanded) action or a domain with the query; the k with
        the most weighted hits (ties: the higher retrieval score)."""
        hits = np.zeros(len(state.tools))
        for t in set(intent.terms):
            if (ix := state.inverted["term"].get(t)) is not None:
                hits[ix] += TERM_HIT
        actions = set().union(*(I.ACTION_MAP[a] for a in intent.actions)) if intent.actions else set()
        for a in actions:
            if (ix := state.inverted["action"].get(a)) is not None:
                hits[ix] += ACTION_HIT
        for d in intent.domains:
            if (ix := state.inverted["domain"].get(d)) is not None:
                hits[ix] += DOMAIN_HIT
        hits = np.where(allowed, hits, 0.0)
        if not hits.any():
            return np.zeros(0, np.int64)
        key = hits + 1e-3 * np.clip(base, 0.0, 1.0)  # hits first, retrieval score breaks ties
        key = np.where(hits > 0, key, -np.inf)
        return _top(key, k, positive=False)

    def _allowed(self, state: _State, ctx: F.Context, facts: F.Facts, exempt_server: str | None = None) -> np.ndarray:
        """Mask of the tools the context permits now: static exclusions (permissions, project
        tags) cached per context, then failing servers and rate limits from `facts`."""
        out = self._static(state, ctx)[0].copy()
        down = (set(facts.failing_servers) | set(ctx.unavailable_servers)) - {exempt_server}
        ids = [state.server_ids[s] for s in down if s in state.server_ids]
        if ids:
            out &= ~np.isin(state.server_of, ids)
        if facts.rate_limit is not None:
            for key, calls in facts.recent_calls.items():
                if calls >= facts.rate_limit:
                    for i, k in enumerate(state.keys):
                        if k == key:
                            out[i] = False
        return out

    def _static(self, state: _State, ctx: F.Context) -> tuple[np.ndarray, list[str | None]]:
        """Each tool's static exclusion (permissions, project tags) in this context, and the
        mask of those with none, decided once per context: a session's globs are matched
        against the catalog once, not on every ranking (256 globs of a hello held the model
        thread, issue 33)."""
        skey = ctx.static_key()
        with state.lock:
            found = state.static_masks.get(skey)
            if found is None:
                static_ctx = F.Context(permissions=ctx.permissions, project_tags=ctx.project_tags)
                reasons = [F.exclusion(t, p, g, static_ctx, F.Facts()) for t, p, g in zip(state.tools, state.profiles, state.tags)]
                found = state.static_masks[skey] = (np.asarray([r is None for r in reasons], bool), reasons)
                while len(state.static_masks) > 64:
                    state.static_masks.popitem(last=False)
        return found

    def _facts(self, ctx: F.Context, generation: int | None) -> F.Facts:
        """What the metrics say now. A server is failing for everyone once its recent calls
        mostly failed as reported by `availability_min_reporters` distinct connections (or by
        this process's own calls); for the asking agent, once its own recent calls did
        (per-agent history first). So one session's failures never exclude a tool for
        others; they only lower its history factors (success, performance: at most their
        weights, 0.40 of the score at the defaults)."""
        if self.metrics is None:
            return F.Facts()
        now = self.clock()
        with self._lock:
            kept = self._facts_read.get(ctx.agent)
        if kept is not None and generation is not None and kept[0] == generation and 0 <= now - kept[1] < FACTS_TTL_S:
            return kept[2]
        facts = self._fail_open(lambda: self._read_facts(ctx), None)
        if facts is None:
            return F.Facts()
        if generation is not None:
            with self._lock:
                self._facts_read[ctx.agent] = (generation, now, facts)
        return facts

    def _read_facts(self, ctx: F.Context) -> F.Facts:
        cfg = self.cfg
        recent = self.metrics.recent(cfg.availability_window_s)
        reporters = self.metrics.failure_reporters(cfg.availability_window_s)
        failing = F.failing_servers(recent, cfg.availability_min_calls, cfg.availability_failure_rate,
                                    reporters, cfg.availability_min_reporters)  # fmt: skip
        if ctx.agent is not None:
            own = self.metrics.recent(cfg.availability_window_s, agent=ctx.agent)
            failing |= F.failing_servers(own, cfg.availability_min_calls, cfg.availability_failure_rate)
        calls: dict[tuple[str, str], int] = {}
        if cfg.rate_limit_calls is not None and ctx.agent is not None:
            calls = {k: c.calls for k, c in self.metrics.recent(cfg.rate_limit_window_s, agent=ctx.agent).items()}
        return F.Facts(failing, calls, cfg.rate_limit_calls)

    def _reason(self, state: _State, i: int, ctx: F.Context, facts: F.Facts, static: Sequence[str | None]) -> str:
        why = static[i]
        if why is None:  # then the metrics': the static part is not matched again
            dynamic = F.Context(agent=ctx.agent, unavailable_servers=ctx.unavailable_servers, source=ctx.source)
            why = F.exclusion(state.tools[i], state.profiles[i], state.tags[i], dynamic, facts)
        return why or "excluded"

    # --- history -------------------------------------------------------------------------

    def _history_for(self, agent: str | None, generation: int | None) -> dict:
        """Lifetime totals, ratings and the agent's own record, read once per metrics
        generation (and agent); None: the generation could not be read, so read now."""
        neutral = {"totals": {}, "ratings": {}, "agent": {}}
        return neutral if self.metrics is None else self._fail_open(lambda: self._read_history(agent, generation), neutral)

    def _read_history(self, agent: str | None, gen: int | None) -> dict:
        if gen is None:
            gen = self.metrics.generation()
        with self._lock:
            if self._history is not None and self._history[0] == gen:
                snap = self._history[1]
            else:
                snap = None
        if snap is None:
            totals = {(m.server, m.tool): m for m in self.metrics.all()}
            snap = {"totals": totals, "ratings": self.metrics.ratings(), "agents": {}}
            with self._lock:
                self._history = (gen, snap)
        out = {"totals": snap["totals"], "ratings": snap["ratings"], "agent": {}}
        if agent is not None:
            per = snap["agents"].get(agent)
            if per is None:
                per = self.metrics.per_agent(agent)
                snap["agents"][agent] = per
            out["agent"] = per
        return out

    def _generation(self) -> int | None:
        """The store's generation (what cached rankings are keyed on); None when it cannot
        be read, so nothing ranked meanwhile is cached."""
        return 0 if self.metrics is None else self._fail_open(self.metrics.generation, None)

    def _fail_open(self, read, neutral):
        """`read()`, or `neutral` when the store cannot be read (a database down or locked
        past its bound): rankings go on with neutral history, as for tools never called,
        instead of failing the injection. Counted (sidecar_history_unavailable_total) and
        logged at most once a minute."""
        try:
            return read()
        except StoreError as e:
            error = e
        now = time.monotonic()
        with self._lock:
            self.history_errors += 1
            say = now - self._said_down >= 60.0
            if say:
                self._said_down = now
        if say:
            log.warning("tool history unavailable, ranking on neutral history: %s", error)
        return neutral

    def _tool_history(self, state: _State, i: int, hist: dict) -> S.History:
        key = state.keys[i]
        m: ToolMetrics | None = hist["totals"].get(key)
        mine: CallCount | None = hist["agent"].get(key)
        n_r, avg_r = hist["ratings"].get(state.names[i], (0, None))
        if m is None:
            return S.History(agent_calls=mine.calls if mine else 0, agent_successes=mine.successes if mine else 0,
                             ratings=n_r, avg_rating=avg_r)  # fmt: skip
        return S.History(m.call_count, m.success_count, m.avg_latency_ms, m.last_called_at,
                         mine.calls if mine else 0, mine.successes if mine else 0, n_r, avg_r)  # fmt: skip

    def _typical_popularity(self, histories: Sequence[S.History], now: float) -> float:
        if self.cfg.priors.popularity is not None:
            return self.cfg.priors.popularity
        seen = [S.history_factors(h, now, self.cfg.priors, self.cfg.min_calls).popularity
                for h in histories if h.calls >= self.cfg.min_calls]  # fmt: skip
        return float(np.mean(seen)) if seen else 0.0

    # --- catalog-derived state -------------------------------------------------------------

    def prepare(self) -> None:
        """Derive the catalog's state now rather than on the first recommendation (a server
        at start: 10,000 tools take ~1 s, which the first user would otherwise wait for)."""
        self._current_state()

    def _current_state(self) -> _State:
        """The derived state of the pipeline's current catalog; a reindex (a new catalog
        object) rebuilds it and so invalidates the cache entries made under the old one."""
        cat = self.pipeline.catalog
        with self._lock:
            if self._state is None or self._state.catalog is not cat:
                self._state = _State(cat)
                self._cache.clear()
            return self._state

    def _centroids(self, state: _State, source: str) -> np.ndarray:
        """One unit vector per tool (the mean of its indexed texts), in catalog order."""
        index = self.pipeline.index_for(source)
        with state.lock:
            cached = state.centroids.get(id(index))
            if cached is not None and cached[0] is index:
                return cached[1]
        out = np.zeros((len(state.tools), index.dim), np.float32)
        if len(index):
            sums = np.add.reduceat(index.matrix, index.starts, axis=0)
            norms = np.linalg.norm(sums, axis=1, keepdims=True)
            sums /= np.where(norms == 0, 1.0, norms)
            for j, nm in enumerate(index.names):
                if (p := state.pos.get(nm)) is not None:
                    out[p] = sums[j]
        with state.lock:
            state.centroids[id(index)] = (index, out)
        return out


def _top(scores: np.ndarray, k: int, positive: bool) -> np.ndarray:
    """Indices of the k highest finite scores (only > 0 when `positive`), best first."""
    valid = np.isfinite(scores) & (scores > 0) if positive else np.isfinite(scores)
    idx = np.flatnonzero(valid)
    if idx.size == 0:
        return idx
    if idx.size > k:
        part = np.argpartition(-scores[idx], k - 1)[:k]
        idx = idx[part]
    return idx[np.argsort(-scores[idx], kind="stable")]


def fit_probability(base: np.ndarray, cand: np.ndarray, adjusted: np.ndarray) -> np.ndarray:
    """Per candidate, the probability that it is the tool the text asks for among the catalog's:
    the softmax of the ranker's blend over every tool (the candidates' after the intent
    adjustment) at the temperature its weights were fitted with (`learned.RankerFit` maximises
    exactly this on the expected tools). On 400 texts of the corpus's held-out servers against
    ALL.json (605 tools), the best tool's value read as its chance of being right: quartile
    means 0.22 / 0.47 / 0.74 / 0.96 beside 27% / 55% / 80% / 94% right first."""
    z = TEMPERATURE * base.astype(np.float64)
    z[cand] = TEMPERATURE * np.asarray(adjusted, np.float64)
    p = np.exp(z - z.max())
    return p[cand] / p.sum()


def _penalty_shares(adj: S.Adjustment, rules: S.IntentRules) -> list[float]:
    shares = {"read-only": rules.read_only_vs_write, "write-only": rules.write_only_vs_read, "delete tool": rules.delete_vs_create}
    return [v for p in adj.penalties for k, v in shares.items() if p.startswith(k)]


def _why(f: Factors, info: dict, w: S.Weights, cfg: RecommendConfig) -> str:
    """The factors that decided the place, shortest first: how well the tool fits the text (the
    relevance factor) and what made it, then history that departs from neutral, then penalties.
    The factor is shown as "fit": the tool's relevance is the whole score this explains."""
    adj: S.Adjustment = info["adj"]
    parts = []
    rel = f"fit {f.relevance:.2f}"
    made = []
    if f.semantic is not None:
        made.append(f"match {f.semantic:.2f}")  # the ranker's blend (cosine, cases, BM25): not bounded by 1
    if f.lexical:
        made.append(f"bm25 {f.lexical:.2f}")
    if info.get("matched"):
        made.append("name matches " + ", ".join(info["matched"]))
    parts.append(rel + (f" ({'; '.join(made)})" if made else ""))
    h: S.History = info["history"]
    if info["prior"]:
        parts.append("new: neutral history" if h.calls == 0 else f"{h.calls} call(s): neutral history")
    else:
        parts.append(f"{f.success:.0%} success over {h.calls} calls")
        if h.agent_calls >= cfg.min_calls:
            parts.append(f"this agent {h.agent_successes}/{h.agent_calls} ok")
        if f.performance < 0.5 and h.avg_latency_ms is not None:
            parts.append(f"slow ({h.avg_latency_ms:.0f} ms)")
        if f.popularity >= 0.1:
            parts.append(f"popular ({f.popularity:.2f})")
    if h.ratings >= cfg.min_calls and h.avg_rating is not None:
        parts.append(f"rated {h.avg_rating:.1f}/5")
    parts.extend(adj.penalties)
    return "; ".join(parts)


def _surface(ws: Sequence[str]) -> dict[str, str]:
    """stem -> the first word that has it, to show people words rather than stems."""
    out: dict[str, str] = {}
    for w in ws:
        out.setdefault(I.stem(w), w)
    return out


def _readable(matched: Sequence[str], query_words: dict[str, str], tool_words: dict[str, str]) -> list[str]:
    out = []
    for m in matched:
        q, _, t = m.partition("→")
        qw = query_words.get(q, q)
        out.append(f"{qw}→{tool_words.get(t, t)}" if t else tool_words.get(q, qw))
    return out


def _same(ref: weakref.ref | None, obj: object) -> bool:
    """Whether a weak reference (None: to nothing) points at `obj`: one that died points at
    nothing, not at None."""
    return obj is None if ref is None else obj is not None and ref() is obj
