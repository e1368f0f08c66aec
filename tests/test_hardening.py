"""Regression tests for issue 13 (hardening the server), each over a real SidecarServer on
127.0.0.1 with real websocket clients, the real small model and a real SQLite file.

A: frames that used to close their connection with 1011; B: error codes of truncated JSON and
oversized refs; F: regex timeouts fail closed and are exported; E: bounded `end` bookkeeping
and input backpressure; K: start-up errors before "listening on"; G: records scoped to the
connection, not the client-chosen session name; I: stored strings capped.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import sqlite3
import sys
import threading

import pytest
import websockets

from sidecar import protocol as p
from sidecar.client import SidecarClient
from sidecar.config import ServerConfig
from sidecar.core.patterns import GatePatterns, PatternSet, parse

from .conftest import ROOT
from .test_server import (  # noqa: F401  (pipelines, small: fixtures)
    NOTES,
    SMALL,
    WAIT_S,
    _serve,
    decisions,
    http_get,
    parse_metrics,
    pipelines,
    raw_exchange,
    run,
    serving,
    small,
    until,
)

REQUEST = "Can you search my notes for the kubernetes setup?"


def tracebacks(caplog) -> list[str]:
    """Log records of the sidecar that carry a traceback (a bug, never a client's fault)."""
    return [r.getMessage() for r in caplog.records if r.name.startswith("sidecar") and r.exc_info]


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


async def metrics_of(srv) -> dict[str, float]:
    return parse_metrics((await http_get(srv.port, "/metrics"))[2])


# A, B: bad frames ---------------------------------------------------------------------------


def test_frames_that_closed_the_connection_with_1011_get_typed_errors_and_it_lives_on(small, caplog):
    deep_schema = {"name": "deep", "description": "A deep schema.", "inputSchema": {"type": "object"}}
    node = deep_schema["inputSchema"]
    for _ in range(100):
        node["properties"] = {"x": {"type": "object"}}
        node = node["properties"]["x"]

    async def body():
        async with serving(small) as srv, websockets.connect(srv.url) as ws:
            cases = [
                (b'{"type":"\xff"}', "bad_json"),  # invalid UTF-8 inside a JSON string: UnicodeDecodeError
                (b'{"type":"user","stream":"a","text":"\xc3"}', "bad_json"),
                (nested(1000), "bad_json"),  # RecursionError
                ('{"a":' * 1000 + "1" + "}" * 1000, "bad_json"),
                ('{"type":"hello","session":"x","tools":' + nested(1000) + "}", "bad_json"),
                ("[1,2", "bad_json"),  # truncated: not valid JSON, whatever its first token
                ("[1, 2]", "bad_message"),
                ('{"type":' + "9" * 4300 + "}", "unknown_type"),
                ('{"type":"hello","session":"x","tools":[' + ",".join(["{}"] * (p.MAX_VALUES + 1)) + "]}", "too_many_values"),
            ]
            for frame, code in cases:
                e = await raw_exchange(ws, frame)
                assert (e["type"], e["code"]) == ("error", code), (frame[:40], e)
                assert len(e["message"]) < 400  # an error never echoes the frame back
            e = await raw_exchange(ws, json.dumps({"type": "hello", "session": "x", "tools": [deep_schema]}))
            assert e["code"] == "bad_json" and f"deeper than {p.MAX_DEPTH}" in e["message"]
            e = await raw_exchange(ws, json.dumps({"type": "user", "stream": "s", "text": "[" * 5000}))
            assert e["code"] == "no_hello"  # brackets inside a string are text, not nesting
            assert (await raw_exchange(ws, '{"type": "hello", "session": "x"}'))["type"] == "ready"
            refs = ["9" * 4300, "9" * 25, json.dumps("r" * (p.MAX_REF_CHARS + 1))]
            for ref in refs:
                e = await raw_exchange(ws, '{"type":"tool_result","tool":"create_note","ok":true,"latency_ms":1,"ref":' + ref + "}")
                assert e["code"] == "invalid_field" and "ref" in e["message"], e
                assert "ref" not in e  # not echoed: it is the problem
            e = await raw_exchange(ws, '{"type":"tool_result","tool":"create_note","ok":true,"latency_ms":1,"ref":"r-1"}')
            assert (e["type"], e["ref"]) == ("ack", "r-1")  # a valid ref still works
            assert (await raw_exchange(ws, '{"type": "ping"}'))["type"] == "pong"
            assert ws.close_code is None
            return await metrics_of(srv)

    with caplog.at_level(logging.WARNING):
        m = run(body())
    assert m.get('sidecar_errors_total{code="internal"}', 0) == 0
    assert tracebacks(caplog) == []


# F: regex safety ----------------------------------------------------------------------------


def test_long_adversarial_turns_never_time_out_and_a_padded_negative_is_still_matched(small):
    padded = f"{REQUEST} " + "a " * 30_000 + " Delete operations are slow."  # the turn

    async def body():
        async with serving(small) as srv, await SidecarClient.connect(srv.url, session="long", decisions=True) as sc:
            before = await metrics_of(srv)
            await sc.user("u1", "a-" * 50_000)  # names_artifact took 7.7 s on this
            await sc.user("u2", padded)
            await sc.user("u3", REQUEST)
            got = [m for m in await decisions(sc, 3) if isinstance(m, p.DecisionReport)]
            after = await metrics_of(srv)
        return before, got, after

    before, got, after = run(body())
    by_stream = {d.stream: d for d in got}
    assert by_stream["u2"].path == "fallback:negative:verb_as_noun"  # matched (and weighed by the head), not timed out
    assert by_stream["u3"].path == "high:request"  # the same request without the negative phrase
    for s in ("negative", "high"):
        key = f'sidecar_regex_timeouts_total{{set="{s}"}}'
        assert after[key] == before[key]  # no search hit its budget


def test_a_negative_pattern_that_times_out_blocks_and_is_counted_in_metrics_and_logged_once(small, caplog):
    evil, _ = parse("evil (a|aa)+$\n", "evil-negative.txt")  # passes the lint, backtracks for hours
    pipe = copy.copy(small)
    pipe.patterns = GatePatterns(PatternSet(evil, 0.005, name="negative", fail_closed=True), small.patterns.high)
    trap = f"{REQUEST} " + "a" * 40 + "b"

    async def body():
        async with serving(pipe) as srv, await SidecarClient.connect(srv.url, session="evil", decisions=True) as sc:
            await sc.user("u1", trap)
            await sc.user("u2", trap)
            await sc.user("u3", REQUEST)  # no run of a's: evil fails fast, the request fires
            got = [m for m in await decisions(sc, 3) if isinstance(m, p.DecisionReport)]
            return got, await metrics_of(srv)

    with caplog.at_level(logging.WARNING, logger="sidecar.patterns"):
        got, m = run(body())
    by_stream = {d.stream: d for d in got}
    assert by_stream["u1"].path == by_stream["u2"].path == "negative:evil"  # failed closed: blocked
    assert not by_stream["u1"].fired and not by_stream["u2"].fired
    assert by_stream["u3"].path == "high:request" and by_stream["u3"].fired
    assert m['sidecar_regex_timeouts_total{set="negative"}'] == 2
    assert m['sidecar_regex_timeouts_total{set="high"}'] == 0
    logged = [r.getMessage() for r in caplog.records if "'evil'" in r.getMessage()]
    assert len(logged) == 1 and "evil-negative.txt:1" in logged[0]


# E: bounded `end` bookkeeping, backpressure ----------------------------------------------


def test_repeated_ends_of_one_stream_cost_one_entry_and_each_gets_its_ended(small):
    n = 2000

    async def body():
        async with serving(small) as srv, await SidecarClient.connect(srv.url, session="ends") as sc:
            await sc.user("u", REQUEST)
            sizes: list[int] = []

            async def reader() -> int:
                ended = 0
                while ended < n:
                    if isinstance(await sc.recv(WAIT_S), p.Ended):
                        ended += 1
                return ended

            reading = asyncio.create_task(reader())
            for _ in range(n):
                await sc.end("u")
                sizes.append(len(srv._ending))
            got = await reading
            return got, max(sizes), len(srv._ending)

    got, most, left = run(body())
    assert got == n  # one `ended` answers each `end` ...
    assert most <= 1 and left == 0  # ... and the waiting ones are one entry, not n


def test_a_connection_over_its_quota_is_not_read_until_the_model_takes_its_work(small):
    quota, flood = 4, 400

    async def body():
        async with serving(small, max_queued_per_connection=quota) as srv:
            release = threading.Event()
            async with await SidecarClient.connect(srv.url, session="flood", decisions=True) as sc, \
                       await SidecarClient.connect(srv.url, session="probe") as probe:  # fmt: skip
                srv._worker.submit(release.wait)  # the model thread is busy elsewhere
                try:
                    for i in range(flood):  # never reads while it floods
                        await sc.user(f"u{i}", f"{REQUEST} Number {i}.")
                        await sc.end(f"u{i}")
                    await sc.ping()
                    for _ in range(100):  # let the server read what it will
                        await asyncio.sleep(0.01)
                    [conn] = [c for c in srv.connections.values() if c.session.hello and c.session.hello.session == "flood"]
                    held = (conn.backlog, len(srv.pending), sum(srv._ending.values()), srv.metrics.value("sidecar_frames_total", direction="in", type="ping"))
                    await probe.ping()  # another connection is read as ever
                    assert isinstance(await probe.recv(WAIT_S), p.Pong)
                finally:
                    release.set()
                msgs = await until(sc, lambda m: isinstance(m, p.Ended) and m.stream == f"u{flood - 1}", limit=3 * flood + 10)
                if not any(isinstance(m, p.Pong) for m in msgs):
                    msgs += await until(sc, lambda m: isinstance(m, p.Pong))
                return held, msgs

    (backlog, pending, ending, pings), msgs = run(body())
    assert backlog <= quota and pending + ending <= 2 * quota  # read at most a quota (+ the batch taken)
    assert pings == 0  # the ping behind the flood was not read while the connection was over quota
    assert sum(isinstance(m, p.Ended) for m in msgs) == flood  # then everything was read and answered
    assert [m.stream for m in msgs if isinstance(m, p.Ended)] == [f"u{i}" for i in range(flood)]


def test_the_quota_is_validated():
    with pytest.raises(ValueError, match="max_queued_per_connection=0 must be positive"):
        ServerConfig(max_queued_per_connection=0)


# K: start-up errors before "listening on" -------------------------------------------------


async def _serve_fails(tmp_path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sidecar", "serve", "--port", "0", "--catalog", str(NOTES),
        "--store", str(tmp_path / "fail.db"), *args,
        stderr=asyncio.subprocess.PIPE, env={**os.environ, **(env or {})}, cwd=ROOT,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), WAIT_S)
    return proc.returncode, err.decode()


