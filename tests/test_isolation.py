"""Regression tests for issue 13 C, D, H, J: isolation between sessions over a real
SidecarServer on 127.0.0.1, with real websocket clients, the real small model and a real
SQLite file (a second process holds its write lock for J).

C: a client that reads promptly is never closed for a burst (flow control), one that does
not read is closed with 1013; D: bounded, round-robin batches and a big `hello` catalog
embedded in slices, so one client's work does not stall another's; H: one session's failure
reports do not take a tool away from everyone; J: acks wait a bounded time for another
process's write lock, retry, and never end in a traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest
import websockets

from sidecar import protocol as p
from sidecar.client import SidecarClient
from sidecar.core.catalog import Tool
from sidecar.store.metrics import MetricsStore
from sidecar.serve.server import SHARED_WINDOW_S, slice_starts, tool_chars
from sidecar.store import open_store

from .test_hardening import metrics_of, tracebacks
from .test_server import (  # noqa: F401  (pipelines, small: fixtures)
    SAVE,
    WAIT_S,
    injected,
    pipelines,
    run,
    serving,
    small,
    until,
)


def conn_of(srv, session: str):
    return next(c for c in srv.connections.values() if c.session.hello and c.session.hello.session == session)


# C: delivery respects the reader -----------------------------------------------------------


def test_a_client_that_reads_promptly_is_never_closed_for_a_burst_of_results(small, caplog):
    n, outbox = 120, 16  # each batch of up to 64 turns answers with up to 128 messages at once

    async def body():
        async with serving(small, outbox_messages=outbox, stale_ms=120_000, shed_ms=120_000) as srv, \
                   await SidecarClient.connect(srv.url, session="burst", decisions=True) as sc:  # fmt: skip
            conn = conn_of(srv, "burst")
            most = 0

            async def reader() -> list[p.ServerMessage]:
                nonlocal most
                got = []
                while not any(isinstance(m, p.Ended) for m in got):
                    got.append(await sc.recv(WAIT_S))
                    most = max(most, conn.outbox.qsize())
                return got

            reading = asyncio.create_task(reader())
            for i in range(n):
                await sc.user("turns", f"Create a note number {i}.")
            await sc.end("turns")
            msgs = await reading
            return msgs, most, conn.cap, sc.ws.close_code

    with caplog.at_level(logging.WARNING):
        msgs, most, cap, code = run(body())
    assert code is None and not [r for r in caplog.records if "not reading" in r.getMessage()]
    assert sum(isinstance(m, p.DecisionReport) for m in msgs) == n  # every turn answered, none lost
    assert most < cap  # flow control kept the outbox under its hard bound


def test_a_client_that_does_not_read_is_closed_with_1013_and_others_go_on(small, caplog):
    async def body():
        async with serving(small, send_timeout_s=1.0, outbox_messages=64, stale_ms=120_000, shed_ms=120_000) as srv, \
                   await SidecarClient.connect(srv.url, session="probe") as probe:  # fmt: skip
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window fills soon
            sock.connect(("127.0.0.1", srv.port))
            sock.setblocking(False)
            ws = await websockets.connect(srv.url, sock=sock, max_queue=1, compression=None)
            # every inject carries this 600 KB definition: the socket's buffers fill within a few
            big = {"name": "create_note", "description": "Create a new note in the knowledge base with a title and markdown content.",
                   "inputSchema": {"type": "object", "properties": {"content": {"type": "string", "description": "x" * 600_000}}}}
            await ws.send(json.dumps({"type": "hello", "session": "deaf", "tools": [big]}))
            for _ in range(1000):
                if conn_of_or_none(srv, "deaf") is not None:
                    break
                await asyncio.sleep(0.01)
            text = "I should call create_note to save this meeting summary."
            t0 = time.monotonic()
            for i in range(400):  # never reads a thing
                await ws.send(json.dumps({"type": "user", "stream": f"u{i}", "text": f"{text} {i}"}))
                if conn_of_or_none(srv, "deaf") is None:
                    break
            while conn_of_or_none(srv, "deaf") is not None and time.monotonic() - t0 < 60:
                await asyncio.sleep(0.05)
            gone = conn_of_or_none(srv, "deaf") is None
            await probe.user("p", SAVE)  # the other client is unaffected
            msgs = await until(probe, lambda m: isinstance(m, p.Inject))
            ws.transport.abort()
            return gone, injected(msgs)

    with caplog.at_level(logging.WARNING):
        gone, tools = run(body())
    assert gone
    assert any("not reading" in r.getMessage() and "1013" in r.getMessage() for r in caplog.records)
    assert tools and tracebacks(caplog) == []


def conn_of_or_none(srv, session: str):
    return next((c for c in srv.connections.values() if c.session.hello and c.session.hello.session == session), None)


# D: one client's work does not stall everyone ------------------------------------------------


def test_batches_are_bounded_and_round_robin_so_a_probe_is_not_held_behind_a_flood(small):
    flood, per_batch = 160, 8

    async def body():
        async with serving(small, max_batch_spans=per_batch, stale_ms=120_000, shed_ms=120_000, max_queued_per_connection=512) as srv, \
                   await SidecarClient.connect(srv.url, session="flood", decisions=True) as sc, \
                   await SidecarClient.connect(srv.url, session="probe") as probe:  # fmt: skip
            release = threading.Event()
            hold = srv._worker.submit(release.wait)  # the model thread is busy while everything queues
            try:
                for i in range(flood):
                    await sc.user(f"u{i}", f"Please make a note called item {i}.")
                await sc.ping()
                assert isinstance(await sc.recv(WAIT_S), p.Pong)  # every turn was read and queued
                await probe.user("p", SAVE)
                mine = conn_of(srv, "probe").session
                for _ in range(1000):
                    if srv.pending.count(mine):
                        break
                    await asyncio.sleep(0.01)
            finally:
                t0 = time.perf_counter()
                release.set()
            hold.result(WAIT_S)
            probe_msgs = await until(probe, lambda m: isinstance(m, p.Inject))
            t_probe = time.perf_counter() - t0
            flood_msgs = []
            while sum(isinstance(m, p.DecisionReport) for m in flood_msgs) < flood:
                flood_msgs.append(await sc.recv(WAIT_S))
            t_flood = time.perf_counter() - t0
            return injected(probe_msgs), t_probe, t_flood, await metrics_of(srv)

    tools, t_probe, t_flood, m = run(body())
    assert tools
    assert m['sidecar_batch_size_bucket{le="8.0"}'] == m["sidecar_batch_size_count"]  # no batch over max_batch_spans
    assert m["sidecar_batch_size_count"] >= (flood + 1) / per_batch
    assert t_probe < 0.3 * t_flood, (t_probe, t_flood)  # judged in the first round, not after the flood


def test_batches_are_bounded_in_milliseconds(small):
    async def body():
        async with serving(small, max_batch_ms=0.001, stale_ms=120_000, shed_ms=120_000) as srv, \
                   await SidecarClient.connect(srv.url, session="ms", decisions=True) as sc:  # fmt: skip
            await sc.user("warm", "Please make a note called warm up.")  # a first batch measures the cost
            await until(sc, lambda m: isinstance(m, p.DecisionReport))
            for i in range(24):
                await sc.user(f"u{i}", f"Please make a note called item {i}.")
            await until(sc, lambda m: isinstance(m, p.DecisionReport) and m.stream == "u23", limit=100)
            return await metrics_of(srv)

    m = run(body())
    # once a batch has measured the model's cost, a budget far below one span's cost lets each
    # batch take exactly one span (the first span of a batch is always taken)
    assert m["sidecar_batch_size_count"] == 1 + 24
    assert m['sidecar_batch_size_bucket{le="1.0"}'] == m["sidecar_batch_size_count"]


def test_batches_shrink_to_shared_batch_ms_while_a_light_connection_shares_the_model(small):
    """A lone stream keeps big batches (throughput); once a light connection (at most one span
    waiting) that has spans waiting or was just answered shares the model with a busy one, each
    batch stops at about shared_batch_ms, so the light one's span that arrives behind one waits
    a short batch (issue 33). Two busy connections (many spans waiting each) keep big batches:
    round-robin keeps them fair, and a short batch would speed up neither's next span."""

    async def body():
        async with serving(small, max_batch_ms=120_000, shared_batch_ms=0.001, stale_ms=120_000, shed_ms=120_000) as srv, \
                   await SidecarClient.connect(srv.url, session="a", decisions=True) as a:  # fmt: skip
            await a.user("warm", "Please make a note called warm up.")  # measures the model's cost
            await until(a, lambda m: isinstance(m, p.DecisionReport))
            await asyncio.sleep(SHARED_WINDOW_S + 0.2)

            async def batches(send, last: str) -> float:
                before = (await metrics_of(srv))["sidecar_batch_size_count"]
                await send()
                await until(a, lambda m: isinstance(m, p.DecisionReport) and m.stream == last, limit=200)
                return (await metrics_of(srv))["sidecar_batch_size_count"] - before

            async def flood(tag: str) -> None:
                for i in range(24):
                    await a.user(f"{tag}{i}", f"Please make a note called {tag} {i}.")

            alone = await batches(lambda: flood("alone"), "alone23")
            async with await SidecarClient.connect(srv.url, session="b", decisions=True) as b:
                await b.user("b0", "Please make a note called beside.")  # light: one span, answered
                await until(b, lambda m: isinstance(m, p.DecisionReport))
                beside_light = await batches(lambda: flood("light"), "light23")
                await asyncio.sleep(SHARED_WINDOW_S + 0.2)

                async def both() -> None:
                    for i in range(24):
                        await b.user(f"t{i}", f"Please make a note called together {i}.")
                    await flood("busy")

                beside_busy = await batches(both, "busy23")
                await until(b, lambda m: isinstance(m, p.DecisionReport) and m.stream == "t23", limit=200)
            return alone, beside_light, beside_busy

    alone, beside_light, beside_busy = run(body())
    assert alone <= 8, alone  # a lone stream's 24 spans went in a few big batches
    assert beside_light >= 24, beside_light  # a light neighbour: a budget below one span's cost takes one span a batch
    assert beside_busy <= 24, beside_busy  # two busy connections, 48 spans: big batches again


