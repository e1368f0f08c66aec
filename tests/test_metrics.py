"""The metrics store on a real SQLite file: totals, raw log, daily roll-up, queries, feedback,
and durability of acknowledged records across a kill -9 of a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from sidecar.store.metrics import DAY_S, Feedback, MetricsStore, RefReused, day_of
from sidecar.store import open_store
from tests.conftest import ROOT

T0 = 1_750_000_000.0  # a fixed "now" (2025-06-15 UTC)


class Clock:
    def __init__(self, t: float = T0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def ms(tmp_path, clock):
    return MetricsStore(open_store(tmp_path / "m.db"), retention_days=7, clock=clock)


def test_totals_per_tool(ms):
    ms.record_call("fs", "write_file", True, 100.0)
    ms.record_call("fs", "write_file", True, 300.0)
    ms.record_call("fs", "write_file", False, None, "disk full")
    m = ms.tool("fs", "write_file")
    assert (m.call_count, m.success_count, m.failure_count) == (3, 2, 1)
    assert m.avg_latency_ms == pytest.approx(200.0)  # the call without a latency does not count
    assert m.last_error == "disk full"
    assert m.success_rate == pytest.approx(2 / 3)
    assert ms.tool("fs", "read_file") is None


def test_a_resent_call_id_counts_once(ms):
    a = ms.record_call("fs", "read_file", True, 5.0, call_id="c1")
    b = ms.record_call("fs", "read_file", True, 5.0, call_id="c1")
    assert a == b
    assert ms.tool("fs", "read_file").call_count == 1


def test_a_ref_resent_with_its_payload_counts_once_and_with_another_is_refused(ms):
    """Issue 33: a resend of a ref with a changed payload was silently taken as the first, and
    feedback was not deduplicated at all. Now both kinds remember ref and payload digest."""
    a = ms.record_call("fs", "read_file", True, 5.0, call_id="k\x1fr-1", digest="d1")
    assert ms.record_call("fs", "read_file", True, 5.0, call_id="k\x1fr-1", digest="d1") == a
    with pytest.raises(RefReused):
        ms.record_call("fs", "read_file", False, 9.0, "EIO", call_id="k\x1fr-1", digest="d2")
    m = ms.tool("fs", "read_file")
    assert (m.call_count, m.failure_count) == (1, 0)
    fb = Feedback(query="q", recommended=["fs__read_file"], selected="fs__read_file", rating=4.0)
    f1 = ms.record_feedback(fb, "k\x1fr-1", "d3")  # the same ref as a call's: another kind, another record
    assert ms.record_feedback(fb, "k\x1fr-1", "d3") == f1
    with pytest.raises(RefReused):
        ms.record_feedback(Feedback(query="q", recommended=["fs__read_file"], rating=0.0), "k\x1fr-1", "d4")
    assert ms.store.query("SELECT count(*) FROM feedback")[0][0] == 1
    assert ms.record_feedback(fb) != f1  # no ref: nothing to deduplicate


def test_records_written_together_commit_at_once_and_a_reused_ref_takes_only_its_own_place(ms):
    """What a loaded server commits in one transaction: the calls and feedback of a batch, where
    a ref resent with another payload is refused and the rest are kept."""
    first = ms.record_call("fs", "read_file", True, 5.0, call_id="k\x1fr-1", digest="d1")
    fb = Feedback(query="q", recommended=["fs__read_file"], selected="fs__read_file", rating=4.0)
    rows = ms.write_many([
        ms.call_record("fs", "read_file", True, 7.0, call_id="k\x1fr-2", digest="d2"),
        ms.call_record("fs", "read_file", False, 9.0, "EIO", call_id="k\x1fr-1", digest="other"),
        ms.feedback_record(fb, "k\x1fr-3", "d3"),
        ms.call_record("fs", "read_file", True, 5.0, call_id="k\x1fr-1", digest="d1"),
    ])  # fmt: skip
    assert isinstance(rows[0], int) and isinstance(rows[1], RefReused) and isinstance(rows[2], int) and rows[3] == first
    m = ms.tool("fs", "read_file")
    assert (m.call_count, m.failure_count) == (2, 0)
    assert ms.store.query("SELECT count(*) FROM feedback")[0][0] == 1
    assert ms.write_many([]) == []


def test_a_batch_leaves_the_totals_and_ids_one_record_at_a_time_would(tmp_path, clock):
    """write_many folds a batch into each tool's totals in one statement: the same totals,
    averages, times and last error as the records written one by one, across more rows than one
    statement takes; a call resent inside the batch (same ref and payload, or the same call_id)
    answers the first row's id and counts once."""
    one = MetricsStore(open_store(tmp_path / "one.db"), clock=clock)
    many = MetricsStore(open_store(tmp_path / "many.db"), clock=clock)
    calls = [("fs", f"t{i % 7}", i % 5 != 0, None if i % 11 == 0 else float(i), None if i % 5 else f"E{i}", f"k\x1fr{i}", T0 + i)
             for i in range(600)]  # fmt: skip
    singly = [one.record_call(srv, tool, ok, lat, err, call_id=ref, digest="d", ts=ts) for srv, tool, ok, lat, err, ref, ts in calls]
    batch = [many.call_record(srv, tool, ok, lat, err, call_id=ref, digest="d", ts=ts) for srv, tool, ok, lat, err, ref, ts in calls]
    batch += [many.call_record("fs", "t0", True, 1.0, call_id="k\x1fr3", digest="d", ts=T0 + 999),  # resent
              many.call_record("fs", "t0", True, 1.0, call_id="plain", ts=T0 + 999),
              many.call_record("fs", "t0", True, 1.0, call_id="plain", ts=T0 + 999)]  # fmt: skip
    rows = many.write_many(batch)
    assert rows[:600] == singly and rows[600] == rows[3] and rows[601] == rows[602]
    one.record_call("fs", "t0", True, 1.0, call_id="plain", ts=T0 + 999)
    for tool in (f"t{k}" for k in range(7)):
        a, b = one.tool("fs", tool), many.tool("fs", tool)
        assert (a.call_count, a.success_count, a.failure_count, a.last_error, a.last_called_at, a.last_success_at) == \
               (b.call_count, b.success_count, b.failure_count, b.last_error, b.last_called_at, b.last_success_at)  # fmt: skip
        assert b.avg_latency_ms == pytest.approx(a.avg_latency_ms)
    assert one.tool("fs", "t0").call_count == 87 and one.tool("fs", "t0").last_error == "E595"
    assert many.generation() == 1  # one batch, one change


