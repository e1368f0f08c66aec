"""The engine: one `Sidecar`, built by `Sidecar.open` from a `Config`, is what every command,
the websocket server and the MCP server run on.

A text becomes an inject in exactly one place, `Sidecar.judge`: the pipeline's gate decides
whether the text needs a tool; when it fired, the recommender ranks the tools on the vector the
gate already made, with the history of the metrics store; `Judgement.inject` picks the tools
that are handed to the model (the best one and those within `inject_margin` of it). With a
cascade (`[cascade] screen`), a small screen model judges first and settles the clear "no tool"
texts, so only the rest reach the main model (`screen_pipeline`, `settle`; `sidecar cascade`
fits its cutoff: sidecar/lab/cascade.py). The engine imports nothing of the lab.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from .core import models
from .core.asks import split as split_asks
from .core.catalog import Catalog
from .config import Config, GateConfig
from .core.gate import Decision, Thresholds, Timing, Trigger, fires
from .store.metrics import MetricsStore, StringCaps
from .core.pipeline import Detected, Pipeline, Request, Views, from_config
from .recommend.filters import Context
from .recommend.recommender import Recommendation, Recommendations, Recommender
from .recommend.sequences import Rule, Sequences
from .store import Store, open_store


class Judgement(msgspec.Struct):
    """One judged text: the gate's decision and, when it fired, the recommender's ranking."""

    decision: Decision
    ranked: Recommendations | None = None
    vector: np.ndarray | None = None  # the text's embedding by the main model (None: the screen settled it, or a pattern blocked it)
    asks: list[Recommendation] = []  # a turn of several asks: the best tool of each further ask that needs one, in ask order
    around: list[tuple[Rule, Recommendation]] = []  # tools that usually come before or after an injected one (learned sequences)

    def inject(self, margin: float, most: int | None = None) -> list[Recommendation]:
        """The tools to hand the model: the top-ranked one and the runners-up within `margin`
        of its score (at most `most` of them), then, for a turn of several asks, the best tool
        of each ask in the order the asks come, then the tools learned to go with those (`around`).
        Each tool once; the turn's own best stays first, so a turn split where it asks one thing
        ("open the file and show me what is in it") loses nothing. Empty when the gate did not fire."""
        picks = self.picks(margin, most)
        seen = {r.tool for r in picks}
        return [*picks, *(r for rule, r in self.around if rule.anchor in seen and r.tool not in seen and not seen.add(r.tool))]

    def picks(self, margin: float, most: int | None = None) -> list[Recommendation]:
        """What the text itself asks for: the ranked tools within `margin` and each ask's best."""
        if not self.decision.fired or self.decision.tier is None or self.ranked is None or not self.ranked.results:
            return []
        bar = self.ranked.results[0].score - margin
        seen: set[str] = set()
        top = [r for r in self.ranked.results if r.score >= bar][:most]
        return [r for r in [*top, *self.asks] if r.tool not in seen and not seen.add(r.tool)]

    @property
    def first(self) -> str | None:
        """The tool injected first (None: nothing is injected)."""
        tools = self.inject(0.0)
        return tools[0].tool if tools else None


SETTLED_PATH = "fallback:screen"  # a fallback-path text the screen settled (gate.path_kind: "fallback")


class CascadeStats:
    """Texts the screen judged: settled as "no tool" or passed on to the main model. Shared by
    an engine and the engines `with_catalog` derives from it, so /metrics counts them all."""

    def __init__(self) -> None:
        self.settled = 0
        self.passed = 0