def test_a_hello_of_huge_descriptions_is_sliced_by_estimated_work():
    big = [Tool(name=f"big_{i}", description="x" * 5000) for i in range(4)]
    short = [Tool(name=f"short_{i}", description="Look up one record.") for i in range(20)]
    assert slice_starts(big + short, 8, None, 0.04) == [0, 8, 16]  # cost not measured yet: by count
    per_char = 0.03 / tool_chars(big[0])  # one huge tool is about 30 ms of the model's time
    starts = slice_starts(big + short, 8, per_char, 0.04)
    assert starts[:5] == [0, 1, 2, 3, 4]  # one huge tool a job
    assert all(b - a <= 8 for a, b in zip(starts, starts[1:] + [len(big + short)]))
    assert slice_starts([], 8, per_char, 0.04) == []


def _tools(n: int) -> list[dict]:
    tag = uuid.uuid4().hex[:8]  # never seen before: nothing in the embedding cache
    return [{"name": f"tool_{tag}_{i}", "description": f"Look up the {tag} inventory record number {i} in warehouse {i % 7}.",
             "inputSchema": {"type": "object", "properties": {"id": {"type": "string"}}}} for i in range(n)]  # fmt: skip


def test_a_big_hello_catalog_is_embedded_in_slices_between_other_sessions_batches(small):
    async def body():
        async with serving(small, catalog_slice_tools=4) as srv, \
                   await SidecarClient.connect(srv.url, session="probe") as probe:  # fmt: skip
            ws = await websockets.connect(srv.url, compression=None)
            t0 = time.perf_counter()
            await ws.send(json.dumps({"type": "hello", "session": "big", "tools": _tools(96)}))
            await asyncio.sleep(0.2)  # the slices are under way
            t1 = time.perf_counter()
            await probe.user("p", SAVE)
            msgs = await until(probe, lambda m: isinstance(m, p.Inject))
            t_probe = time.perf_counter() - t1
            ready = json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))
            t_ready = time.perf_counter() - t0
            await ws.close()
            return injected(msgs), t_probe, ready, t_ready

    tools, t_probe, ready, t_ready = run(body())
    assert ready["type"] == "ready" and len(ready["tools"]) == 7 + 96
    assert tools
    assert t_probe < 0.5 * t_ready, (t_probe, t_ready)  # served between slices, not after the catalog