def test_recent_calls_counted_ahead_in_buckets_match_the_raw_log(tmp_path, clock):
    """`recent` reads the calls of whole buckets counted ahead and the first bucket's calls
    from the raw log: the same counts as the raw log alone for any window, after a reset, and
    on a store from before the buckets (filled from its raw log when opened)."""
    import random

    ms = MetricsStore(open_store(tmp_path / "r.db"), clock=clock)
    rnd = random.Random(7)
    ms.write_many([ms.call_record("s", f"t{rnd.randrange(3)}", rnd.random() > 0.3, ts=T0 - rnd.uniform(0, 900)) for _ in range(400)]
                  + [ms.call_record("s", "t0", True, ts=T0 - 160.0), ms.call_record("s", "t1", False, ts=T0 - 176.0)])  # fmt: skip

    def raw(window: float) -> dict:
        rows = ms.store.query("SELECT server, tool, count(*), sum(success) FROM tool_calls WHERE ts >= ? GROUP BY server, tool", (T0 - window,))
        return {(s, t): (c, k) for s, t, c, k in rows}

    def counted(m: MetricsStore, window: float) -> dict:
        return {key: (c.calls, c.successes) for key, c in m.recent(window).items()}

    for window in (1.0, 16.0, 160.0, 176.0, 300.0, 333.3, 10_000.0):
        assert counted(ms, window) == raw(window), window
    assert counted(ms, 300.0) != counted(ms, 176.0)  # the windows differ: the test can tell
    ms.reset(tool="t2")
    assert counted(ms, 300.0) == raw(300.0) and ("s", "t2") not in counted(ms, 300.0)
    ms.store.ensure_schema("DROP TABLE tool_calls_recent")
    again = MetricsStore(open_store(tmp_path / "r.db"), clock=clock)
    assert counted(again, 300.0) == raw(300.0)


