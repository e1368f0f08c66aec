"""Lexical tool search over name + description: BM25 and TF-IDF.

What other MCP gateways ship as "tool search", kept here both as a baseline for `eval` and
as the recommender's lexical mode. Small enough that a dependency would weigh more.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import regex

from .catalog import Catalog, Tool

_WORD = regex.compile(r"[\p{L}\p{N}]+")
# Function words carry no signal about which tool is meant.
STOPWORDS = frozenset(
    "a an and are as at be by can do does for from how i in is it its me my of on or our please "
    "that the this to us was we what when which will with you your".split()
)


def tokens(text: str) -> list[str]:
    """Lower-cased words; snake_case and camelCase names split into their words."""
    text = regex.sub(r"(?<=\p{Ll})(?=\p{Lu})", " ", text).replace("_", " ")
    return [w for w in (m.lower() for m in _WORD.findall(text)) if w not in STOPWORDS]


def tool_text(tool: Tool) -> str:
    return f"{tool.bare_name} {tool.title or ''} {tool.description}"


class LexicalIndex:
    """One document per tool. `kind` is "bm25" (k1=1.2, b=0.75) or "tfidf" (cosine)."""

    def __init__(self, catalog: Catalog, kind: str = "bm25", k1: float = 1.2, b: float = 0.75):
        if kind not in ("bm25", "tfidf"):
            raise ValueError(f"unknown lexical index {kind!r}: use bm25 or tfidf")
        self.kind, self.k1, self.b = kind, k1, b
        self.names = [t.name for t in catalog]
        docs = [Counter(tokens(tool_text(t))) for t in catalog]
        self.vocab = {w: i for i, w in enumerate(sorted({w for d in docs for w in d}))}
        n = len(docs)
        tf = np.zeros((n, len(self.vocab)), np.float32)
        for r, d in enumerate(docs):
            for w, c in d.items():
                tf[r, self.vocab[w]] = c
        df = (tf > 0).sum(axis=0)
        if kind == "bm25":
            self.idf = np.log(1 + (n - df + 0.5) / (df + 0.5)).astype(np.float32)
            lengths = tf.sum(axis=1, keepdims=True)
            avg = float(lengths.mean()) if n else 1.0
            self.weights = tf * (k1 + 1) / (tf + k1 * (1 - b + b * lengths / max(avg, 1e-9)))
        else:
            self.idf = (np.log((1 + n) / (1 + df)) + 1).astype(np.float32)
            w = (1 + np.log(np.where(tf > 0, tf, 1))) * (tf > 0) * self.idf
            norms = np.linalg.norm(w, axis=1, keepdims=True)
            self.weights = w / np.where(norms == 0, 1, norms)

    def scores(self, query: str) -> np.ndarray:
        q = np.zeros(len(self.vocab), np.float32)
        for w, c in Counter(tokens(query)).items():
            if (i := self.vocab.get(w)) is not None:
                q[i] = c
        if self.kind == "bm25":
            return self.weights @ (np.minimum(q, 1) * self.idf)
        q = (1 + np.log(np.where(q > 0, q, 1))) * (q > 0) * self.idf
        norm = float(np.linalg.norm(q))
        return self.weights @ (q / norm) if norm else np.zeros(len(self.names), np.float32)

    def rank(self, query: str, k: int = 10) -> list[tuple[str, float]]:
        s = self.scores(query)
        k = min(k, len(s))
        if not k:
            return []
        top = np.argpartition(-s, k - 1)[:k] if k < len(s) else np.arange(len(s))
        top = top[np.argsort(-s[top], kind="stable")]
        return [(self.names[i], float(s[i])) for i in top]

    def rank_many(self, queries: Sequence[str], k: int = 10) -> list[list[tuple[str, float]]]:
        return [self.rank(q, k) for q in queries]
