"""Lexical tool search: BM25 and TF-IDF over a tool's name, title, description and
parameter names.

What other MCP gateways ship as "tool search", kept here both as a baseline for `eval` and
as the recommender's lexical mode. Small enough that a dependency would weigh more.

Built on every start and every reindex (issue 12: 10,000 tools, ~4 MB of descriptions), so
the catalog is tokenised in bulk (one byte-level scan per text, one `lower()` over all its
words, the term counts as numpy arrays, not one Counter per tool), and, given a store, the
built arrays are kept there under a key of the catalog's texts, so a restart on the same
catalog reads them back instead of tokenising it again.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import pathlib
import weakref
from collections import Counter
from collections.abc import Sequence

import msgspec
import numpy as np
import regex

from .catalog import Catalog, Tool
from ..store import Store

_WORD = regex.compile(r"[\p{L}\p{N}]+")  # what a word is; "_" is not in it: snake_case splits
_CAMEL = regex.compile(r"(?<=\p{Ll})(?=\p{Lu})")
# Every ASCII byte that is not a letter or digit, as a space: in ASCII, [\p{L}\p{N}] is [A-Za-z0-9].
_ASCII_GAPS = bytes(c if chr(c).isascii() and chr(c).isalnum() or c >= 0x80 else 0x20 for c in range(256))
# Function words carry no signal about which tool is meant.
STOPWORDS = frozenset(
    "a an and are as at be by can do does for from how i in is it its me my of on or our please "
    "that the this to us was we what when which will with you your".split()
)


def words(text: str) -> list[str]:
    """The text's words (`_WORD` matches) with camelCase split, case kept. Scanned as bytes:
    ASCII punctuation and spaces become one gap, and only a chunk holding non-ASCII goes
    through `_WORD` (a regex scan of a whole 10,000-tool catalog costs ~0.3 s, this a fifth)."""
    split = _CAMEL.sub(" ", text)
    chunks = split.encode("utf-8", "surrogatepass").translate(_ASCII_GAPS).decode("utf-8", "surrogatepass").split()
    if split.isascii():
        return chunks
    return [w for c in chunks for w in ((c,) if c.isascii() else _WORD.findall(c))]


def tokens(text: str) -> list[str]:
    """Lower-cased words; snake_case and camelCase names split into their words."""
    return [w for w in map(str.lower, words(text)) if w not in STOPWORDS]


def _bulk_tokens(texts: Sequence[str]) -> tuple[list[str], np.ndarray]:
    """`tokens` of many texts at once, as (every text's words in order, stopwords still in;
    words per text). Lowering the words joined by NUL equals lowering each (NUL neither is
    a word character nor carries case, so even a final sigma lowers the same)."""
    per_text = list(map(words, texts))
    counts = np.fromiter(map(len, per_text), np.int64, count=len(per_text))
    joined = "\0".join(itertools.chain.from_iterable(per_text))
    return (joined.lower().split("\0") if counts.sum() else []), counts


def tool_text(tool: Tool) -> str:
    """What a tool is found by: its name, title, description and its parameters' names. A
    request names what it supplies ("48.85, 2.29" wants a latitude, "that page" a url), and
    with the names the ranker's top-1 rose on every set measured, its weights left as they
    were (nomic: BFCL live 57.6% -> 62.7%, BFCL synthetic 73.1% -> 75.4%, the corpus's
    held-out servers 66.0% -> 67.0%). The parameters' descriptions rose it a little more on
    those sets but carry examples ("e.g. 'Asia/Tokyo'") that outscore the tool a request is
    for ("what time is it in Tokyo" went to convert_time), so they stay out (docs/benchmarks.md)."""
    return " ".join([tool.bare_name, tool.title or "", tool.description, *parameter_names(tool)])


def parameter_names(tool: Tool) -> list[str]:
    """The top-level input parameters' names, in schema order (split into words like any text)."""
    props = tool.inputSchema.get("properties")
    return [str(name) for name in props] if isinstance(props, dict) else []


_SHARED: weakref.WeakKeyDictionary[Catalog, LexicalIndex] = weakref.WeakKeyDictionary()

SCHEMA = """
CREATE TABLE IF NOT EXISTS lexical_index (
    key      TEXT PRIMARY KEY,  -- _key(): the tools' names and texts, the parameters, this code
    built_at REAL NOT NULL,     -- the oldest go first past KEEP
    entry    BLOB NOT NULL      -- _Arrays, msgpack
);
"""
KEEP = 8  # catalogs kept (a 10,000-tool one is ~4 MB)