def test_a_store_from_before_record_refs_opens_and_keeps_its_rows(ms):
    """The migration: a store written before record_refs existed gains the table when opened
    and keeps its calls; an old call_id resent with a digest still counts once."""
    old = ms.record_call("fs", "read_file", True, 5.0, call_id="c-old")
    ms.store.ensure_schema("DROP TABLE record_refs")
    assert "record_refs" not in ms.store.tables()
    again = MetricsStore(ms.store, retention_days=7, clock=ms.clock)
    assert "record_refs" in ms.store.tables()
    assert again.tool("fs", "read_file").call_count == 1
    assert again.record_call("fs", "read_file", True, 5.0, call_id="c-old", digest="d") == old
    assert again.record_call("fs", "read_file", True, 5.0, call_id="c-old", digest="d") == old
    assert again.tool("fs", "read_file").call_count == 1


def test_server_top_and_failing(ms):
    for _ in range(4):
        ms.record_call("fs", "read_file", True, 10.0)
        ms.record_call("fs", "write_file", False, 10.0, "EACCES")
        ms.record_call("web", "fetch", True, 50.0)
    ms.record_call("web", "fetch", False, 50.0, "timeout")
    ms.record_call("web", "rare", False, 1.0, "boom")  # one call: too few to call it failing
    assert [m.tool for m in ms.server("fs")] == ["read_file", "write_file"]
    assert [(m.server, m.tool) for m in ms.top(limit=2, min_calls=3)] == [("fs", "read_file"), ("web", "fetch")]
    assert [m.tool for m in ms.failing(threshold=0.5)] == ["write_file"]
    assert [m.tool for m in ms.failing(threshold=0.9, min_calls=1)] == ["write_file", "rare", "fetch"]
    listing = ms.listing(failing=True)
    assert [t.tool for t in listing.tools] == ["write_file"]
    assert ms.listing(tool="fs__read_file").tools[0].call_count == 4


def test_reset_forgets_history_but_keeps_feedback(ms):
    ms.record_call("fs", "read_file", True)
    ms.record_call("web", "fetch", True)
    ms.record_feedback(Feedback("read it", ["fs__read_file"], "fs__read_file", 5.0))
    gen = ms.generation()
    assert ms.reset(server="fs") == 1
    assert ms.tool("fs", "read_file") is None and ms.tool("web", "fetch") is not None
    assert ms.generation() > gen
    assert ms.reset() == 1
    assert ms.all() == [] and len(ms.feedback()) == 1


def test_rollup_keeps_answers_and_respects_retention(ms, clock):
    old = T0 - 10 * DAY_S
    ms.record_call("fs", "read_file", True, 10.0, ts=old, agent="a")
    ms.record_call("fs", "read_file", False, 30.0, "EIO", ts=old + 60, agent="a")
    ms.record_call("fs", "read_file", True, 20.0, ts=T0 - 3600, agent="a")
    before = ms.all(days=30)
    stats = ms.rollup()
    assert stats.rows == 2 and stats.groups == 1
    assert ms.store.query("SELECT count(*) FROM tool_calls")[0][0] == 1  # inside retention: kept raw
    daily = ms.store.query("SELECT day, call_count, success_count, latency_sum_ms FROM tool_metrics_daily")
    assert daily == [(day_of(old), 2, 1, 40.0)]
    after = ms.all(days=30)
    assert [(m.call_count, m.success_count) for m in after] == [(m.call_count, m.success_count) for m in before] == [(3, 2)]
    assert after[0].avg_latency_ms == pytest.approx(20.0)
    assert after[0].last_error == "EIO"
    assert ms.per_agent("a")[("fs", "read_file")].calls == 3  # raw + daily together
    assert ms.all(days=1)[0].call_count == 1  # a window that excludes the rolled-up day
    # a second run has nothing left to fold; due only once a day
    assert ms.rollup().rows == 0
    assert ms.rollup_if_due() is None
    clock.t += DAY_S + 1
    assert ms.rollup_if_due() is not None


def test_rollup_adds_to_an_existing_day(ms, clock):
    day_start = T0 - 20 * DAY_S
    ms.record_call("fs", "x", True, ts=day_start)
    ms.rollup()
    ms.record_call("fs", "x", False, ts=day_start + 10)  # a late-arriving call for that day
    ms.rollup()
    assert ms.store.query("SELECT call_count, success_count, failure_count FROM tool_metrics_daily") == [(2, 1, 1)]


