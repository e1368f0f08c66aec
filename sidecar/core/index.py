"""The semantic index: every tool's rendered case texts as unit vectors, searched by cosine.

A tool scores the maximum over its rows, so one well-phrased case is enough to match. When
the catalog's tools carry their own `cases` (an intent catalog), the index also fits a softmax
classifier over the tools on those rows (`learned.Classifier`): the ranker's fourth view.
Rows of one tool are contiguous, which makes the per-tool maximum a single
`np.maximum.reduceat` over the similarity matrix.

At scale (issue 12: 10,000 tools), a build touches only tools whose content hash is new: a
tool the previous index has is reused, one the store has indexed before (same model, same
strategy, same derivation code) is read back whole from `index_rows` - its derived cases,
texts and vectors in one blob, so a restart neither derives cases (~0.35 ms a tool) nor
looks up each text - and only the rest is derived and embedded, in batches, missing texts
first looked up in the embedding cache. A query's products with the index run on one BLAS
thread (`one_blas_thread`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import pathlib
import threading
import time

import msgspec
import numpy as np

from .. import __version__
from . import cases as cases_mod
from .. import progress as progress_mod
from .cases import Strategy
from .catalog import Catalog
from .embed import BULK_TEXTS, Embedder, Kind
from ..learn import learned as learned_mod
from ..learn.learned import Classifier, ClassifierFit, Examples
from ..store import Store, StoreBusy, text_key


class IndexStats(msgspec.Struct):
    tools: int
    rows: int
    embedded: int  # texts sent to the model
    cached: int  # texts found in the store (embedding cache or stored rows)
    stored: int = 0  # tools read back whole from the store's index rows
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
    primary_text: str = ""


class _Row(msgspec.Struct, array_like=True):
    """One tool's entry as `index_rows` keeps it (msgpack): the vectors of its texts, then of
    its primary text, float32 rows."""

    cases: list[str]
    texts: list[str]
    primary_text: str
    vectors: bytes


ROWS_SCHEMA = """
CREATE TABLE IF NOT EXISTS index_rows (
    model     TEXT NOT NULL,  -- the embedder's identity (content hash of the weights)
    scheme    TEXT NOT NULL,  -- rows_scheme(): strategy, document prefix, derivation code
    tool_hash TEXT NOT NULL,  -- Tool.content_hash
    entry     BLOB NOT NULL,  -- _Row, msgpack
    PRIMARY KEY (model, scheme, tool_hash)
);
"""
_CHUNK = 500  # hashes per SELECT ... IN (...)


PRIMARY_CHARS = 500  # what a description says first is what it is for; the rest costs time


def primary_text(tool) -> str:
    """The tool's one-text view: its name as words, then what it does (the description's
    head: what follows is usage notes, which cost time and not quality: on ALL.json's
    held-out requests a head of 500 characters ranked and gated as 1,000 did, within 0.1
    point, with a tenth fewer characters to embed; docs/benchmarks.md "Ready on a cold store")."""
    words = cases_mod.name_words(tool.bare_name)
    description = " ".join((tool.description or "").split())[:PRIMARY_CHARS]
    return f"{words}: {description}" if description else words


def embed_cached(embedder: Embedder, store: Store | None, texts: list[str], kind: Kind, batch: int = 64,
                 persist: bool = True, progress: str | None = None) -> tuple[dict[str, np.ndarray], int]:  # fmt: skip
    """Vectors of distinct texts, from the store's cache where it has them (keyed by the
    model's identity and the exact text embedded); the rest embedded in batches and cached
    (unless not `persist`: a client's own tools are not kept past its session).
    Returns (text -> vector, how many were embedded). A job of BULK_TEXTS or more runs on the
    embedder's bulk threads (every core). `progress`: the label of a bar on stderr counting
    the texts embedded (shown only when some are: a cached catalog loads silently)."""
    keys = {t: text_key(embedder.prefixed(t, kind)) for t in texts}
    cached = store.vectors(embedder.identity, set(keys.values())) if store else {}
    missing = [t for t in keys if keys[t] not in cached]
    if not missing:  # no bar at all (importing its library is 20 ms of a warm start)
        return {t: cached[k] for t, k in keys.items()}, 0
    bulk = len(missing) >= BULK_TEXTS
    with progress_mod.bar(len(missing), progress or "", bool(progress and missing), unit="text") as shown:
        for lo in range(0, len(missing), batch):
            chunk = missing[lo : lo + batch]
            new = {keys[t]: v for t, v in zip(chunk, embedder.embed(chunk, kind, bulk).vectors)}
            cached.update(new)
            if store and persist:
                store.put_vectors(embedder.identity, new)
            shown.update(len(chunk))
    return {t: cached[k] for t, k in keys.items()}, len(missing)


@functools.cache
def _derivation() -> str:
    """What decides a tool's texts besides the tool: the code of cases.py and this module (a
    change to either makes stored rows stale), else the package version."""
    h = hashlib.sha256(__version__.encode())
    for mod in (cases_mod.__file__, __file__):
        try:
            h.update(pathlib.Path(mod).read_bytes())
        except OSError:
            pass
    return h.hexdigest()[:16]


def rows_scheme(embedder: Embedder, strategy: Strategy) -> str:
    return f"{strategy}|{embedder.prefixed('', 'document')}|{PRIMARY_CHARS}|{_derivation()}"


def _stored_entries(store: Store, model: str, scheme: str, hashes: list[str], dim: int) -> dict[str, _Entry]:
    """Entries the store has for these tool hashes."""
    store.ensure_schema(ROWS_SCHEMA)
    out: dict[str, _Entry] = {}
    decoder = msgspec.msgpack.Decoder(_Row)
    for lo in range(0, len(hashes), _CHUNK):
        chunk = hashes[lo : lo + _CHUNK]
        marks = ",".join("?" * len(chunk))
        rows = store.query(f"SELECT tool_hash, entry FROM index_rows WHERE model=? AND scheme=? AND tool_hash IN ({marks})",
                           [model, scheme, *chunk])  # fmt: skip
        for h, blob in rows:
            row = decoder.decode(bytes(blob))
            vecs = np.frombuffer(row.vectors, dtype=np.float32)
            if vecs.size != (len(row.texts) + 1) * dim:
                continue  # another dimension: not this model's after all
            vecs = vecs.reshape(len(row.texts) + 1, dim)
            out[h] = _Entry(h, row.cases, row.texts, vecs[:-1], vecs[-1], row.primary_text)
    return out


def stored_tools(catalog: Catalog, embedder: Embedder, strategy: Strategy, store: Store | None) -> set[str]:
    """Names of the catalog's tools whose rows the store holds for this model and strategy:
    what an index reads back without embedding (serve starts on them when many are not:
    serve/completion.py)."""
    if store is None:
        return set()
    store.ensure_schema(ROWS_SCHEMA)
    scheme, hashes = rows_scheme(embedder, strategy), list(dict.fromkeys(t.content_hash for t in catalog))
    found: set[str] = set()
    for lo in range(0, len(hashes), _CHUNK):
        chunk = hashes[lo : lo + _CHUNK]
        marks = ",".join("?" * len(chunk))
        found.update(h for (h,) in store.query(f"SELECT tool_hash FROM index_rows WHERE model=? AND scheme=? AND tool_hash IN ({marks})",
                                              [embedder.identity, scheme, *chunk]))  # fmt: skip
    return {t.name for t in catalog if t.content_hash in found}


def _store_entries(store: Store, model: str, scheme: str, entries: list[_Entry]) -> None:
    """Keep new entries for the next start; a store busy past its bound only costs that."""
    encoder = msgspec.msgpack.Encoder()
    rows = [(model, scheme, e.hash, encoder.encode(_Row(e.cases, e.texts, e.primary_text,
             np.vstack([e.vectors, e.primary[None, :]]).astype(np.float32).tobytes()))) for e in entries]  # fmt: skip
    if not rows:
        return
    store.ensure_schema(ROWS_SCHEMA)
    try:
        store.write(lambda tx: tx.executemany(
            """INSERT INTO index_rows AS cur VALUES (?,?,?,?) ON CONFLICT (model, scheme, tool_hash)
               DO UPDATE SET entry = excluded.entry""", rows))  # fmt: skip
    except StoreBusy:
        pass


@functools.cache
def _openblas_set_threads():
    """(set, get, threads at start) of the OpenBLAS numpy's wheels bundle, or None (another
    BLAS: left as it is)."""
    base = pathlib.Path(np.__file__).parent
    for lib in sorted([*base.parent.glob("numpy.libs/*openblas*"), *base.glob(".dylibs/*openblas*")]):
        try:
            found = ctypes.CDLL(str(lib))
        except OSError:
            continue
        for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
                     "openblas_set_num_threads"):  # fmt: skip
            getter = getattr(found, name.replace("set_num_threads", "get_num_threads"), None)
            if hasattr(found, name) and getter is not None:
                return getattr(found, name), getter, getter()
    return None


_blas_lock = threading.Lock()
_blas_users = 0
FEW_QUERIES = 64  # up to this many queries a product with the index is memory-bound


@contextlib.contextmanager
def one_blas_thread(queries: int):
    """A few queries against the index are matrix-vector products bound by memory: OpenBLAS
    spreading one over both cores of a loaded machine makes it ~10x slower (10,000 tools:
    median 12 vs 1.2 ms, p99 68 vs 16 ms), so for their span BLAS runs on one thread."""
    global _blas_users
    setter = _openblas_set_threads() if queries <= FEW_QUERIES else None
    if setter is None:
        yield
        return
    set_threads, _, default = setter
    with _blas_lock:
        _blas_users += 1
        set_threads(1)
    try:
        yield
    finally:
        with _blas_lock:
            _blas_users -= 1
            if not _blas_users:
                set_threads(default)


MIN_OWN_CASES = 5  # a tool with fewer own cases does not count towards a classifier
OWN_CASES_SHARE = 0.8  # of the tools must have MIN_OWN_CASES for the index to fit one
MAX_CLASSIFIER_TOOLS = 2000  # (dim, tools) weights and a fit in seconds; past it, no classifier
_classifiers: dict[tuple, Classifier] = {}  # the last few fits, by model and rows (a reindex of an unchanged catalog refits nothing)
CLASSIFIERS_SCHEMA = """
CREATE TABLE IF NOT EXISTS classifier_fits (
    key      TEXT PRIMARY KEY,  -- sha256 of classifier_for's key, ClassifierFit and its code
    built_at REAL NOT NULL,     -- the oldest go first past CLASSIFIERS_KEPT
    entry    BLOB NOT NULL      -- _Fit, msgpack
);
"""
CLASSIFIERS_KEPT = 8  # fits kept in the store (605 tools x 768 dims: 1.9 MB each)


class _Fit(msgspec.Struct, array_like=True):
    """A fitted Classifier as `classifier_fits` keeps it: float32 bytes."""

    dim: int
    tools: int
    coef: bytes  # (dim, tools)
    bias: bytes  # (tools,)


def wants_classifier(catalog: Catalog) -> bool:
    """Whether the catalog's own cases are enough to fit a classifier over its tools: most
    tools carry MIN_OWN_CASES of their own (derived cases are one phrasing of a description,
    nothing a classifier could learn from)."""
    n = len(catalog)
    own = sum(1 for t in catalog if t.cases and len(t.cases) >= MIN_OWN_CASES)
    return 2 <= n <= MAX_CLASSIFIER_TOOLS and own >= OWN_CASES_SHARE * n


def classifier_for(index: ToolIndex, model: str, examples: Examples | None = None, progress: bool = False,
                   store: Store | None = None, scheme: str = "") -> Classifier:  # fmt: skip
    """The softmax classifier over the index's tools, fitted on every tool's rows and on the
    `examples` asking for them (memoised; with a store, kept there too, keyed by what decides
    the rows: the model, `scheme` (rows_scheme) and the tools' content hashes, the examples,
    and the fit's parameters and code). A fit takes seconds (every `detect` on a catalog of
    cases did one, and `serve` one per start once the written cases were added): `progress`
    says so on stderr."""
    none = (np.zeros((0, index.dim), np.float32), np.zeros(0, int))
    extra, labels = examples.rows_for(index.names) if examples is not None else none
    asked = hashlib.sha256(extra.tobytes() + labels.tobytes()).hexdigest()
    key = (model, str(index.strategy), tuple(index.entries[n].hash for n in index.names), asked)
    if key not in _classifiers:
        while len(_classifiers) >= 4:
            _classifiers.pop(next(iter(_classifiers)))
        stored_key = hashlib.sha256(repr((key, scheme, ClassifierFit(), _fit_code())).encode()).hexdigest()
        fit = _stored_classifier(store, stored_key, index.dim, len(index.names)) if store is not None else None
        if fit is None:
            rows, row_tool = np.vstack([index.matrix, extra]), np.concatenate([index.row_tool, labels])
            progress_mod.note(f"fitting the classifier over {len(index.names)} tools' own cases ({len(rows)} texts)", progress)
            fit = ClassifierFit().fit(rows, row_tool, len(index.names))
            if store is not None:
                _store_classifier(store, stored_key, fit)
        _classifiers[key] = fit
    return _classifiers[key]


@functools.cache
def _fit_code() -> str:
    """The code of the fit (learn/learned.py): a change to it makes stored fits stale."""
    return hashlib.sha256(pathlib.Path(learned_mod.__file__).read_bytes()).hexdigest()


def _stored_classifier(store: Store, key: str, dim: int, tools: int) -> Classifier | None:
    store.ensure_schema(CLASSIFIERS_SCHEMA)
    found = store.built("classifier_fits", key)
    if found is None:
        return None
    row = msgspec.msgpack.decode(found, type=_Fit)
    if (row.dim, row.tools) != (dim, tools):
        return None
    return Classifier(np.frombuffer(row.coef, np.float32).reshape(dim, tools), np.frombuffer(row.bias, np.float32))


def _store_classifier(store: Store, key: str, fit: Classifier) -> None:
    """Keep a fit for the next start."""
    dim, tools = fit.coef.shape
    entry = msgspec.msgpack.encode(_Fit(dim, tools, np.ascontiguousarray(fit.coef, np.float32).tobytes(), np.asarray(fit.bias, np.float32).tobytes()))
    store.keep_built("classifier_fits", key, entry, CLASSIFIERS_KEPT)


class ToolIndex:
    def __init__(self, strategy: Strategy, entries: dict[str, _Entry], dim: int, classifier: Classifier | None = None):
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
        self.classifier = classifier  # None: the catalog has too few own cases (view is 0)

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
        persist: bool = True,
        examples: Examples | None = None,
        progress: bool = False,
    ) -> ToolIndex:
        """Index a catalog, embedding only texts neither `previous` nor the store has; with
        `persist`, what was embedded is kept in the store for the next start. `examples`:
        labelled requests its classifier (if it fits one) learns from too. `progress`: bars
        on stderr while texts are embedded (a 605-tool catalog takes minutes the first time)."""
        t0 = time.perf_counter()
        prev = previous.entries if previous is not None and previous.strategy == strategy else {}
        hashes = {tool.name: tool.content_hash for tool in catalog}
        added = updated = unchanged = 0
        todo = []
        for tool in catalog:
            old = prev.get(tool.name)
            if old is not None and old.hash == hashes[tool.name]:
                unchanged += 1
                continue
            added, updated = (added + 1, updated) if old is None else (added, updated + 1)
            todo.append(tool)
        scheme = rows_scheme(embedder, strategy)
        stored: dict[str, _Entry] = {}
        if store is not None and todo:
            stored = _stored_entries(store, embedder.identity, scheme, list(dict.fromkeys(hashes[t.name] for t in todo)), embedder.dim)
        plans: dict[str, tuple[str, list[str], list[str], str]] = {}
        for tool in todo:
            if hashes[tool.name] not in stored:
                derived = cases_mod.derive(tool)
                plans[tool.name] = (hashes[tool.name], derived, strategy.render(tool, derived), primary_text(tool))
        # A tool's own cases are example requests, so they are embedded as queries are (with
        # nomic: "search_query: "); derived phrases and the primary text stay documents.
        asked = {t.name for t in todo if t.name in plans and t.cases}
        as_query = list(dict.fromkeys(t for name in asked for t in plans[name][2]))
        wanted = list(dict.fromkeys(t for name, (_, _, texts, p) in plans.items() for t in [*([] if name in asked else texts), p]))
        label = f"indexing {len(plans)} tools ({strategy})" if progress else None
        found, missing = embed_cached(embedder, store, wanted, "document", persist=persist, progress=label)
        found_q, missing_q = (embed_cached(embedder, store, as_query, "query", persist=persist, progress=label and f"{label}, own cases")
                              if as_query else ({}, 0))  # fmt: skip
        entries: dict[str, _Entry] = {}
        new: list[_Entry] = []
        for tool in catalog:
            if tool.name in plans:
                h, derived, texts, prim = plans[tool.name]
                rows = found_q if tool.name in asked else found
                entries[tool.name] = _Entry(h, derived, texts, np.vstack([rows[t] for t in texts]), found[prim], prim)
                new.append(entries[tool.name])
            elif (h := hashes[tool.name]) in stored:
                entries[tool.name] = stored[h]
            else:
                entries[tool.name] = prev[tool.name]
        if store is not None and persist:
            _store_entries(store, embedder.identity, scheme, list({e.hash: e for e in new}.values()))
        read = [t.name for t in todo if t.name not in plans]  # read back from the store's rows
        from_rows = {t for name in read for t in [*entries[name].texts, entries[name].primary_text]}
        index = cls(strategy, entries, embedder.dim)
        if wants_classifier(catalog):
            index.classifier = classifier_for(index, embedder.identity, examples, progress, store if persist else None, scheme)
        index.stats = IndexStats(
            tools=len(entries),
            rows=len(index.texts),
            embedded=missing + missing_q,
            cached=len(set(wanted) | from_rows) + len(as_query) - missing - missing_q,
            stored=len(read),
            added=added,
            updated=updated,
            removed=len(set(prev) - set(entries)),
            unchanged=unchanged,
            seconds=time.perf_counter() - t0,
        )
        return index

    def _similarities(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Row cosines (n, rows) and each tool's best row cosine (n, tools)."""
        q = np.atleast_2d(queries)
        with one_blas_thread(len(q)):
            sims = q @ self.matrix.T
        if not self.names:
            return sims, sims[:, :0]
        return sims, np.maximum.reduceat(sims, self.starts, axis=1)

    def views(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(n_queries, n_tools) twice: cosine to each tool's one-text view, and each tool's
        best cosine over its case rows."""
        q = np.atleast_2d(queries)
        with one_blas_thread(len(q)):
            primary = q @ self.primary.T
        return primary, self.tool_scores(q)

    def logits(self, queries: np.ndarray) -> np.ndarray | None:
        """(n_queries, n_tools): the classifier's logits, None without a classifier."""
        if self.classifier is None:
            return None
        q = np.atleast_2d(queries)
        with one_blas_thread(len(q)):
            return self.classifier.logits(q)

    def tool_scores(self, queries: np.ndarray) -> np.ndarray:
        """(n_queries, n_tools): each tool's best cosine over its rows."""
        return self._similarities(queries)[1]

    def closest_case(self, tool: int, query: np.ndarray) -> str:
        """The tool's indexed text closest to the query."""
        lo = int(self.starts[tool])
        hi = int(self.starts[tool + 1]) if tool + 1 < len(self.starts) else len(self.texts)
        return self.texts[lo + int(np.argmax(self.matrix[lo:hi] @ query))]