def test_start_up_errors_are_reported_and_nothing_says_listening(tmp_path):
    broken = tmp_path / "patterns"
    broken.mkdir()
    (broken / "lists.txt").write_text("")
    (broken / "negative.txt").write_text("ok \\bfine\\b\nbroken \\b(unclosed\n")
    (broken / "high.txt").write_text("")
    bad_cal = tmp_path / "calibration.json"
    bad_cal.write_text('{"not": "a calibration"')

    async def body():
        return [
            await _serve_fails(tmp_path, "--model", SMALL, env={"SIDECAR_PATTERNS": str(broken)}),
            await _serve_fails(tmp_path, "--model", str(tmp_path / "no-such-model.gguf")),
            await _serve_fails(tmp_path, "--model", SMALL, env={"SIDECAR_CALIBRATION": str(bad_cal)}),
        ]

    (code1, err1), (code2, err2), (code3, err3) = run(body())
    assert code1 == 2 and f"{broken / 'negative.txt'}:2:" in err1
    assert code2 == 2 and "no-such-model.gguf" in err2
    assert code3 == 2 and "calibration.json" in err3
    for err in (err1, err2, err3):
        assert "listening on" not in err, err


def test_listening_on_comes_once_the_server_is_ready(tmp_path):
    async def body():
        proc, url, lines, drain = await _serve(tmp_path)
        try:
            port = int(url.rsplit(":", 1)[1])
            status, _, text = await http_get(port, "/healthz")  # right after the line
            return status, text
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), WAIT_S)
            drain.cancel()

    assert run(body()) == (200, "ok\n")


