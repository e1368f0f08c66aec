"""The semantic index: every tool's rendered case texts as unit vectors, searched by cosine.

A tool scores the maximum over its rows, so one well-phrased case is enough to match.
Rows of one tool are contiguous, which makes the per-tool maximum a single
`np.maximum.reduceat` over the similarity matrix.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np
import orjson

from . import cases as cases_mod
from .cases import Strategy
from .catalog import Catalog
from .embed import Embedder
from .gate import Candidate
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
        plans: dict[str, tuple[str, list[str], list[str]]] = {}
        added = updated = unchanged = 0
        for tool in catalog:
            h = tool.content_hash
            old = prev.get(tool.name)
            if old is not None and old.hash == h:
                unchanged += 1
                continue
            added, updated = (added + 1, updated) if old is None else (added, updated + 1)
            derived = cases_mod.derive(tool)
            plans[tool.name] = (h, derived, strategy.render(tool, derived))
        wanted = {embedder.prefixed(t, "document") for _, _, texts in plans.values() for t in texts}
        keys = {t: text_key(t) for t in wanted}
        found = store.vectors(embedder.identity, keys.values()) if store else {}
        missing = [t for t in wanted if keys[t] not in found]
        if missing:
            fresh = embedder.embed(missing, "document")
            new = {keys[t]: v for t, v in zip(missing, fresh.vectors)}
            found.update(new)
            if store:
                store.put_vectors(embedder.identity, new)
        entries: dict[str, _Entry] = {}
        for tool in catalog:
            if tool.name in plans:
                h, derived, texts = plans[tool.name]
                vecs = np.vstack([found[keys[embedder.prefixed(t, "document")]] for t in texts])
                entries[tool.name] = _Entry(h, derived, texts, vecs)
            else:
                entries[tool.name] = prev[tool.name]
        index = cls(strategy, entries, embedder.dim)
        index.stats = IndexStats(
            tools=len(entries),
            rows=len(index.texts),
            embedded=len(missing),
            cached=len(wanted) - len(missing),
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

    def tool_scores(self, queries: np.ndarray) -> np.ndarray:
        """(n_queries, n_tools): each tool's best cosine over its rows."""
        return self._similarities(queries)[1]

    def search(self, queries: np.ndarray, k: int) -> list[list[Candidate]]:
        """Top-k tools per query, best first, each with the case text that matched."""
        sims, per_tool = self._similarities(queries)
        if not self.names:
            return [[] for _ in range(sims.shape[0])]
        k = min(k, per_tool.shape[1])
        out = []
        for qi in range(per_tool.shape[0]):
            row = per_tool[qi]
            top = np.argpartition(-row, k - 1)[:k] if k < row.shape[0] else np.arange(row.shape[0])
            top = top[np.argsort(-row[top], kind="stable")]
            cands = []
            for ti in top:
                lo = self.starts[ti]
                hi = self.starts[ti + 1] if ti + 1 < len(self.starts) else sims.shape[1]
                best_row = lo + int(np.argmax(sims[qi, lo:hi]))
                cands.append(Candidate(self.names[ti], round(float(row[ti]), 4), self.texts[best_row]))
            out.append(cands)
        return out

    # Export / import: the study's storage format, one vector per case text.
    def export(self, model: str, threshold: float | None = None) -> dict[str, Any]:
        tools = {}
        for name, e in self.entries.items():
            tools[name] = {
                "hash": e.hash,
                "cases": e.texts,
                "vector": [[round(float(x), 7) for x in v] for v in e.vectors],  # one per case, in order
            }
        return {"model": model, "strategy": str(self.strategy), "threshold": threshold, "dim": self.dim, "tools": tools}

    def dumps(self, model: str, threshold: float | None = None) -> bytes:
        return orjson.dumps(self.export(model, threshold))

    @classmethod
    def loads(cls, data: bytes | dict[str, Any], catalog: Catalog | None = None) -> tuple[ToolIndex, str]:
        """Rebuild an exported index; returns (index, model). Tools missing from `catalog` are dropped."""
        doc = orjson.loads(data) if isinstance(data, (bytes, str)) else data
        try:
            strategy = Strategy.parse(doc["strategy"])
            dim = int(doc["dim"])
            entries = {}
            for name, t in doc["tools"].items():
                if catalog is not None and catalog.get(name) is None:
                    continue
                vecs = np.asarray(t["vector"] if "vector" in t else t["vectors"], dtype=np.float32).reshape(len(t["cases"]), dim)
                entries[name] = _Entry(t.get("hash", ""), [], list(t["cases"]), vecs)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not an exported index: {e}") from None
        return cls(strategy, entries, dim), doc["model"]