class Sidecar:
    """The store, the model behind the pipeline, the call history and the recommender, built
    once. `with_catalog` derives an engine for another catalog sharing all of them. `screen`:
    the cascade's first stage (None: every text goes to the main pipeline)."""

    def __init__(self, cfg: Config, pipeline: Pipeline, store: Store | None, history: MetricsStore | None,
                 screen: Pipeline | None = None, stats: CascadeStats | None = None, persist: bool = True):  # fmt: skip
        self.cfg = cfg
        self.pipeline = pipeline
        self.store = store
        self.history = history
        self.recommender = Recommender(pipeline, history, cfg.recommend)
        self.screen = screen
        self.cascade_stats = stats or CascadeStats()
        self.sequences = Sequences()  # which tools go together, learned from the call log (the server refreshes it)
        self._persist = persist

    @classmethod
    def open(cls, cfg: Config, *, catalog: Catalog | None = None, store: Store | None = None, progress: bool = True,
             history: bool | MetricsStore = True, cases: bool = True, at_once: bool = False) -> Sidecar:  # fmt: skip
        """Everything the config names, loaded and validated. `history=False`: rank without the
        call history (what a labelled set is judged with: it has none); a MetricsStore: that one
        (a caller that records calls before the model has loaded). `cases=False`: written
        cases are added later; `at_once`: the tools not in the store too (`pipeline.from_config`)."""
        store = store if store is not None else open_store(cfg.store)
        pipe = from_config(cfg, catalog=catalog, store=store, progress=progress, cases=cases, at_once=at_once)
        first = screen_pipeline(cfg, pipe, progress)
        if history is True:
            history = open_history(cfg, store)
        return cls(cfg, pipe, store, history or None, first)

    @property
    def catalog(self) -> Catalog:
        return self.pipeline.catalog

    def with_catalog(self, catalog: Catalog, persist: bool = True, beside: bool = False) -> Sidecar:
        """The same engine over `catalog`: only tools the index does not have are embedded
        (kept in the store unless not `persist`: a session's own tools leave nothing behind).
        The screen, if any, follows it onto the same catalog. `beside`: embedded on the models'
        second contexts (`Pipeline.with_catalog`)."""
        first = self.screen.with_catalog(catalog, persist, beside) if self.screen is not None else None
        derived = Sidecar(self.cfg, self.pipeline.with_catalog(catalog, persist, beside), self.store, self.history, first, self.cascade_stats,
                          persist)  # fmt: skip
        derived.sequences = self.sequences
        return derived

    def detect_batch(self, requests: Sequence[Request]) -> Detected:
        """The gate's decisions (and query vectors and views) for every request: the main
        pipeline's, or with a cascade, the screen's for the fallback-path texts it settles and
        the main pipeline's for the rest (a settled text has no main-model vector nor views: it
        did not fire)."""
        if self.screen is None or not requests:
            return self.pipeline.detect_batch(requests)
        if self.screen.catalog is not self.pipeline.catalog:  # reindexed in place (live MCP servers)
            self.screen.reindex(self.pipeline.catalog, self._persist)
        asked = [i for i, r in enumerate(requests) if self.pipeline.route(r).kind == "fallback"]
        first = self.screen.detect_batch([requests[i] for i in asked]) if asked else Detected([], [])
        decisions: list[Decision | None] = [None] * len(requests)
        for i, d in zip(asked, first.decisions):
            decisions[i] = settle(d, self.cfg.cascade.reject_below)
        rest = [i for i, d in enumerate(decisions) if d is None]
        main = self.pipeline.detect_batch([requests[i] for i in rest]) if rest else Detected([], [])
        vectors: list[np.ndarray | None] = [None] * len(requests)
        views: list[Views | None] = [None] * len(requests)
        for i, d, v, w in zip(rest, main.decisions, main.vectors, main.views):
            decisions[i], vectors[i], views[i] = d, v, w
        for i, d in zip(asked, first.decisions):  # a text passed on also cost the screen's time
            if decisions[i].path != SETTLED_PATH:
                _add_time(decisions[i].timing_ms, d.timing_ms)
        settled = len(requests) - len(rest)
        self.cascade_stats.settled += settled
        self.cascade_stats.passed += len(asked) - settled
        return Detected(decisions, vectors, views)  # type: ignore[arg-type]

    def settle(self, request: Request, within: float) -> Judgement | None:
        """The judgement of a text the patterns block, when they say so within `within`
        seconds of CPU time (`Pipeline.settle`); None: it waits for `judge`. What `judge` would
        say of it: blocked, it has no vector, no ranking and no asks that could join an inject."""
        decision = self.pipeline.settle(request, within)
        return None if decision is None else Judgement(decision)

    def judge(self, requests: Sequence[Request], contexts: Sequence[Context] | None = None, top: int | None = None,
              rank_silent: bool = False) -> list[Judgement]:  # fmt: skip
        """Gate every request and each ask of a user turn of several (`asks.split`) in one
        batched embedding, then rank the tools for those that fired, each in its own context
        (who asks, what it may be offered), on the views the gate scored. A silent turn with an
        ask that fires takes its strongest ask's decision: a request among chatter reads, whole,
        like talk. The best tool of each firing ask then joins its turn's inject (a reply clause
        is one ask already; a turn of one ask is untouched). `rank_silent`: rank the silent ones
        too (what `eval` scores a ranking on); they still inject nothing."""
        asks = self._asks(requests)
        detected = self.detect_batch([*requests, *(Request(a, "user", requests[i].prior) for i, a in asks)])
        top = top or self.cfg.server.max_inject_tools
        n = len(requests)
        decisions, ask_decisions = list(detected.decisions[:n]), detected.decisions[n:]
        firing = self._firing_asks(asks, ask_decisions)
        for i, k in _strongest(asks, firing, ask_decisions).items():
            if not decisions[i].fired:
                decisions[i] = _within(ask_decisions[k], requests[i].text, asks[k][1])
        out = []
        for i, (r, d, vector, views) in enumerate(zip(requests, decisions, detected.vectors, detected.views)):
            ranked = None
            if d.fired or rank_silent:
                ranked = self.recommender.recommend(r.text, self._context(contexts, i, r.source), top=top, query_vector=vector, views=views)
            out.append(Judgement(d, ranked, vector))
        for k in firing:  # each one's turn fired: by itself, or on its strongest ask above
            i, ask = asks[k]
            best = self.recommender.recommend(ask, self._context(contexts, i, "user"), top=1, query_vector=detected.vectors[n + k],
                                              views=detected.views[n + k])  # fmt: skip
            out[i].asks.extend(best.results[:1])
        if self.sequences.rules:
            for request, j in zip(requests, out):
                picks = j.picks(self.cfg.server.margin_for(request.source), top)
                j.around = [(rule, Recommendation(rule.tool, r.score, rule.why, r.factors, _relevance_of(j, rule.tool))) for r in picks
                            for rule in self.sequences.around(r.tool)]  # fmt: skip
        return out

    def _firing_asks(self, asks: Sequence[tuple[int, str]], decisions: Sequence[Decision]) -> list[int]:
        """The places in `asks` of those that fire: past the gate and, under a lesson, past
        the thresholds without it (`_ask_thresholds`)."""
        unlearned = self._ask_thresholds() if asks else None
        return [k for k, d in enumerate(decisions)
                if d.fired and (unlearned is None or fires([d.kind], np.array([d.score]), unlearned, [d.tool])[0])]  # fmt: skip

    def _ask_thresholds(self) -> Thresholds | None:
        """What an ask must pass to add its tool, beyond the thresholds in force: with a lesson
        from traffic that set its own bar, the thresholds without it (None: nothing more). A
        lesson fits its bar on whole turns, where what fires is mostly the turn's own best tool;
        a turn's sentences one by one are mostly statements ("It's a one-way flight for just
        me"), and at a lesson's bar they fired for 1 right tool in 18 (tau-bench airline,
        learned from its first half)."""
        pipe = self.pipeline
        if pipe.learned is None or pipe.learned.bar is None:
            return None
        return pipe.thresholds_without_lesson[0]

    @staticmethod
    def _context(contexts: Sequence[Context] | None, i: int, source: str) -> Context:
        return msgspec.structs.replace(contexts[i] if contexts is not None else Context(), source=source)

    def _asks(self, requests: Sequence[Request]) -> list[tuple[int, str]]:
        """The asks of each user turn of several (`asks.split`), with their turn's place; none
        with `server.split_asks` off. They are embedded with their turn whether or not it fires:
        a second call would cost the model's weights read again (with nomic, ~40 ms however
        short the texts), more than the asks' own tokens."""
        if not self.cfg.server.split_asks:
            return []
        return [(i, a) for i, r in enumerate(requests) if r.source == "user" and len(asks := split_asks(r.text)) > 1 for a in asks]

    def embed_beside(self, texts: Sequence[str]) -> None:
        """Embed user turns into the query caches, on the models' second contexts (this
        thread's), so judging them later costs the model thread their scoring only. One turn
        of 512 tokens is 80-130 ms of MiniLM that no batch can split, and a span of another
        session arriving meanwhile waited for all of it (issue 33). The asks a turn splits
        into go too (`judge` embeds them with the turn). Nothing is kept with the cache off."""
        texts = [*texts, *(a for _, a in self._asks([Request(t, "user") for t in texts]))]
        for pipe in filter(None, (self.screen, self.pipeline)):
            if pipe.queries.size:
                with pipe.embedder.beside():
                    pipe.queries.embed(pipe.embedder, texts)

    def rank(self, request: Request, top: int = 10, *, vector: np.ndarray | None = None, context: Context | None = None,
             mode: str | None = None) -> Recommendations:  # fmt: skip
        """The recommender's ranking whether or not the gate would fire: a tool search on
        demand (`sidecar recommend`), and what `eval` scores."""
        ctx = msgspec.structs.replace(context or Context(), source=request.source)
        return self.recommender.recommend(request.text, ctx, top=top, mode=mode, query_vector=vector)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def _strongest(asks: Sequence[tuple[int, str]], firing: Sequence[int], decisions: Sequence[Decision]) -> dict[int, int]:
    """Of each turn's firing asks, the one its gate scored highest (the first of equals):
    turn -> place in `asks`. `decisions` are the asks' own."""
    best: dict[int, int] = {}
    for k in firing:
        i = asks[k][0]
        if i not in best or (decisions[k].score or 0.0) > (decisions[best[i]].score or 0.0):
            best[i] = k
    return best


