"""The watch that lets a judgement take every core while no other process uses them."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from sidecar.core import cores, models
from sidecar.core import embed as embed_mod
from sidecar.core.embed import Embedder

BURN = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass\n"


def test_busy_seconds_reads_every_kind_of_work_but_idle_and_iowait():
    ticks = cores.busy_seconds("cpu  100 5 50 1000 20 3 2 1 0 0\ncpu0 1 2 3 4\n")
    assert ticks == pytest.approx((100 + 5 + 50 + 3 + 2 + 1) / __import__("os").sysconf("SC_CLK_TCK"))
    assert cores.busy_seconds("intr 1 2 3\n") is None
    with open("/proc/stat") as f:
        assert cores.busy_seconds(f.read()) > 0


def test_others_cores_is_the_machine_s_work_less_this_process_s_per_second():
    assert cores.others_cores((0.0, 10.0, 1.0), (2.0, 13.0, 2.0)) == pytest.approx(1.0)  # 3 s busy, 1 s ours, over 2 s
    assert cores.others_cores((0.0, 10.0, 1.0), (1.0, 10.5, 1.6)) == 0.0  # clock granularity: never below zero
    assert cores.others_cores((1.0, 0.0, 0.0), (1.0, 5.0, 0.0)) == 0.0


def test_the_watch_turns_spare_below_one_threshold_and_busy_above_the_other():
    watch = cores.CoreWatch(path="/nonexistent", every=0.5, window=1.0)  # no sampling thread: samples are handed to it
    assert watch.spare is False and watch.others is None

    clock = {"t": 0.0, "busy": 100.0, "own": 10.0}

    def feed(start: float, seconds: float, others: float) -> None:
        """`seconds` of samples in which the others used `others` cores and this process one."""
        for _ in range(int(seconds / 0.5)):
            clock["t"] += 0.5
            clock["busy"] += (others + 1.0) * 0.5
            clock["own"] += 0.5
            watch.observe((clock["t"], clock["busy"], clock["own"]))

    feed(0.0, 2.0, 0.05)
    assert watch.spare is True and watch.others == pytest.approx(0.05)
    feed(2.0, 2.0, 0.25)  # between the thresholds: stays spare
    assert watch.spare is True
    feed(4.0, 2.0, 0.5)
    assert watch.spare is False
    feed(6.0, 2.0, 0.25)  # between them again: stays busy
    assert watch.spare is False
    feed(8.0, 2.0, 0.0)
    assert watch.spare is True


def test_the_watch_is_not_spare_where_it_cannot_read_the_machine():
    watch = cores.CoreWatch(path="/nonexistent")
    time.sleep(0.1)
    assert watch.spare is False


def test_a_busy_process_beside_it_keeps_a_judgement_on_its_own_threads(tmp_path):
    """A real process burning a core: the watch sees it within its window and the embedder's
    first context keeps `threads`; a bulk job still takes every core."""
    r = models.resolve(models.SMALL_MODEL, progress=False)
    emb = Embedder(r.path, name=r.name, identity="cores-test", threads=1, bulk=2, max_tokens=r.spec.n_ctx, idle_cores=True)
    assert emb.idle_cores is cores.watch()
    burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(2)]
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (emb.idle_cores.others or 0) < 1.0:
            time.sleep(0.25)
        assert emb.idle_cores.others >= 1.0 and emb.idle_cores.spare is False
        assert emb.first_threads() == 1
        assert emb.first_threads(bulk=True) == 2
        assert emb.embed(["read the file notes.txt"]).vectors.shape == (1, emb.dim)
    finally:
        for b in burners:
            b.kill()
            b.wait()


def test_an_embedder_without_a_spare_core_or_asked_not_to_has_no_watch():
    r = models.resolve(models.SMALL_MODEL, progress=False)
    assert Embedder(r.path, name=r.name, identity="x", threads=2, bulk=2, max_tokens=r.spec.n_ctx, idle_cores=True).idle_cores is None
    assert Embedder(r.path, name=r.name, identity="x", threads=1, bulk=2, max_tokens=r.spec.n_ctx).idle_cores is None


def spare_watch() -> cores.CoreWatch:
    """A watch handed a second in which no other process worked."""
    watch = cores.CoreWatch(path="/nonexistent", every=0.5, window=1.0)
    for i in range(4):
        watch.observe((i * 0.5, 100.0, 0.0))
    assert watch.spare is True
    return watch


LONG_TEXT = " ".join(["Summarise the quarterly planning notes, list every open action item with its owner,"] * 12)


def test_a_model_with_long_calls_takes_idle_cores_but_not_while_a_job_runs_on_the_second_context():
    """nomic (the default) judges a long text in well over LONG_CALL_S: on idle cores its
    calls take every thread, except while a catalog is embedded on the second context."""
    r = models.resolve(models.DEFAULT_MODEL, progress=False)
    emb = Embedder(r.path, name=r.name, identity="cores-beside", threads=1, bulk=2, max_tokens=512, idle_cores=True)
    emb.idle_cores = spare_watch()
    assert emb.first_threads() == 1  # nothing measured yet
    emb.embed([LONG_TEXT])
    assert emb._call_s >= embed_mod.LONG_CALL_S and emb.first_threads() == 2
    during = []
    with emb.beside():
        original = emb._embed_on

        def observed(llm, texts, kind, threads, usual):
            during.append(emb.first_threads())
            return original(llm, texts, kind, threads, usual)

        emb._embed_on = observed
        emb.embed(["one", "two"])
    assert during == [1] and emb.first_threads() == 2


def test_a_model_with_short_calls_keeps_its_threads_on_idle_cores():
    """MiniLM's clause takes a few ms: two threads' syncing cost more than they saved."""
    r = models.resolve(models.SMALL_MODEL, progress=False)
    emb = Embedder(r.path, name=r.name, identity="cores-short", threads=1, bulk=2, max_tokens=r.spec.n_ctx, idle_cores=True)
    emb.idle_cores = spare_watch()
    emb.embed(["read the file notes.txt"])  # a context's first call allocates its buffers: 2-3x a later one,
    emb._call_s = None  # and on a loaded CI machine it alone pushed a 3-call mean past the bar (20.4 ms)
    for _ in range(5):
        emb.embed(["read the file notes.txt"])
    assert emb._call_s < embed_mod.LONG_CALL_S and emb.first_threads() == 1