@pytest.mark.parametrize("mode", ["beside", "between"])
def test_a_hello_tool_of_long_texts_holds_up_no_other_session_beside_the_model(small, mode):
    """One tool whose description and six cases are each a whole context of tokens (60,000
    `(`: about 95 ms apiece with MiniLM) cannot be sliced: on the model thread it holds every
    other session's span until it is embedded, so the hello's `ready` comes first. Embedded on
    the model's second context, beside the judging, the other session is answered first."""
    tag = uuid.uuid4().hex[:8]  # nothing in the embedding cache
    tool = {"name": f"paren_{tag}", "description": "(" * 60_000, "cases": [f"{k} {tag} " + "(" * 4_000 for k in range(6)],
            "inputSchema": {"type": "object", "properties": {"q": {"type": "string"}}}}  # fmt: skip

    async def body():
        async with serving(small, hello_embed=mode) as srv, await SidecarClient.connect(srv.url, session="probe") as probe:
            ws = await websockets.connect(srv.url, compression=None, max_size=None)
            await ws.send(json.dumps({"type": "hello", "session": "parens", "tools": [tool]}))
            for _ in range(500):  # until the build is under way
                if srv._building:
                    break
                await asyncio.sleep(0.002)
            order: list[str] = []

            async def ready():
                assert json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))["type"] == "ready"
                order.append("ready")

            async def answered():
                await probe.user("p", SAVE)
                await until(probe, lambda m: isinstance(m, p.Inject))
                order.append("probe")

            await asyncio.gather(ready(), answered())
            await ws.close()
            return order

    order = run(body())
    assert order == (["probe", "ready"] if mode == "beside" else ["ready", "probe"]), order


