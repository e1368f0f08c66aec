"""The store on PostgreSQL: a real server started here (tests/pg_cluster.py, 127.0.0.1, a free
port), a fresh database per test.

The metrics tests of test_metrics.py run again here, unchanged, on PostgreSQL (their `ms`
fixture is this module's); then what only a shared store has: replicas writing at once, a
row lock held by another replica, and two real `sidecar serve` processes on one database:
failures reported through one change what the other injects, and a kill -9 of one loses no
acknowledged tool_result while the other goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psycopg
import pytest

from sidecar.core import models
from sidecar import protocol as p
from sidecar.client import SidecarClient
from sidecar.store.metrics import Feedback, MetricsStore, RefReused, key_of
from sidecar.store import Store, StoreBusy, StoreError, open_store
from sidecar.store.postgres import PgStore, display, pg_ddl

from .conftest import CATALOGS, ROOT, serve_processes
from .pg_cluster import Cluster
from .test_metrics import (  # noqa: F401  (the same tests, collected here again with this module's `ms`)
    Clock,
    acked_then_killed,
    test_a_ref_resent_with_its_payload_counts_once_and_with_another_is_refused,
    test_a_resent_call_id_counts_once,
    test_a_store_from_before_record_refs_opens_and_keeps_its_rows,
    test_feedback_round_trip_and_ratings,
    test_recent_counts_window_and_agent,
    test_reset_forgets_history_but_keeps_feedback,
    test_rollup_adds_to_an_existing_day,
    test_rollup_keeps_answers_and_respects_retention,
    test_server_top_and_failing,
    test_totals_per_tool,
)

NOTES = CATALOGS / "notes.json"
SMALL = models.SMALL_MODEL
SAVE = "I should call create_note to save this meeting summary."
WAIT_S = 60
BOUND_S = 240


@pytest.fixture(scope="session")
def pg():
    """One PostgreSQL server for the session; missing binaries fail (with what to install)."""
    try:
        cluster = Cluster()
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
    yield cluster
    cluster.stop()


@pytest.fixture
def pg_url(pg):
    return pg.new_database()


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def ms(pg_url, clock):
    store = open_store(pg_url)
    yield MetricsStore(store, retention_days=7, clock=clock)
    store.close()


def rows(url: str, sql: str, params=()) -> list[tuple]:
    """A read through a plain psycopg connection of its own, not the store's."""
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()


# The store itself -------------------------------------------------------------------------


def test_open_store_picks_the_backend_and_hides_the_password(pg_url, tmp_path):
    pg_store = open_store(pg_url)
    lite = open_store(str(tmp_path / "s.db"))
    try:
        assert isinstance(pg_store, PgStore) and isinstance(pg_store, Store)
        assert type(lite).__name__ == "SQLiteStore" and isinstance(lite, Store)
    finally:
        pg_store.close()
        lite.close()
    assert display("postgresql://me:s3cret@db.example:5433/hist") == "postgresql://me@db.example:5433/hist"
    assert pg_ddl("x REAL, b BLOB, n INTEGER, t TEXT) WITHOUT ROWID") == 'x DOUBLE PRECISION, b BYTEA, n BIGINT, t TEXT COLLATE "C")'


def test_the_traffic_log_keeps_its_bounds_on_postgresql(pg_url):
    from tests.test_traffic import check_bounded_log

    store = open_store(pg_url)
    try:
        check_bounded_log(store)
    finally:
        store.close()


def test_a_store_that_cannot_be_reached_is_one_clear_line(pg):
    dead = f"postgresql://nobody:pw@127.0.0.1:{pg.port + 1 if pg.port < 65535 else 1}/nothing"
    with pytest.raises(StoreError) as err:
        open_store(dead)
    msg = str(err.value)
    assert msg.startswith("cannot open store postgresql://nobody@127.0.0.1:") and "\n" not in msg and "pw" not in msg
    done = subprocess.run([sys.executable, "-m", "sidecar", "metrics", "--store", dead, "--json"], capture_output=True, text=True,
                          cwd=ROOT, timeout=WAIT_S, check=False)  # fmt: skip
    assert done.returncode != 0
    assert done.stderr.count("\n") == 1 and "cannot open store postgresql://nobody@" in done.stderr and "Traceback" not in done.stderr


