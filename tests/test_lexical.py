"""The lexical index's bulk build (issue 12: it is rebuilt on every start, 10,000 tools) against
the plain definitions it replaces: the words one regex finds, one Counter per tool, BM25 and
TF-IDF summed term by term in float64. On the real catalog, ALL.json (605 tools)."""

from __future__ import annotations

import math
from collections import Counter

import msgspec
import numpy as np
import pytest
import regex

from sidecar.core import catalog as catalog_mod
from sidecar.core.catalog import Catalog, Tool
from sidecar.core.lexical import STOPWORDS, LexicalIndex, tokens, tool_text, words
from tests.conftest import CATALOGS

TRICKY = [
    "getHTTPResponse parseJSONFile x2Y snake_case_Name __init__ kebab-case-name",
    "café Über naïveÉtat “quoted” em—dash ½ ² ① ٣ 日本語のテキスト",
    "ΣΑΣ ΟΔΟΣ fooBarΣ İstanbul ß ǅungla ﬁle",  # final sigma, İ lowering to two code points
    "tabs\tand\nnewlines\x85next\u00a0nbsp\u2003em\u2028line",
    "a\ud83db lone surrogate, \U0001f600 emoji, \x00nul\x1fctl",
    "",
    "___ --- ...",
]
QUERIES = [
    "save a text file", "fetch the web page at https://example.com and give me its text",
    "what time is it in Tokyo right now", "open a pull request for my branch on github",
    "show the staged changes in git", "post a message to the #general slack channel",
    "take a screenshot of the current browser page", "run this SQL query against the sqlite database",
    "delete the cached key user:42 from redis", "count documents in the orders collection in mongo",
    "search search search notes", "getFileContents", "nothing matches zzqx", "",
]  # fmt: skip


def reference_tokens(text: str) -> list[str]:
    """The definition: `[\\p{L}\\p{N}]+` after a space between a lower- and an upper-case letter."""
    found = regex.findall(r"[\p{L}\p{N}]+", regex.sub(r"(?<=\p{Ll})(?=\p{Lu})", " ", text))
    return [w.lower() for w in found if w.lower() not in STOPWORDS]


def reference_docs(catalog: Catalog) -> list[Counter]:
    return [Counter(reference_tokens(tool_text(t))) for t in catalog]


def reference_scores(docs: list[Counter], query: str, kind: str, k1: float = 1.2, b: float = 0.75) -> np.ndarray:
    """Every tool's score, straight from the formulas (float64, term by term)."""
    n = len(docs)
    df = Counter(w for d in docs for w in d)
    q = Counter(reference_tokens(query))
    out = np.zeros(n)
    if kind == "bm25":
        avg = sum(sum(d.values()) for d in docs) / n
        for j, d in enumerate(docs):
            length = sum(d.values())
            for w in q:  # a repeated query word counts once
                if w in d:
                    idf = math.log(1 + (n - df[w] + 0.5) / (df[w] + 0.5))
                    out[j] += idf * d[w] * (k1 + 1) / (d[w] + k1 * (1 - b + b * length / avg))
        return out
    idf = {w: math.log((1 + n) / (1 + c)) + 1 for w, c in df.items()}
    qv = {w: (1 + math.log(c)) * idf[w] for w, c in q.items() if w in idf}
    qn = math.sqrt(sum(v * v for v in qv.values())) or 1.0
    for j, d in enumerate(docs):
        dv = {w: (1 + math.log(c)) * idf[w] for w, c in d.items()}
        dn = math.sqrt(sum(v * v for v in dv.values())) or 1.0
        out[j] = sum(v * dv.get(w, 0.0) for w, v in qv.items()) / (qn * dn)
    return out


@pytest.fixture(scope="module")
def real() -> Catalog:
    return catalog_mod.load([CATALOGS / "ALL.json"])


def test_words_and_tokens_match_the_regex_definition(real):
    texts = [tool_text(t) for t in real] + [t.description for t in real] + TRICKY
    for text in texts:
        assert tokens(text) == reference_tokens(text), text
        assert [w for w in (x.lower() for x in words(text)) if w not in STOPWORDS] == reference_tokens(text)
    assert words("getHTTPResponse x2Y") == ["get", "HTTPResponse", "x2Y"]  # a digit is not lower case


@pytest.mark.parametrize("kind", ["bm25", "tfidf"])
def test_scores_equal_the_reference_computation_on_the_real_catalog(real, kind):
    index = LexicalIndex(real, kind)
    queries = QUERIES + [t.description[:120] for t in list(real)[::23]]
    docs = reference_docs(real)
    assert sum(np.count_nonzero(index.scores(q)) for q in queries) > 1000  # the queries do match
    for q in queries:
        got, want = index.scores(q), reference_scores(docs, q, kind)
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6, err_msg=q)
    assert set(index.vocab) == {w for t in real for w in reference_tokens(tool_text(t))}