@pytest.mark.parametrize("mode", ["beside", "inline"])
def test_a_long_user_turn_holds_up_no_other_session_beside_the_model(small, mode):
    """A user turn of a whole context of tokens (4,096 `(` once cut to max_turn_chars, 512
    tokens: about 95 ms of MiniLM) is one span no batch can split: judged on the model thread
    it holds the span of every other session that arrives meanwhile. Embedded first on the
    second context (`long_turn_embed = "beside"`), the model thread only scores it, and the
    other session, which sent later, is answered first."""
    tag = uuid.uuid4().hex[:8]  # nothing in the query cache

    async def body():
        async with serving(small, long_turn_embed=mode) as srv:
            async with await SidecarClient.connect(srv.url, session="long", decisions=True) as long, \
                       await SidecarClient.connect(srv.url, session="probe") as probe:  # fmt: skip
                order: list[str] = []

                async def the_long_one():
                    await long.user("l", f"{tag} " + "(" * 60_000)
                    await until(long, lambda m: isinstance(m, p.DecisionReport))
                    order.append("long")

                async def the_probe():
                    await asyncio.sleep(0.02)  # the long turn is read (and, inline, being judged) by then
                    await probe.user("p", f"{SAVE} {tag}")
                    await until(probe, lambda m: isinstance(m, p.Inject))
                    order.append("probe")

                hits = srv.engine.pipeline.queries.hits
                await asyncio.gather(the_long_one(), the_probe())
                return order, srv.engine.pipeline.queries.hits - hits

    order, hits = run(body())
    if mode == "beside":
        assert order == ["probe", "long"], order
        assert hits >= 1  # the model thread found the long turn's vector in the cache
    else:
        assert order == ["long", "probe"], order


