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
    """One document per tool. `kind` is "bm25" (k1=1.2, b=0.75) or "tfidf" (cosine).

    Weights are kept per term (compressed columns: for term t, the tools
    `rows[ptr[t]:ptr[t+1]]` and their weights), so memory grows with the words the catalog
    uses, not with tools x vocabulary: 10,000 tools stay a few MB."""

    def __init__(self, catalog: Catalog, kind: str = "bm25", k1: float = 1.2, b: float = 0.75):
        if kind not in ("bm25", "tfidf"):
            raise ValueError(f"unknown lexical index {kind!r}: use bm25 or tfidf")
        self.kind, self.k1, self.b = kind, k1, b
        self.names = [t.name for t in catalog]
        docs = [Counter(tokens(tool_text(t))) for t in catalog]
        self.vocab = {w: i for i, w in enumerate(sorted({w for d in docs for w in d}))}
        n = len(docs)
        rows = np.fromiter((r for r, d in enumerate(docs) for _ in d), np.int64)
        cols = np.fromiter((self.vocab[w] for d in docs for w in d), np.int64)
        tf = np.fromiter((c for d in docs for c in d.values()), np.float32)
        df = np.bincount(cols, minlength=len(self.vocab)).astype(np.float32)
        if kind == "bm25":
            self.idf = np.log(1 + (n - df + 0.5) / (df + 0.5)).astype(np.float32)
            lengths = np.bincount(rows, weights=tf, minlength=n).astype(np.float32)
            avg = float(lengths.mean()) if n else 1.0
            w = tf * (k1 + 1) / (tf + k1 * (1 - b + b * lengths[rows] / max(avg, 1e-9)))
        else:
            self.idf = (np.log((1 + n) / (1 + df)) + 1).astype(np.float32)
            w = (1 + np.log(tf)) * self.idf[cols]
            norms = np.sqrt(np.bincount(rows, weights=w * w, minlength=n))
            w = w / np.where(norms == 0, 1, norms)[rows]
        order = np.argsort(cols, kind="stable")
        self._rows = rows[order]
        self._weights = w[order].astype(np.float32)
        self._ptr = np.concatenate([[0], np.cumsum(np.bincount(cols, minlength=len(self.vocab)))])

    def scores(self, query: str) -> np.ndarray:
        terms = {i: c for w, c in Counter(tokens(query)).items() if (i := self.vocab.get(w)) is not None}
        if self.kind == "bm25":
            q = {i: float(self.idf[i]) for i in terms}  # a repeated query word counts once
        else:
            q = {i: (1 + np.log(c)) * float(self.idf[i]) for i, c in terms.items()}
            norm = float(np.sqrt(sum(v * v for v in q.values())))
            q = {i: v / norm for i, v in q.items()} if norm else {}
        out = np.zeros(len(self.names), np.float32)
        for i, qw in q.items():
            lo, hi = self._ptr[i], self._ptr[i + 1]
            out[self._rows[lo:hi]] += self._weights[lo:hi] * qw  # a tool appears once per term
        return out

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