def test_embedding_cache_and_file_digests(pg_url, tmp_path):
    store = open_store(pg_url)
    rng = np.random.default_rng(0)
    vecs = {f"k{i}": rng.standard_normal(384).astype(np.float32) for i in range(700)}  # more than one IN chunk
    store.put_vectors("model-a", vecs)
    store.put_vectors("model-a", {"k0": vecs["k1"]})  # an upsert replaces
    other = open_store(pg_url)  # another process's view
    got = other.vectors("model-a", [*vecs, "missing"])
    assert set(got) == set(vecs)
    assert np.array_equal(got["k0"], vecs["k1"]) and np.array_equal(got["k699"], vecs["k699"])
    assert other.vectors("model-b", vecs) == {}
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x" * 5000)
    digest = store.file_sha256(f)
    assert rows(pg_url, "SELECT size, sha256 FROM file_digest") == [(5000, digest)]
    assert other.file_sha256(f) == digest
    store.close()
    other.close()


def test_replicas_writing_at_once_lose_no_update(pg_url):
    """Four stores (as four replicas would), opened at once on an empty database and each
    recording 50 calls of one tool from its own thread: the totals are exact."""
    n, per = 4, 50
    errors: list[BaseException] = []
    ids: list[int] = []
    lock = threading.Lock()

    def replica(k: int) -> None:
        try:
            store = open_store(pg_url)
            ms = MetricsStore(store)
            got = [ms.record_call("fs", "write_file", i % 5 != 0, float(i), None if i % 5 else "EIO", call_id=f"r{k}-{i}") for i in range(per)]
            store.close()
            with lock:
                ids.extend(got)
        except Exception as e:  # noqa: BLE001  (reported below, in the test thread)
            errors.append(e)

    threads = [threading.Thread(target=replica, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S)
    assert errors == []
    assert len(set(ids)) == n * per
    ms = MetricsStore(open_store(pg_url))
    m = ms.tool("fs", "write_file")
    assert (m.call_count, m.success_count, m.failure_count) == (n * per, n * 40, n * 10)
    assert m.avg_latency_ms == pytest.approx(sum(range(per)) / per)
    assert ms.generation() == n * per


def test_a_ref_resent_through_another_replica_at_once_counts_once(pg_url):
    """Issue 33: a client that reconnects may land on another replica and resend there. Four
    replicas recording the same refs at the same moment make one row per ref; a changed
    payload under a ref is refused on any replica."""
    n, refs = 4, 25
    errors: list[BaseException] = []
    ids: dict[int | str, set[int]] = {i: set() for i in [*range(refs), "feedback"]}
    lock = threading.Lock()
    barrier = threading.Barrier(n)

    def replica() -> None:
        try:
            store = open_store(pg_url)
            ms = MetricsStore(store)
            barrier.wait(BOUND_S)
            got = [(i, ms.record_call("fs", "read_file", True, 1.0, call_id=f"key\x1f{i}", digest=f"d{i}")) for i in range(refs)]
            got.append(("feedback", ms.record_feedback(Feedback(query="q", recommended=["read_file"], rating=3.0), "key\x1ff", "df")))
            store.close()
            with lock:
                for i, row in got:
                    ids[i].add(row)
        except Exception as e:  # noqa: BLE001  (reported below, in the test thread)
            errors.append(e)

    threads = [threading.Thread(target=replica) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S)
    assert errors == []
    assert all(len(rows) == 1 for rows in ids.values()), ids
    other = MetricsStore(open_store(pg_url))
    assert other.tool("fs", "read_file").call_count == refs
    assert rows(pg_url, "SELECT count(*) FROM feedback") == [(1,)]
    with pytest.raises(RefReused):
        other.record_call("fs", "read_file", False, 1.0, "EIO", call_id="key\x1f3", digest="changed")


def test_a_write_waits_a_bounded_time_for_another_replicas_lock(pg_url):
    ms = MetricsStore(open_store(pg_url), write_timeout_s=0.5)
    ms.record_call("fs", "read_file", True, 1.0)
    with psycopg.connect(pg_url) as holder:  # another replica, mid-transaction on the shared counter
        holder.execute("UPDATE metrics_state SET value = value WHERE key='generation'")
        t0 = time.perf_counter()
        with pytest.raises(StoreBusy, match="locked by another process"):
            ms.record_call("fs", "read_file", True, 1.0, call_id="busy")
        waited = time.perf_counter() - t0
        assert ms.tool("fs", "read_file").call_count == 1  # reads are not held up by the lock
        holder.rollback()
    assert 0.4 < waited < 3.0
    ms.record_call("fs", "read_file", True, 1.0, call_id="busy")  # resent once the lock went
    assert ms.tool("fs", "read_file").call_count == 2


def test_acknowledged_calls_survive_kill_9_of_the_writer(pg_url):
    """test_metrics' writer, pointed at PostgreSQL: every id it printed is in the database."""
    acked = acked_then_killed(pg_url)
    ids = {r[0] for r in rows(pg_url, "SELECT id FROM tool_calls")}
    assert set(acked) <= ids
    [(calls, ok, failed)] = rows(pg_url, "SELECT call_count, success_count, failure_count FROM tool_metrics")
    assert calls == len(ids) and ok + failed == calls  # totals moved in the same transactions


# Two `sidecar serve` processes on one database -------------------------------------------------


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, BOUND_S))