def test_a_sessions_globs_are_compiled_by_its_hello_not_on_the_model_thread(small):
    """A list of globs costs 8-34 ms to compile: at the hello, on the index thread, so the
    session's first ranking (on the model thread) finds it compiled."""
    from sidecar.recommend import filters

    globs = [f"{uuid.uuid4().hex[:8]}*", "*_note*"]  # a list never compiled before

    async def body():
        async with serving(small) as srv:
            async with await SidecarClient.connect(srv.url, session="perm", permissions=globs) as sc:
                after_hello = filters._globs.cache_info()
                await sc.user("p", SAVE)
                msgs = await until(sc, lambda m: isinstance(m, p.Inject))
                after_ranking = filters._globs.cache_info()
            return after_hello, after_ranking, injected(msgs)

    before = filters._globs.cache_info()
    after_hello, after_ranking, tools = run(body())
    assert after_hello.misses == before.misses + 1  # compiled once, by the hello
    assert after_ranking.misses == after_hello.misses and after_ranking.hits > after_hello.hits  # the ranking found it
    assert tools and all("_note" in t for t in tools)


def test_a_hello_over_the_catalog_quota_is_refused_and_the_connection_lives_on(small):
    async def body():
        async with serving(small, max_hello_tools=5) as srv, websockets.connect(srv.url) as ws:
            await ws.send(json.dumps({"type": "hello", "session": "q", "tools": _tools(6)}))
            refused = json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))
            await ws.send(json.dumps({"type": "hello", "session": "q", "tools": ["create_note", *_tools(5)]}))
            ready = json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))
            return refused, ready

    refused, ready = run(body())
    assert refused["type"] == "error" and refused["code"] == "too_many_tools" and "at most 5" in refused["message"]
    assert ready["type"] == "ready" and len(ready["tools"]) == 6


# H: one session's failures do not suppress injections for all ---------------------------------


def test_failures_from_one_session_do_not_take_a_tool_away_from_others(small):
    async def fail(url: str, agent: str, n: int, tag: str) -> None:
        async with await SidecarClient.connect(url, session="shared-name", agent=agent) as sc:
            for i in range(n):
                await sc.tool_result("create_note", False, 10.0, "boom", ref=f"{tag}-{i}")
            for _ in range(n):
                msg = await sc.recv(WAIT_S)
                assert isinstance(msg, p.Ack), msg

    async def ask(url: str, agent: str) -> list[str]:
        async with await SidecarClient.connect(url, session="victim", agent=agent) as sc:
            await sc.user("q", SAVE)
            await sc.end("q")
            return injected(await until(sc, lambda m: isinstance(m, p.Ended)))

    async def body():
        async with serving(small) as srv:
            srv.history.reset(server="notes")
            try:
                assert await ask(srv.url, "alice")  # injects before anything failed
                await fail(srv.url, "mallory", 6, "a")  # the six failures, one session
                alone = await ask(srv.url, "alice")
                own = await ask(srv.url, "mallory")  # its own history counts for its own agent
                await fail(srv.url, "bob", 1, "b")
                await fail(srv.url, "carol", 1, "c")  # now three distinct connections report it
                quorum = await ask(srv.url, "dave")
                return alone, own, quorum
            finally:
                srv.history.reset(server="notes")  # the session-scoped store is shared with other tests

    alone, own, quorum = run(body())
    assert "create_note" in alone  # one session's reports alone took nothing away from alice
    assert own == []  # mallory's own failures exclude the failing server for mallory
    assert quorum == []  # failures from three distinct connections: failing for everyone


# J: store contention ---------------------------------------------------------------------------