# G: records scoped to the connection ------------------------------------------------------


def test_a_second_client_claiming_the_same_session_cannot_take_over_or_suppress_records(small):
    async def ack(sc: SidecarClient) -> p.Ack:
        return (await until(sc, lambda m: isinstance(m, (p.Ack, p.Error))))[-1]

    async def body():
        async with serving(small) as srv, \
                   await SidecarClient.connect(srv.url, session="chat-42") as victim, \
                   await SidecarClient.connect(srv.url, session="chat-42") as other:  # fmt: skip
            await victim.tool_result("create_note", False, 120.0, error="timeout", ref="r-1")
            v1 = await ack(victim)
            await other.tool_result("semantic_search", True, 5.0, ref="r-1")  # same session name, same ref
            o1 = await ack(other)
            await other.tool_result("semantic_search", True, 5.0, ref="r-2")  # pre-empting the victim's next ref
            o2 = await ack(other)
            await victim.tool_result("create_note", False, 99.0, error="disk full", ref="r-2")
            v2 = await ack(victim)
            await victim.tool_result("create_note", False, 120.0, error="timeout", ref="r-1")  # a resend
            v1_again = await ack(victim)
            return v1, o1, o2, v2, v1_again

    v1, o1, o2, v2, v1_again = run(body())
    assert all(isinstance(a, p.Ack) for a in (v1, o1, o2, v2, v1_again))
    assert len({v1.id, o1.id, o2.id, v2.id}) == 4  # nobody got another's row
    assert v1_again.id == v1.id  # a resend on the same connection still counts once
    db = sqlite3.connect(small.store.path)
    try:
        rows = {i: db.execute("SELECT tool, success, error FROM tool_calls WHERE id=?", (i,)).fetchone() for i in (v1.id, o1.id, v2.id)}
    finally:
        db.close()
    assert rows[v1.id] == ("create_note", 0, "timeout")
    assert rows[o1.id] == ("semantic_search", 1, None)
    assert rows[v2.id] == ("create_note", 0, "disk full")  # the victim's failure did not vanish


