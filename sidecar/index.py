"""The semantic index: every tool's rendered case texts as unit vectors, searched by cosine.

A tool scores the maximum over its rows, so one well-phrased case is enough to match.
Rows of one tool are contiguous, which makes the per-tool maximum a single
`np.maximum.reduceat` over the similarity matrix.
"""

from __future__ import annotations

import time

import msgspec
import numpy as np

from . import cases as cases_mod
from .cases import Strategy
from .catalog import Catalog
from .embed import Embedder, Kind
from .store import Store, text_key


class IndexStats(msgspec.Struct):
    tools: int
    rows: int
    embedded: int  # texts sent to the model
    cached: int  # texts found in the store or a previous index
    added: int = 0
    updated: int = 0
    removed: int = 0
    unchanged: int = 0
    seconds: float = 0.0


class _Entry(msgspec.Struct):
    hash: str
    cases: list[str]
    texts: list[str]
    vectors: np.ndarray
    primary: np.ndarray  # the tool as one text: "name words: description"


PRIMARY_CHARS = 1000  # what a description says first is what it is for; the rest costs time


def primary_text(tool) -> str:
    """The tool's one-text view: its name as words, then what it does (the description's
    head: on these 2 cores nomic embeds a 2,048-token description in ~1 s, its first 1,000
    characters in a quarter of that)."""
    words = cases_mod.name_words(tool.bare_name)
    description = " ".join((tool.description or "").split())[:PRIMARY_CHARS]
    return f"{words}: {description}" if description else words


def embed_cached(embedder: Embedder, store: Store | None, texts: list[str], kind: Kind, batch: int = 64) -> tuple[dict[str, np.ndarray], int]:
    """Vectors of distinct texts, from the store's cache where it has them (keyed by the
    model's identity and the exact text embedded); the rest embedded in batches and cached.
    Returns (text -> vector, how many were embedded)."""
    keys = {t: text_key(embedder.prefixed(t, kind)) for t in texts}
    cached = store.vectors(embedder.identity, set(keys.values())) if store else {}
    missing = [t for t in keys if keys[t] not in cached]
    for lo in range(0, len(missing), batch):
        chunk = missing[lo : lo + batch]
        new = {keys[t]: v for t, v in zip(chunk, embedder.embed(chunk, kind).vectors)}
        cached.update(new)
        if store:
            store.put_vectors(embedder.identity, new)
    return {t: cached[k] for t, k in keys.items()}, len(missing)


class ToolIndex:
    def __init__(self, strategy: Strategy, entries: dict[str, _Entry], dim: int):
        self.strategy = strategy
        self.entries = entries
        self.names = list(entries)
        self.dim = dim
        texts: list[str] = []
        starts: list[int] = []
        row_tool: list[int] = []
        for i, name in enumerate(self.names):
            starts.append(len(texts))
            texts.extend(entries[name].texts)
            row_tool.extend([i] * len(entries[name].texts))
        self.texts = texts
        self.starts = np.asarray(starts, dtype=np.int64)
        self.row_tool = np.asarray(row_tool, dtype=np.int64)
        blocks = [entries[n].vectors for n in self.names]
        self.matrix = np.ascontiguousarray(np.vstack(blocks) if blocks else np.zeros((0, dim), np.float32), dtype=np.float32)
        prim = [entries[n].primary for n in self.names]
        self.primary = np.ascontiguousarray(np.vstack(prim) if prim else np.zeros((0, dim), np.float32), dtype=np.float32)
        self.stats: IndexStats | None = None

    def __len__(self) -> int:
        return len(self.names)

    @classmethod
    def build(
        cls,
        catalog: Catalog,
        embedder: Embedder,
        strategy: Strategy,
        store: Store | None = None,
        previous: ToolIndex | None = None,
    ) -> ToolIndex:
        """Index a catalog, embedding only texts neither `previous` nor the store has."""
        t0 = time.perf_counter()
        prev = previous.entries if previous is not None and previous.strategy == strategy else {}
        plans: dict[str, tuple[str, list[str], list[str], str]] = {}
        added = updated = unchanged = 0
        for tool in catalog:
            h = tool.content_hash
            old = prev.get(tool.name)
            if old is not None and old.hash == h:
                unchanged += 1
                continue
            added, updated = (added + 1, updated) if old is None else (added, updated + 1)
            derived = cases_mod.derive(tool)
            plans[tool.name] = (h, derived, strategy.render(tool, derived), primary_text(tool))
        wanted = list(dict.fromkeys(t for _, _, texts, p in plans.values() for t in [*texts, p]))
        found, missing = embed_cached(embedder, store, wanted, "document")
        entries: dict[str, _Entry] = {}
        for tool in catalog:
            if tool.name in plans:
                h, derived, texts, prim = plans[tool.name]
                entries[tool.name] = _Entry(h, derived, texts, np.vstack([found[t] for t in texts]), found[prim])
            else:
                entries[tool.name] = prev[tool.name]
        index = cls(strategy, entries, embedder.dim)
        index.stats = IndexStats(
            tools=len(entries),
            rows=len(index.texts),
            embedded=missing,
            cached=len(wanted) - missing,
            added=added,
            updated=updated,
            removed=len(set(prev) - set(entries)),
            unchanged=unchanged,
            seconds=time.perf_counter() - t0,
        )
        return index

    def _similarities(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Row cosines (n, rows) and each tool's best row cosine (n, tools)."""
        sims = np.atleast_2d(queries) @ self.matrix.T
        if not self.names:
            return sims, sims[:, :0]
        return sims, np.maximum.reduceat(sims, self.starts, axis=1)

    def views(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(n_queries, n_tools) twice: cosine to each tool's one-text view, and each tool's
        best cosine over its case rows."""
        q = np.atleast_2d(queries)
        return q @ self.primary.T, self.tool_scores(q)

    def tool_scores(self, queries: np.ndarray) -> np.ndarray:
        """(n_queries, n_tools): each tool's best cosine over its rows."""
        return self._similarities(queries)[1]

    def closest_case(self, tool: int, query: np.ndarray) -> str:
        """The tool's indexed text closest to the query."""
        lo = int(self.starts[tool])
        hi = int(self.starts[tool + 1]) if tool + 1 < len(self.starts) else len(self.texts)
        return self.texts[lo + int(np.argmax(self.matrix[lo:hi] @ query))]