def replicas(store: str, tmp: pathlib.Path, n: int = 2):
    """`n` real `sidecar serve` processes (the small model, notes.json) on `store`, started at once."""
    return serve_processes([["--model", SMALL, "--catalog", str(NOTES), "--store", store]] * n, tmp)


def injected(msgs) -> list[str]:
    return [t.definition["name"] for m in msgs if isinstance(m, p.Inject) for t in m.tools]


async def until(sc: SidecarClient, pred, limit: int = 1000) -> list:
    out = []
    for _ in range(limit):
        out.append(msg := await sc.recv(WAIT_S))
        if pred(msg):
            return out
    raise AssertionError(f"no matching message in {limit}: {out[-5:]}")


async def ask(url: str, agent: str, stream: str) -> list[str]:
    async with await SidecarClient.connect(url, session=f"ask-{stream}", agent=agent) as sc:
        await sc.user(stream, SAVE)
        await sc.end(stream)
        return injected(await until(sc, lambda m: isinstance(m, p.Ended)))


async def fail(url: str, agent: str, n: int) -> list[p.Ack]:
    async with await SidecarClient.connect(url, session=f"fail-{agent}", agent=agent) as sc:
        for i in range(n):
            await sc.tool_result("create_note", False, 10.0, "notes backend down", ref=f"{agent}-{i}")
        return [await sc.recv(WAIT_S) for _ in range(n)]


def test_failures_recorded_through_one_replica_change_what_the_other_injects(pg_url, tmp_path):
    secret = pg_url.replace("@", ":s3cret-pw@", 1)  # the test cluster trusts local connections: any password does

    async def body():
        with replicas(secret, tmp_path) as (a, b):
            lines = [ln for ln in a.log_text().splitlines() if "listening on" in ln]
            before = await ask(b.url, "dave", "before")
            acks = []
            for agent in ("mallory", "bob", "carol"):  # three distinct connections, all through A
                acks += await fail(a.url, agent, 2)
            after = await ask(b.url, "dave", "after")  # dave asks B, which recorded none of them
            return before, acks, after, lines, a.log_text() + b.log_text()

    before, acks, after, lines, logs = run(body())
    assert len(lines) == 1 and f", store {pg_url}, " in lines[0], lines  # the start-up line names the store ...
    assert "s3cret" not in logs  # ... never its password
    assert all(isinstance(m, p.Ack) for m in acks), acks
    assert "create_note" in before
    assert "create_note" not in after  # B read A's failures from the shared store: the server is failing for everyone
    assert rows(pg_url, "SELECT count(*), count(DISTINCT reporter) FROM tool_calls WHERE success = 0") == [(6, 3)]
    listing = subprocess.run([sys.executable, "-m", "sidecar", "metrics", "--store", pg_url, "--json"], capture_output=True,
                             text=True, cwd=ROOT, timeout=WAIT_S, check=False)  # fmt: skip
    assert listing.returncode == 0, listing.stderr
    [tool] = json.loads(listing.stdout)["tools"]
    assert (tool["tool"], tool["call_count"], tool["failure_count"], tool["last_error"]) == ("create_note", 6, 6, "notes backend down")


def test_a_kill_9_of_one_replica_loses_no_acknowledged_result_and_the_other_goes_on(pg_url, tmp_path):
    n = 300

    async def body():
        with replicas(pg_url, tmp_path) as (a, b):
            acked: set[str] = set()
            sa = await SidecarClient.connect(a.url, session="to-a", wait_s=WAIT_S)
            sb = await SidecarClient.connect(b.url, session="to-b", wait_s=WAIT_S)
            for i in range(n):
                await sa.tool_result("create_note" if i % 2 else "semantic_search", bool(i % 3), float(i), ref=f"a{i}")
                await sb.tool_result("create_note", True, float(i), ref=f"b{i}")
            b_acks = 0
            for _ in range(n):
                msg = await sa.recv(WAIT_S)
                assert isinstance(msg, p.Ack), msg
                acked.add(msg.ref)
                if len(acked) == n // 3:
                    a.proc.send_signal(signal.SIGKILL)  # mid-stream: later results may be lost, acked ones not
                    break
            with contextlib.suppress(Exception):  # acks already on the wire before the kill count too
                for _ in range(n):
                    if isinstance(msg := await sa.recv(5), p.Ack):
                        acked.add(msg.ref)
            assert await asyncio.to_thread(a.proc.wait, WAIT_S) == -signal.SIGKILL
            for _ in range(n):  # B acknowledges every one of its own
                msg = await sb.recv(WAIT_S)
                b_acks += isinstance(msg, p.Ack)
            await sb.close()
            return acked, b_acks

    acked, b_acks = run(body())
    stored = {row[0].split("\x1f")[1] for row in rows(pg_url, "SELECT call_id FROM tool_calls")}
    assert len(acked) >= n // 3
    assert {json.dumps(ref) for ref in acked} <= stored
    assert b_acks == n and {json.dumps(f"b{i}") for i in range(n)} <= stored
    [(calls,)] = rows(pg_url, "SELECT sum(call_count) FROM tool_metrics")
    assert calls == len(stored)  # totals committed with their rows, nothing half-written