class _Arrays(msgspec.Struct, array_like=True):
    """A built index as the store keeps it: the vocabulary in id order, the arrays' bytes."""

    vocab: list[str]
    idf: bytes  # float32
    rows: bytes  # int64
    weights: bytes  # float32
    ptr: bytes  # int64


@functools.cache
def _code() -> bytes:
    """This module's code: a change to it makes stored indexes stale."""
    return hashlib.sha256(pathlib.Path(__file__).read_bytes()).digest()


def _key(catalog: Catalog, kind: str, k1: float, b: float) -> str:
    h = hashlib.sha256(_code() + f"{kind}|{k1!r}|{b!r}|{len(catalog)}".encode())
    h.update("\0".join(itertools.chain.from_iterable((t.name, tool_text(t)) for t in catalog)).encode("utf-8", "surrogatepass"))
    return h.hexdigest()


class LexicalIndex:
    """One document per tool. `kind` is "bm25" (k1=1.2, b=0.75) or "tfidf" (cosine).

    Weights are kept per term (compressed columns: for term t, the tools
    `rows[ptr[t]:ptr[t+1]]` and their weights), so memory grows with the words the catalog
    uses, not with tools x vocabulary: 10,000 tools stay a few MB."""

    @classmethod
    def bm25_of(cls, catalog: Catalog, store: Store | None = None) -> LexicalIndex:
        """The catalog's BM25 index, once per catalog object (the pipeline and the recommender
        share it); with a store, read from it when built there before, else built and kept."""
        index = _SHARED.get(catalog)
        if index is None:
            index = _SHARED[catalog] = cls.stored(catalog, store) if store is not None else cls(catalog, "bm25")
        return index

    @classmethod
    def stored(cls, catalog: Catalog, store: Store, kind: str = "bm25", k1: float = 1.2, b: float = 0.75) -> LexicalIndex:
        """The index the store keeps for exactly these tools (same arrays as a build), else
        built and kept there; a store busy past its bound only costs the keeping."""
        key = _key(catalog, kind, k1, b)
        store.ensure_schema(SCHEMA)
        found = store.built("lexical_index", key)
        if found is not None:
            row = msgspec.msgpack.decode(found, type=_Arrays)
            index = cls.__new__(cls)
            index.kind, index.k1, index.b = kind, k1, b
            index.names = [t.name for t in catalog]
            index.vocab = {w: i for i, w in enumerate(row.vocab)}
            index.idf = np.frombuffer(row.idf, np.float32)
            index._rows = np.frombuffer(row.rows, np.int64)
            index._weights = np.frombuffer(row.weights, np.float32)
            index._ptr = np.frombuffer(row.ptr, np.int64)
            index.origin = "store"
            return index
        index = cls(catalog, kind, k1, b)
        entry = msgspec.msgpack.encode(_Arrays(list(index.vocab), index.idf.tobytes(), index._rows.astype(np.int64).tobytes(),
                                               index._weights.tobytes(), index._ptr.astype(np.int64).tobytes()))  # fmt: skip
        store.keep_built("lexical_index", key, entry, KEEP)
        return index

    def __init__(self, catalog: Catalog, kind: str = "bm25", k1: float = 1.2, b: float = 0.75):
        if kind not in ("bm25", "tfidf"):
            raise ValueError(f"unknown lexical index {kind!r}: use bm25 or tfidf")
        self.kind, self.k1, self.b = kind, k1, b
        self.origin = "built"  # or "store": read back by `stored`
        self.names = [t.name for t in catalog]
        n = len(self.names)
        all_words, per_doc = _bulk_tokens([tool_text(t) for t in catalog])
        distinct = dict.fromkeys(all_words)
        self.vocab = {w: i for i, w in enumerate(sorted(w for w in distinct if w not in STOPWORDS))}
        stop = len(self.vocab)  # every stopword's id, dropped below
        ids_of = self.vocab | {w: stop for w in distinct if w in STOPWORDS}
        ids = np.fromiter(map(ids_of.__getitem__, all_words), np.int64, count=len(all_words))
        docs = np.repeat(np.arange(n, dtype=np.int64), per_doc)
        keep = ids != stop
        # (tool, term) pairs with their counts, in order of first use (a Counter's order per
        # tool: sums over a tool's terms then add up in the same order as term by term).
        pairs, first, counts = np.unique(docs[keep] * (stop + 1) + ids[keep], return_index=True, return_counts=True)
        order = np.argsort(first)
        rows, cols = np.divmod(pairs[order], stop + 1)
        counts = counts[order]
        tf = counts.astype(np.float32)
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