def _within(d: Decision, turn: str, ask: str) -> Decision:
    """An ask's decision as its turn's: its trigger moved to where the ask stands in the turn."""
    at = max(turn.find(ask), 0)
    trig = d.trigger or Trigger(ask, 0, len(ask))
    return msgspec.structs.replace(d, trigger=Trigger(trig.text, at + trig.start, at + trig.end))


def _relevance_of(j: Judgement, tool: str) -> float:
    """A tool added for going with an injected one: its own relevance to the text where the
    ranking has it, else 0 (the text did not ask for it; its `why` says what did)."""
    ranked = j.ranked.results if j.ranked is not None else ()
    return next((r.relevance for r in ranked if r.tool == tool), 0.0)


def _add_time(to: Timing, extra: Timing) -> None:
    to.regex += extra.regex
    to.embed += extra.embed
    to.cosine += extra.cosine
    to.total = to.regex + to.embed + to.cosine


def open_history(cfg: Config, store: Store) -> MetricsStore:
    """The metrics store with the server's caps on stored strings and its bound on waiting
    for another process's write lock."""
    lim = cfg.server
    caps = StringCaps(agent=lim.max_agent_chars, query=lim.max_query_chars, error=lim.max_error_chars, name=lim.max_name_chars)
    return MetricsStore(store, cfg.recommend.metrics_retention_days, caps=caps, write_timeout_s=lim.store_busy_timeout_ms / 1000)


