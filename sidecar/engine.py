"""The engine: one `Sidecar`, built by `Sidecar.open` from a `Config`, is what every command,
the websocket server and the MCP server run on.

A text becomes an inject in exactly one place, `Sidecar.judge`: the pipeline's gate decides
whether the text needs a tool; when it fired, the recommender ranks the tools on the vector the
gate already made, with the history of the metrics store; `Judgement.inject` picks the tools
that are handed to the model (the best one and those within `inject_margin` of it).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from .catalog import Catalog
from .config import Config
from .gate import Decision
from .metrics import MetricsStore, StringCaps
from .pipeline import Pipeline, Request, from_config
from .recommend.filters import Context
from .recommend.recommender import Recommendation, Recommendations, Recommender
from .store import Store, open_store


class Judgement(msgspec.Struct):
    """One judged text: the gate's decision and, when it fired, the recommender's ranking."""

    decision: Decision
    ranked: Recommendations | None = None

    def inject(self, margin: float) -> list[Recommendation]:
        """The tools to hand the model, best first: the top-ranked one and the runners-up
        within `margin` of its score. Empty when the gate did not fire."""
        if not self.decision.fired or self.decision.tier is None or self.ranked is None or not self.ranked.results:
            return []
        bar = self.ranked.results[0].score - margin
        return [r for r in self.ranked.results if r.score >= bar]

    @property
    def first(self) -> str | None:
        """The tool injected first (None: nothing is injected)."""
        tools = self.inject(0.0)
        return tools[0].tool if tools else None


class Sidecar:
    """The store, the model behind the pipeline, the call history and the recommender, built
    once. `with_catalog` derives an engine for another catalog sharing all of them."""

    def __init__(self, cfg: Config, pipeline: Pipeline, store: Store | None, history: MetricsStore | None):
        self.cfg = cfg
        self.pipeline = pipeline
        self.store = store
        self.history = history
        self.recommender = Recommender(pipeline, history, cfg.recommend)

    @classmethod
    def open(cls, cfg: Config, *, catalog: Catalog | None = None, store: Store | None = None, progress: bool = True,
             history: bool | MetricsStore = True) -> Sidecar:  # fmt: skip
        """Everything the config names, loaded and validated. `history=False`: rank without the
        call history (what a labelled set is judged with: it has none); a MetricsStore: that one
        (a caller that records calls before the model has loaded)."""
        store = store if store is not None else open_store(cfg.store)
        pipe = from_config(cfg, catalog=catalog, store=store, progress=progress)
        if history is True:
            history = open_history(cfg, store)
        return cls(cfg, pipe, store, history or None)

    @property
    def catalog(self) -> Catalog:
        return self.pipeline.catalog

    def with_catalog(self, catalog: Catalog, persist: bool = True) -> Sidecar:
        """The same engine over `catalog`: only tools the index does not have are embedded
        (kept in the store unless not `persist`: a session's own tools leave nothing behind)."""
        return Sidecar(self.cfg, self.pipeline.with_catalog(catalog, persist), self.store, self.history)

    def judge(self, requests: Sequence[Request], contexts: Sequence[Context] | None = None, top: int | None = None) -> list[Judgement]:
        """Gate every request (one batched embedding), then rank the tools for those that fired,
        each in its own context (who asks, what it may be offered)."""
        judged = self.pipeline.judge_batch(requests)
        top = top or self.cfg.server.max_inject_tools
        out = []
        for i, (r, d, vector) in enumerate(zip(requests, judged.decisions, judged.vectors)):
            ranked = None
            if d.fired:
                ctx = contexts[i] if contexts is not None else Context()
                ranked = self.recommender.recommend(r.text, msgspec.structs.replace(ctx, source=r.source), top=top, query_vector=vector)
            out.append(Judgement(d, ranked))
        return out

    def rank(self, request: Request, top: int = 10, *, vector: np.ndarray | None = None, context: Context | None = None,
             mode: str | None = None) -> Recommendations:  # fmt: skip
        """The recommender's ranking whether or not the gate would fire: a tool search on
        demand (`sidecar recommend`), and what `eval` scores."""
        ctx = msgspec.structs.replace(context or Context(), source=request.source)
        return self.recommender.recommend(request.text, ctx, top=top, mode=mode, query_vector=vector)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def open_history(cfg: Config, store: Store) -> MetricsStore:
    """The metrics store with the server's caps on stored strings and its bound on waiting
    for another process's write lock."""
    lim = cfg.server
    caps = StringCaps(agent=lim.max_agent_chars, query=lim.max_query_chars, error=lim.max_error_chars, name=lim.max_name_chars)
    return MetricsStore(store, cfg.recommend.metrics_retention_days, caps=caps, write_timeout_s=lim.store_busy_timeout_ms / 1000)