HOLDER = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
db.execute("BEGIN IMMEDIATE")
db.execute("UPDATE metrics_state SET value = value WHERE key='last_rollup'")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
db.execute("COMMIT")
print("released", flush=True)
"""


async def hold_lock(path, seconds: float) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", HOLDER, str(path), str(seconds), stdout=subprocess.PIPE)
    assert (await asyncio.wait_for(proc.stdout.readline(), WAIT_S)).strip() == b"locked"
    return proc


def test_an_ack_waits_a_bounded_time_for_another_process_and_then_says_store_busy(small, caplog):
    async def body():
        async with serving(small, store_busy_timeout_ms=600) as srv, \
                   await SidecarClient.connect(srv.url, session="j", decisions=True) as sc, \
                   await SidecarClient.connect(srv.url, session="probe") as probe:  # fmt: skip
            path = srv.history.store.path
            # a short foreign writer: the ack waits for it, then comes
            proc = await hold_lock(path, 0.3)
            t0 = time.perf_counter()
            await sc.tool_result("create_note", True, 5.0, ref="j-1")
            ack = await sc.recv(WAIT_S)
            waited = time.perf_counter() - t0
            await proc.wait()
            # a long one: a typed store_busy after the bound, while others are served
            proc = await hold_lock(path, 4.0)
            t0 = time.perf_counter()
            await sc.tool_result("create_note", True, 5.0, ref="j-2")
            await probe.user("p", SAVE)
            probe_msgs = await until(probe, lambda m: isinstance(m, p.Inject))
            t_probe = time.perf_counter() - t0
            busy = await sc.recv(WAIT_S)
            t_busy = time.perf_counter() - t0
            # `sidecar metrics` opening the same store while it is locked: reads only, no wait
            t1 = time.perf_counter()
            reader = open_store(path)
            MetricsStore(reader).listing()
            reader.close()
            t_open = time.perf_counter() - t1
            await proc.wait()
            await sc.tool_result("create_note", True, 5.0, ref="j-2")  # resent after the lock went
            again = await sc.recv(WAIT_S)
            await sc.tool_result("create_note", True, 5.0, ref="j-2")  # and once more: counted once
            third = await sc.recv(WAIT_S)
            return ack, waited, injected(probe_msgs), t_probe, busy, t_busy, t_open, again, third

    with caplog.at_level(logging.WARNING):
        ack, waited, probe_tools, t_probe, busy, t_busy, t_open, again, third = run(body())
    assert isinstance(ack, p.Ack) and ack.ref == "j-1"
    assert waited < 3.0  # behind a 0.3 s writer, not a 10 s busy timeout
    assert isinstance(busy, p.Error) and busy.code == "store_busy" and busy.ref == "j-2"
    assert t_busy < 3.5  # the 0.6 s bound, not the 4 s writer
    assert probe_tools and t_probe < t_busy  # the model thread never waited on the lock
    assert t_open < 1.0
    assert isinstance(again, p.Ack) and isinstance(third, p.Ack) and again.id == third.id
    assert tracebacks(caplog) == []
    assert any("not recorded" in r.getMessage() and "locked by another process" in r.getMessage() for r in caplog.records)


def test_a_hellos_own_tools_leave_nothing_in_the_store(small):
    """Issue 13 I: a session's tool definitions are embedded for it, not kept: the embedding
    cache and the stored index rows are what they were once it has its catalog."""
    tag = uuid.uuid4().hex[:8]
    tools = [{"name": f"brew_{tag}_{k}", "description": f"Brew a pot of {kind} tea at the right temperature ({tag}).",
              "inputSchema": {"type": "object"}} for k, kind in enumerate(("green", "black", "oolong"))]  # fmt: skip

    def counts() -> tuple[int, ...]:
        return tuple(small.store.query(f"SELECT count(*) FROM {t}")[0][0] for t in ("embedding_cache", "index_rows"))

    async def body():
        async with serving(small) as srv, websockets.connect(srv.url) as ws:
            before = counts()
            await ws.send(json.dumps({"type": "hello", "session": "tea", "tools": tools}))
            ready = json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))
            # MiniLM: 0.87-0.90 over its 0.83 bar for six random tags ("Can you make oolong tea
            # now?" gave 0.62-0.66, under the bar since a refit moved it over 0.67)
            await ws.send(json.dumps({"type": "user", "stream": "u", "text": "Please brew oolong tea at the right temperature for me."}))
            await ws.send(json.dumps({"type": "end", "stream": "u"}))
            msgs = []
            while not msgs or msgs[-1]["type"] != "ended":
                msgs.append(json.loads(await asyncio.wait_for(ws.recv(), WAIT_S)))
            return before, ready, msgs, counts()

    before, ready, msgs, after = run(body())
    assert ready["type"] == "ready" and tools[2]["name"] in ready["tools"]
    injected = [t["definition"]["name"] for m in msgs if m["type"] == "inject" for t in m["tools"]]
    assert injected and injected[0] == tools[2]["name"], msgs  # judged with them ...
    assert after == before  # ... and nothing of them stored