def test_recent_counts_window_and_agent(ms, clock):
    ms.record_call("fs", "read_file", True, ts=T0 - 30, agent="a")
    ms.record_call("fs", "read_file", False, ts=T0 - 30, agent="b")
    ms.record_call("fs", "read_file", True, ts=T0 - 600, agent="a")
    assert ms.recent(60)[("fs", "read_file")].calls == 2
    assert ms.recent(60, agent="a")[("fs", "read_file")].successes == 1
    assert ms.recent(3600, agent="a")[("fs", "read_file")].calls == 2


def test_feedback_round_trip_and_ratings(ms):
    ms.record_feedback(Feedback("save it", ["fs__write_file", "fs__edit_file"], "fs__edit_file", 4.0, True, 12.5, "agent-1", "A"))
    ms.record_feedback(Feedback("save it", ["fs__write_file"], "fs__write_file", 2.0, False, None, "agent-2", "B"))
    rows = ms.feedback(variant="A")
    assert len(rows) == 1
    fb = rows[0]
    assert fb.recommended == ["fs__write_file", "fs__edit_file"]
    assert (fb.selected, fb.rating, fb.success, fb.latency_ms, fb.agent, fb.variant) == ("fs__edit_file", 4.0, True, 12.5, "agent-1", "A")
    assert fb.ts == T0 and fb.id is not None
    assert ms.ratings() == {"fs__edit_file": (1, 4.0), "fs__write_file": (1, 2.0)}
    with pytest.raises(ValueError):
        Feedback("q", [], rating=6.0)


def test_retention_must_be_positive(tmp_path):
    with pytest.raises(ValueError):
        MetricsStore(open_store(tmp_path / "x.db"), retention_days=0)


WRITER = textwrap.dedent(
    """
    import sys
    from sidecar.store.metrics import MetricsStore
    from sidecar.store import open_store
    ms = MetricsStore(open_store(sys.argv[1]))
    i = 0
    while True:
        rid = ms.record_call("fs", "write_file", i % 3 != 0, 1.0 + i, None if i % 3 else "err", call_id=f"call-{i}")
        print(rid, flush=True)  # acknowledged: record_call returned, so the row is committed
        i += 1
    """
)


def acked_then_killed(location: str, n: int = 200) -> list[int]:
    """The ids a writer process acknowledged (after each commit) before it was killed -9."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, location], stdout=subprocess.PIPE, cwd=ROOT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    acked = []
    try:
        while len(acked) < n:
            line = proc.stdout.readline()
            assert line, f"writer died before acknowledging {n} calls"
            acked.append(int(line))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return acked


def test_acknowledged_calls_survive_kill_9(tmp_path):
    db = tmp_path / "durable.db"
    acked = acked_then_killed(str(db))
    ms = MetricsStore(open_store(db))
    ids = {r[0] for r in ms.store.query("SELECT id FROM tool_calls")}
    assert set(acked) <= ids
    m = ms.tool("fs", "write_file")
    assert m.call_count >= len(acked) and m.call_count == len(ids)  # totals moved in the same transactions
    assert m.success_count + m.failure_count == m.call_count


def test_stored_strings_are_cut_to_their_caps(tmp_path, clock):
    from sidecar.store.metrics import StringCaps

    ms = MetricsStore(open_store(tmp_path / "caps.db"), clock=clock, caps=StringCaps(agent=8, query=10, error=12, name=16))
    rid = ms.record_call("s" * 100, "t" * 100, False, 1.0, "e" * 1000, agent="a" * 1000, call_id="c")
    fid = ms.record_feedback(Feedback(query="q" * 1000, recommended=["r" * 100, "x"], selected="r" * 100, agent="a" * 1000, variant="v" * 100))
    db = ms.store
    assert db.query("SELECT length(server), length(tool), length(agent), length(error) FROM tool_calls WHERE id=?", (rid,)) == [(16, 16, 8, 12)]
    assert db.query("SELECT length(last_error) FROM tool_metrics") == [(12,)]
    [fb] = ms.feedback()
    assert (fb.id, len(fb.query), fb.recommended, len(fb.selected), len(fb.agent), len(fb.variant)) == (fid, 10, ["r" * 16, "x"], 16, 8, 16)
    assert MetricsStore(open_store(tmp_path / "d.db")).caps == StringCaps()  # defaults everywhere else
    with pytest.raises(ValueError, match="StringCaps.query=0"):
        StringCaps(query=0)