def screen_pipeline(cfg: Config, main: Pipeline, progress: bool = True) -> Pipeline | None:
    """The cascade's screen: the screen model's pipeline over `main`'s catalog and store, or
    None when the cascade is off or would only repeat the main model. It runs on the screen
    model's built-in calibration (the config's calibration file, thresholds and index
    strategies are the main model's) and shares `main`'s patterns, so one pattern set and one
    timeout count serve both. A text on a high-pattern path is never settled (its bar is lower,
    and the pattern already says it asks for something); a negative-pattern block needs no
    embedding in either model."""
    name = cfg.cascade.screen
    if not name or models.base_name(name) == models.base_name(main.embedder.name):
        return None
    gate = GateConfig(patterns=cfg.gate.patterns, regex_timeout_ms=cfg.gate.regex_timeout_ms)
    own = msgspec.structs.replace(
        cfg,
        model=msgspec.structs.replace(cfg.model, name=name, task_prefixes="auto"),
        gate=gate,
        index=msgspec.structs.replace(cfg.index, user_strategy=None, llm_strategy=None),
        calibration=None,
    )
    screen = from_config(own, catalog=main.catalog, store=main.store, progress=progress)
    if screen.head is None:  # a probability cutoff needs the model's gate head
        raise ValueError(f"cascade.screen={name!r} has no built-in calibration with a gate head")
    screen.patterns = main.patterns
    return screen


def settle(d: Decision, reject_below: float) -> Decision | None:
    """The screen's decision as the final one when it settles the text as "no tool": on the
    fallback path, not fired, and its probability under `reject_below`. Its path says so
    (SETTLED_PATH), its threshold is the cutoff; tool, score and candidates are the screen's."""
    if d.kind != "fallback" or d.fired or d.score is None or not d.score < reject_below:
        return None
    return msgspec.structs.replace(d, path=SETTLED_PATH, threshold=reject_below, tier=None, fired=False)