def test_replicas_rolling_up_at_once_count_each_old_call_once(pg_url, clock):
    """Two replicas' daily roll-ups started together (as both do at start-up): the old raw
    calls are folded into the daily rows exactly once."""
    a = MetricsStore(open_store(pg_url), clock=clock)
    b = MetricsStore(open_store(pg_url), clock=clock)
    for rnd in range(3):
        old = clock.t - (10 + rnd) * 86400.0
        for i in range(200):
            a.record_call("fs", "read_file", i % 4 != 0, 1.0, ts=old + i)
        a.record_call("fs", "read_file", True, 1.0, ts=clock.t - 60)  # inside retention: stays raw
        gate = threading.Barrier(2)
        stats: list = []

        def roll(ms, gate, stats):
            gate.wait()
            stats.append(ms.rollup())

        threads = [threading.Thread(target=roll, args=(ms, gate, stats)) for ms in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(BOUND_S)
        assert sorted(s.rows for s in stats) == [0, 200]  # one of them folded them all, the other found none
        clock.t += 1
    assert rows(pg_url, "SELECT sum(call_count)::int, sum(success_count)::int FROM tool_metrics_daily") == [(600, 450)]
    assert rows(pg_url, "SELECT count(*) FROM tool_calls") == [(3,)]
    assert a.all(days=30)[0].call_count == 603 == b.tool("fs", "read_file").call_count


def test_a_store_whose_connections_were_cut_carries_on(pg_url):
    """The database drops every connection of the store (a restart, a failover): the next read
    and the next write open new ones; no record is lost or counted twice."""
    ms = MetricsStore(open_store(pg_url))
    ms.record_call("fs", "read_file", True, 1.0, call_id="before")
    [(killed,)] = rows(pg_url, "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                               "WHERE application_name = 'sidecar' AND datname = current_database()")  # fmt: skip
    assert killed == 2  # its writer and its reader
    assert ms.tool("fs", "read_file").call_count == 1
    rows(pg_url, "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = 'sidecar' "
                 "AND datname = current_database()")  # fmt: skip
    ms.record_call("fs", "read_file", False, 1.0, "EIO", call_id="after")
    m = ms.tool("fs", "read_file")
    assert (m.call_count, m.failure_count) == (2, 1)
    assert rows(pg_url, "SELECT call_id FROM tool_calls ORDER BY id") == [("before",), ("after",)]


def test_rankings_go_on_with_neutral_history_while_the_database_is_down(tmp_path):
    """Fail open: with the shared database gone (a server of its own here, stopped mid-test),
    a fired text still gets its tools, ranked on neutral history, and the outage is counted;
    nothing ranked blind is cached, so history counts again once the database is back."""
    from sidecar import config as config_mod
    from sidecar.engine import Sidecar
    from sidecar.recommend import Recommender

    cluster = Cluster()
    try:
        history = MetricsStore(open_store(cluster.new_database()))
        cfg = config_mod.load(env={}, overrides={("model", "name"): SMALL, ("catalogs",): [str(NOTES)],
                                                 ("store",): str(tmp_path / "index.db")})  # fmt: skip
        engine = Sidecar.open(cfg, progress=False, history=False)  # the index in SQLite: only the history is remote
        failing = "create_note"
        for _ in range(6):
            history.record_call(*key_of(engine.catalog, failing), False, 5.0, "EIO")
        rec = Recommender(engine.pipeline, history, cfg.recommend)
        query = "save this meeting summary as a new note"
        up = rec.recommend(query, top=10)
        assert failing in up.excluded and failing not in [r.tool for r in up.results]  # its server fails while the database is up
        assert rec.history_errors == 0
        cluster.stop()
        down = rec.recommend(query + " please", top=10)
        assert down.results and rec.history_errors > 0
        assert {r.tool: r.factors.success for r in down.results}[failing] > 0.0  # neutral: as if never called
        assert not down.cached and rec.recommend(query + " please", top=10).cached is False  # a blind ranking is not kept
        assert rec.fallbacks(failing)  # stand-ins for a failed tool too
    finally:
        cluster.stop()