def test_rank_orders_by_score_and_ties_by_catalog_order(real):
    index = LexicalIndex(real)
    ranked = index.rank("take a screenshot of the current browser page", k=5)
    scores = [s for _, s in ranked]
    assert scores == sorted(scores, reverse=True) and scores[0] > 0
    assert "screenshot" in ranked[0][0]


def test_odd_catalogs():
    empty = LexicalIndex(Catalog([]))
    assert empty.scores("anything").shape == (0,) and empty.rank("anything") == []
    mute = Catalog([Tool(name="___"), Tool(name="the", description="a an the"), Tool(name="readFile", description="Reads a file.")])
    for kind in ("bm25", "tfidf"):
        index = LexicalIndex(mute, kind)
        for q in ("read the file", "the", ""):
            np.testing.assert_allclose(index.scores(q), reference_scores(reference_docs(mute), q, kind), rtol=2e-6, atol=1e-6)
    assert LexicalIndex(mute).rank("read file", k=1)[0][0] == "readFile"


def test_one_bm25_index_per_catalog_object(real):
    shared = LexicalIndex.bm25_of(real)
    assert LexicalIndex.bm25_of(real) is shared  # the pipeline's and the recommender's
    again = Catalog(list(real))  # a reindex makes a new catalog object: a new index
    assert LexicalIndex.bm25_of(again) is not shared
    assert np.array_equal(LexicalIndex.bm25_of(again).scores("git log"), shared.scores("git log"))


def test_a_restart_reads_the_index_back_from_the_store(real, tmp_path):
    from sidecar.store import open_store

    built = LexicalIndex.stored(real, open_store(tmp_path / "s.db"))
    assert built.origin == "built"
    again = LexicalIndex.stored(Catalog(list(real)), open_store(tmp_path / "s.db"))  # a restart: new objects
    assert again.origin == "store" and again.vocab == built.vocab and again.names == built.names
    for q in QUERIES:
        assert np.array_equal(again.scores(q), built.scores(q)) and again.rank(q) == built.rank(q)
    tools = list(real)
    tools[5] = msgspec.structs.replace(tools[5], description="Plot a histogram of kubernetes pod restarts.")
    changed = LexicalIndex.stored(Catalog(tools), open_store(tmp_path / "s.db"))
    assert changed.origin == "built" and changed.rank("kubernetes histogram", k=1)[0][0] == tools[5].name
    assert LexicalIndex.stored(real, open_store(tmp_path / "s.db"), "tfidf").origin == "built"  # per kind


def test_the_store_keeps_the_latest_catalogs_only(real, tmp_path):
    from sidecar.core.lexical import KEEP
    from sidecar.store import open_store

    store = open_store(tmp_path / "s.db")
    for n in range(KEEP + 3):
        LexicalIndex.stored(Catalog(list(real)[n : n + 40]), store)
    assert store.query("SELECT count(*) FROM lexical_index")[0][0] == KEEP
    assert LexicalIndex.stored(Catalog(list(real)[KEEP + 2 : KEEP + 42]), store).origin == "store"  # the newest stayed
    assert LexicalIndex.stored(Catalog(list(real)[0:40]), store).origin == "built"  # the oldest went


def test_a_tool_is_found_by_its_parameter_names():
    """filesystem's edit_file is the one tool with a `dryRun` parameter, and neither its
    description nor any other tool's text says "dry": a request for a dry run finds it by
    the parameter alone."""
    cat = catalog_mod.load([CATALOGS / "filesystem.json"])
    edit = cat.get("edit_file")
    assert "dryRun" in edit.inputSchema["properties"] and "dry" not in edit.description.lower()
    assert "dryRun" in tool_text(edit)
    for kind in ("bm25", "tfidf"):
        ranked = LexicalIndex(cat, kind).rank("preview the edits as a dry run first", 3)
        assert ranked[0][0] == "edit_file", (kind, ranked)
    # a schema without properties (or a broken one) adds nothing and breaks nothing
    bare = Tool("ping", "Check the server answers.", {"type": "object"})
    odd = Tool("odd", "Odd schema.", {"type": "object", "properties": ["not", "a", "mapping"]})
    assert tool_text(bare).split() == ["ping", "Check", "the", "server", "answers."]
    assert "mapping" not in tool_text(odd)
