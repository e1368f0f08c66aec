"""The index across restarts (issue 12, part 5): a build keeps each tool's derived texts and
vectors in the store by content hash, so a restart reads them back whole instead of deriving
and looking up every text, and a changed tool is the only one derived and embedded again.
Real MiniLM, real SQLite file."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from sidecar.core import catalog as catalog_mod
from sidecar.core import models
from sidecar.core.cases import Strategy
from sidecar.core.embed import Embedder
from sidecar.core.index import ToolIndex
from sidecar.store import open_store
from tests.conftest import CATALOGS

BASE = Strategy.parse("base")


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    r = models.resolve(models.SMALL_MODEL, progress=False)
    return Embedder(r.path, name=r.name, identity=models.file_sha256(r.path), threads=1, max_tokens=r.spec.n_ctx)


@pytest.fixture(scope="module")
def cat() -> catalog_mod.Catalog:
    return catalog_mod.load([CATALOGS / "git.json", CATALOGS / "time.json"])


def test_a_restart_reads_every_tool_back_from_the_store(embedder, cat, tmp_path):
    first = ToolIndex.build(cat, embedder, BASE, open_store(tmp_path / "s.db"))
    assert first.stats.embedded > 0 and first.stats.stored == 0
    again = ToolIndex.build(cat, embedder, BASE, open_store(tmp_path / "s.db"))  # a new connection: a restart
    assert again.stats.stored == len(cat) and again.stats.embedded == 0
    assert again.stats.cached == first.stats.embedded  # every text, counted once
    assert again.names == first.names and again.texts == first.texts
    assert np.array_equal(again.matrix, first.matrix) and np.array_equal(again.primary, first.primary)
    q = embedder.embed(["show me the git log"]).vectors
    assert np.array_equal(again.tool_scores(q), first.tool_scores(q))


def test_a_restart_derives_and_embeds_only_the_changed_tool(embedder, cat, tmp_path):
    ToolIndex.build(cat, embedder, BASE, open_store(tmp_path / "s.db"))
    tools = list(cat)
    tools[0] = msgspec.structs.replace(tools[0], description="Summarise the repository's history as a changelog for a release.")
    changed = catalog_mod.Catalog(tools, ["<edited>"])
    again = ToolIndex.build(changed, embedder, BASE, open_store(tmp_path / "s.db"))
    assert again.stats.stored == len(tools) - 1
    assert 0 < again.stats.embedded <= 3  # the changed tool's new texts only
    assert any("changelog" in t for t in again.entries[tools[0].name].texts)


def test_stored_rows_are_per_model_and_strategy(embedder, cat, tmp_path):
    ToolIndex.build(cat, embedder, BASE, open_store(tmp_path / "s.db"))
    other = ToolIndex.build(cat, embedder, Strategy.parse("prefix"), open_store(tmp_path / "s.db"))
    assert other.stats.stored == 0  # other texts: derived again (the shared ones come from the cache)
    assert all(t.startswith(f"{n.replace('__', ' ')}: ") for n in other.names for t in other.entries[n].texts)  # "git git_log: ..."
    renamed = Embedder(embedder.path, name="other", identity="another-model", threads=1, max_tokens=embedder.max_tokens)
    assert ToolIndex.build(cat, renamed, BASE, open_store(tmp_path / "s.db")).stats.stored == 0


def test_few_queries_score_the_same_onone_blas_thread_from_many_threads(embedder, cat, tmp_path):
    """Query-time products run on one BLAS thread (index.one_blas_thread): same numbers as the
    plain product, from several threads at once, and BLAS gets its threads back after."""
    from concurrent.futures import ThreadPoolExecutor

    from sidecar.core import index as index_mod

    idx = ToolIndex.build(cat, embedder, BASE, open_store(tmp_path / "s.db"))
    q = embedder.embed(["show me the git log", "what time is it in Tokyo"]).vectors
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: idx.views(q), range(16)))
    for cosine, cases in got:
        assert np.array_equal(cosine, q @ idx.primary.T)
        assert np.array_equal(cases, np.maximum.reduceat(q @ idx.matrix.T, idx.starts, axis=1))
    assert index_mod._blas_users == 0
    setter = index_mod._openblas_set_threads()
    if setter is not None:  # numpy's own OpenBLAS (another BLAS is left alone)
        assert setter[1]() == setter[2]


def test_own_cases_are_embedded_as_queries_and_derived_phrases_as_documents(tmp_path):
    """A catalog's own `cases` are example requests: with a model that has task prefixes
    (nomic), they are embedded as the texts they will be compared with ("search_query: "),
    which put the right intent first for 90.9% of HWU64's tuning texts against 84.9% as
    documents. Derived phrases and the primary text stay documents."""
    r = models.resolve(models.DEFAULT_MODEL, progress=False)
    nomic = Embedder(r.path, name=r.name, identity=models.file_sha256(r.path), threads=2, max_tokens=512,
                     prefixes=r.spec.task_prefixes)  # fmt: skip
    assert nomic.prefixes and nomic.prefixes[0] != nomic.prefixes[1]
    both = catalog_mod.load([CATALOGS / "notes.json", CATALOGS / "time.json"])
    own = next(t for t in both if t.cases)  # notes.json's tools carry cases, time.json's do not
    derived = next(t for t in both if not t.cases)
    index = ToolIndex.build(both, nomic, BASE, open_store(tmp_path / "s.db"))
    for tool, kind in ((own, "query"), (derived, "document")):
        entry = index.entries[tool.name]
        expected = nomic.embed(list(entry.texts), kind).vectors
        other = nomic.embed(list(entry.texts), "query" if kind == "document" else "document").vectors
        assert np.allclose(entry.vectors, expected, atol=1e-3), kind
        assert not np.allclose(entry.vectors, other, atol=1e-3), kind
        assert np.allclose(entry.primary, nomic.embed([entry.primary_text], "document").vectors[0], atol=1e-3)


def test_a_bulk_job_runs_on_the_bulk_threads_and_gives_the_same_vectors(embedder, tmp_path):
    """An index build of BULK_TEXTS texts or more embeds on every core (`bulk`), then the
    context goes back to the serving thread count; the vectors do not depend on it."""
    import llama_cpp

    from sidecar.core.embed import BULK_TEXTS
    from sidecar.core.index import embed_cached

    r = models.resolve(models.SMALL_MODEL, progress=False)
    two = Embedder(r.path, name=r.name, identity="bulk-test", threads=1, bulk=2, max_tokens=r.spec.n_ctx)
    texts = [f"list the open issues labelled bug-{i} in the tracker" for i in range(BULK_TEXTS)]
    seen = []
    real = two._llm.embed

    def watch(*args, **kwargs):
        seen.append(llama_cpp.llama_n_threads_batch(two._llm._ctx.ctx))
        return real(*args, **kwargs)

    two._llm.embed = watch
    bulk, embedded = embed_cached(two, open_store(tmp_path / "s.db"), texts, "document")
    assert embedded == BULK_TEXTS and set(seen) == {2}
    assert llama_cpp.llama_n_threads_batch(two._llm._ctx.ctx) == 1  # back to serving
    seen.clear()
    few, _ = embed_cached(two, None, texts[:8], "document")  # a small job: serving threads
    assert set(seen) == {1}
    for t in texts[:8]:
        assert float(few[t] @ bulk[t]) > 0.9999


def test_a_job_beside_an_idle_model_takes_every_core_and_one_beside_a_busy_model_its_own(tmp_path):
    """A cold catalog is indexed on the second context while serving goes on: in pieces, each
    on every core while the first context is idle (no traffic: twice as fast) and on the
    second context's own thread while the first is judging, as is a single text (a long turn
    its client waits for, beside other clients' judging); the vectors do not depend on it."""
    import threading

    import llama_cpp

    from sidecar.core.embed import BESIDE_PIECE

    r = models.resolve(models.SMALL_MODEL, progress=False)
    two = Embedder(r.path, name=r.name, identity="beside-test", threads=1, bulk=2, max_tokens=r.spec.n_ctx)
    texts = [f"archive the thread about invoice {i} and tell the sender" for i in range(2 * BESIDE_PIECE + 1)]
    first = two.embed(texts, "document")
    second = two._second()[0]
    seen: list[int] = []
    real = second.embed

    def watch(*args, **kwargs):
        seen.append(llama_cpp.llama_n_threads_batch(second._ctx.ctx))
        return real(*args, **kwargs)

    second.embed = watch
    two._first_used = 0.0  # the first context idle since long ago
    with two.beside():
        idle = two.embed(texts, "document")
    assert seen == [2, 2, 2]  # three pieces, each on both cores
    assert llama_cpp.llama_n_threads_batch(second._ctx.ctx) == 1
    seen.clear()
    with two.beside():
        one = two.embed(texts[:1], "query")  # one long turn a client waits for: its own thread
    assert seen == [1] and float(one.vectors[0] @ two.embed(texts[:1], "query").vectors[0]) > 0.9999
    seen.clear()
    got = {}

    def index_thread():
        with two.beside():
            got["busy"] = two.embed(texts, "document")

    with two._lock:  # the model thread is judging
        t = threading.Thread(target=index_thread)
        t.start()
        t.join(60)
    assert seen == [1, 1, 1]
    for beside in (idle, got["busy"]):
        assert np.all(np.sum(first.vectors * beside.vectors, axis=1) > 0.9999)
        assert beside.truncated == [False] * len(texts)


def test_beside_embeds_on_a_second_context_with_the_same_vectors(embedder):
    """`beside` (a hello's tools, issue 33): this thread's texts go to a second context, so
    they are embedded while the first is held (by the model thread judging), and come out as
    the first would give them."""
    import threading

    texts = ["stage README.md", "(" * 3000, "show me what changed in app.py"]
    first = embedder.embed(texts, "document")
    got: dict[str, object] = {}

    def index_thread():
        with embedder.beside():
            got["beside"] = embedder.embed(texts, "document")

    with embedder._lock:  # the model thread is busy judging
        t = threading.Thread(target=index_thread)
        t.start()
        t.join(30)
        done = not t.is_alive()
    t.join()
    assert done  # it never waited for the first context
    second = got["beside"]
    assert second.truncated == first.truncated == [False, True, False]
    assert np.all(np.sum(first.vectors * second.vectors, axis=1) > 0.9999)
    assert embedder._context()[0] is embedder._llm  # this thread, outside `beside`: the first context