def test_refs_count_once_across_reconnects_and_a_changed_payload_is_refused(small):
    """Issue 33 item 7: feedback was not deduplicated by ref; a resend of a ref with another
    payload was taken as the first; refs were deduplicated only within one connection, so a
    client that resent after a reconnect counted twice. Now a reconnecting client sends back
    its ready.resume and a resend counts once; a changed payload gets `ref_reused`."""

    async def answer(sc: SidecarClient) -> p.Ack | p.Error:
        return (await until(sc, lambda m: isinstance(m, (p.Ack, p.Error))))[-1]

    async def body():
        async with serving(small) as srv:
            async with await SidecarClient.connect(srv.url, session="chat-7") as sc:
                key = sc.ready.resume
                await sc.feedback("create_note", rating=4.0, selected=True, query="save it, refs test", ref="f-1")
                f1 = await answer(sc)
                await sc.feedback("create_note", rating=4.0, selected=True, query="save it, refs test", ref="f-1")  # resent
                f1_again = await answer(sc)
                await sc.feedback("create_note", rating=0.5, selected=False, ref="f-1")  # another payload, same ref
                changed = await answer(sc)
                await sc.tool_result("create_note", True, 40.0, ref="r-1")
                r1 = await answer(sc)
                await sc.tool_result("create_note", False, 40.0, error="oops", ref="r-1")
                changed_call = await answer(sc)
            async with await SidecarClient.connect(srv.url, session="chat-7", resume=key) as sc:  # a reconnect
                await sc.tool_result("create_note", True, 40.0, ref="r-1")
                r1_after = await answer(sc)
                await sc.feedback("create_note", rating=4.0, selected=True, query="save it, refs test", ref="f-1")
                f1_after = await answer(sc)
                resumed = sc.ready.resume
            async with await SidecarClient.connect(srv.url, session="chat-7") as sc:  # no resume: a new key, new refs
                await sc.tool_result("create_note", True, 40.0, ref="r-1")
                fresh = await answer(sc)
                other_key = sc.ready.resume
            return key, resumed, other_key, f1, f1_again, changed, r1, changed_call, r1_after, f1_after, fresh

    key, resumed, other_key, f1, f1_again, changed, r1, changed_call, r1_after, f1_after, fresh = run(body())
    assert len(key) >= 32 and resumed == key and other_key != key
    assert isinstance(f1, p.Ack) and f1_again.id == f1.id and f1_after.id == f1.id
    assert isinstance(r1, p.Ack) and r1_after.id == r1.id
    assert isinstance(fresh, p.Ack) and fresh.id != r1.id
    for e, ref in ((changed, "f-1"), (changed_call, "r-1")):
        assert isinstance(e, p.Error) and e.code == "ref_reused" and e.ref == ref, e
    db = sqlite3.connect(small.store.path)
    try:
        assert db.execute("SELECT rating FROM feedback WHERE id=?", (f1.id,)).fetchone() == (4.0,)
        assert db.execute("SELECT count(*) FROM feedback WHERE query='save it, refs test'").fetchone()[0] == 1
        assert db.execute("SELECT success FROM tool_calls WHERE id=?", (r1.id,)).fetchone() == (1,)
    finally:
        db.close()


# I: stored strings capped -----------------------------------------------------------------


def test_every_stored_string_is_cut_to_its_configured_cap(small):
    caps = {"max_agent_chars": 64, "max_query_chars": 100, "max_error_chars": 50}

    async def body():
        async with serving(small, **caps) as srv, \
                   await SidecarClient.connect(srv.url, session="big", agent="a" * 200_000) as sc:  # fmt: skip
            await sc.tool_result("create_note", False, 1.0, error="e" * 500_000, ref="big-1")
            call = (await until(sc, lambda m: isinstance(m, p.Ack)))[-1]
            await sc.feedback("create_note", rating=2.0, selected=True, query="q" * 500_000, ref="big-2")
            fb = (await until(sc, lambda m: isinstance(m, p.Ack)))[-1]
            return call.id, fb.id

    call_id, fb_id = run(body())
    db = sqlite3.connect(small.store.path)
    try:
        agent, error = db.execute("SELECT length(agent), length(error) FROM tool_calls WHERE id=?", (call_id,)).fetchone()
        last_error = db.execute("SELECT length(last_error) FROM tool_metrics WHERE tool='create_note'").fetchone()[0]
        query, fb_agent = db.execute("SELECT length(query), length(agent) FROM feedback WHERE id=?", (fb_id,)).fetchone()
    finally:
        db.close()
    assert (agent, error, last_error) == (64, 50, 50)
    assert (query, fb_agent) == (100, 64)
