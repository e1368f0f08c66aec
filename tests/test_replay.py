"""Replay: transcripts streamed through the server's session logic on a real model."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import subprocess
import sys

import msgspec
import pytest

from sidecar.core import catalog as catalog_mod
from sidecar import config as config_mod
from sidecar.core import models, pipeline
from sidecar import replay
from sidecar.config import ServerConfig
from sidecar.serve.server import SidecarServer
from sidecar.store import open_store
from tests.conftest import CATALOGS, ROOT, engine_of

NOTES = CATALOGS / "notes.json"
TRANSCRIPTS = sorted((ROOT / "fixtures" / "transcripts").glob("*.jsonl"))


def _lines(*msgs: dict) -> str:
    return "".join(json.dumps(m) + "\n" for m in msgs)


@pytest.fixture(scope="module")
def pipe(tmp_path_factory) -> pipeline.Pipeline:
    cfg = config_mod.load(env={}, overrides={("model", "name"): models.SMALL_MODEL, ("catalogs",): [str(NOTES)]})
    return pipeline.from_config(cfg, store=open_store(tmp_path_factory.mktemp("replay") / "s.db"), progress=False)


@pytest.mark.parametrize("text", ["Let me search my notes.", "I'll call create_note now, ok?\n\nDone — 3.14 it's fine", "  spaced   out\ttext  ", "日本語のテキスト and more"])
def test_llm_tokens_rejoin_to_the_text(text):
    pieces = replay.llm_tokens(text)
    assert "".join(pieces) == text
    assert len(pieces) > 1


def test_transcript_errors_name_file_and_line(tmp_path):
    cat = catalog_mod.load([NOTES])
    for body, needle in [
        (_lines({"conversation": "c", "role": "user", "content": "hi"}, {"conversation": "c", "role": "bot", "content": "x"}), ":2:"),
        (_lines({"conversation": "c", "role": "assistant", "content": "abc", "chunks": ["a", "b"]}), ":1: chunks do not join"),
        (_lines({"conversation": "c", "role": "assistant", "content": "x", "tool_calls": [{"name": "nope"}]}), ":1: tool_calls name tools not in the catalog: nope"),
        ("{not json\n", ":1:"),
    ]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(body)
        with pytest.raises(replay.TranscriptError, match=needle):
            replay.read_transcripts([bad], cat)


def test_replay_injects_before_the_tool_call_and_scores_it(pipe, tmp_path):
    path = tmp_path / "t.jsonl"
    reply = "Sure. I should call semantic_search to find the kubernetes setup, then I will tell you what it says."
    path.write_text(_lines(
        {"conversation": "k8s", "role": "user", "content": "where did I write down how the cluster is set up?"},
        {"conversation": "k8s", "role": "assistant", "content": reply, "tool_calls": [{"name": "semantic_search", "arguments": {"query": "kubernetes"}}]},
        {"conversation": "k8s", "role": "tool", "content": "two passages"},
        {"conversation": "chat", "role": "user", "content": "what a lovely morning it is today"},
        {"conversation": "chat", "role": "assistant", "content": "It is! Enjoy the sunshine.", "chunks": ["It", " is!", " Enjoy", " the", " sun", "shine."]},
    ))  # fmt: skip
    convs = replay.read_transcripts([path], pipe.catalog)
    assert [c.id for c in convs] == ["k8s", "chat"]
    detections, summary = replay.replay(engine_of(pipe, history=False), convs)
    assert summary.conversations == 2 and summary.messages == 4  # tool messages are not replayed
    hits = [d for d in detections if d.conversation == "k8s" and d.role == "assistant"]
    assert hits and hits[0].tools[0] == "semantic_search" and hits[0].correct[0]
    # judged while the clause was still growing (after `span_words` words), before the message
    # and its tool call ended
    assert hits[0].at_char < reply.index("what it says") and hits[0].lead_chars == len(reply) - hits[0].at_char
    assert not any(d.conversation == "chat" for d in detections) and summary.false_fires == 0
    injected = [t for d in detections for t in d.tools]
    right = sum(c for d in detections for c in d.correct)
    assert summary.injections == len(injected)
    assert summary.precision == pytest.approx(right / len(injected))
    assert summary.recall == 1.0  # the one tool the model called was injected
    k8s = {t for d in detections if d.conversation == "k8s" for t in d.tools}  # on the user turn and during the reply
    assert summary.exact_set == (1.0 if k8s == {"semantic_search"} else 0.0)  # one reply called tools: exactly its call, or not
    assert math.isnan(summary.per_conversation["chat"]["exact_set"])  # no reply there called a tool
    assert summary.per_conversation["k8s"]["injections"] == len(injected)
    assert math.isnan(summary.per_conversation["chat"]["precision"])
    # each side apart: the reply's own inject found its call; user turns and replies add up
    sides = summary.by_role
    assert sides["user"]["messages"] + sides["assistant"]["messages"] == summary.messages
    assert sides["user"]["injections"] + sides["assistant"]["injections"] == summary.injections
    assert sides["assistant"]["recall"] == 1.0 and sides["assistant"]["precision"] == pytest.approx(
        sum(c for d in hits for c in d.correct) / sum(len(d.tools) for d in hits))
    user = [d for d in detections if d.role == "user"]
    assert sides["user"]["recall"] == (1.0 if any("semantic_search" in d.tools for d in user) else 0.0)


def test_replay_counts_the_schemas_a_reply_holds_and_a_budget_bounds_them(pipe, tmp_path):
    """Three user turns, each asking for another tool, each reply calling it: with no budget the
    third reply holds all three schemas; with server.context_tools = 1 only its own, and the
    calls were all held when made either way (each is injected on the turn before it)."""
    from sidecar.config import Config
    from sidecar.mcp.savings import count_tokens

    asks = [("Create a note titled standup with today's action items", "create_note"), ("Delete the note about onboarding", "delete_note"),
            ("let me search my notes for the kubernetes setup", "semantic_search")]  # fmt: skip
    rows = []
    for text, tool in asks:
        rows += [{"conversation": "c", "role": "user", "content": text}, {"conversation": "c", "role": "assistant", "content": "", "tool_calls": [{"name": tool}]}]
    path = tmp_path / "t.jsonl"
    path.write_text(_lines(*rows))
    convs = replay.read_transcripts([path], pipe.catalog)
    size = {t: count_tokens(json.dumps(pipe.catalog.get(t).definition(), separators=(",", ":"), ensure_ascii=False)) for _, t in asks}
    _, free = replay.replay(engine_of(pipe, history=False), convs)
    _, bound = replay.replay(engine_of(pipe, Config(server=ServerConfig(context_tools=1, max_inject_tools=1)), history=False), convs)
    assert free.held_when_called == bound.held_when_called == 1.0
    assert free.context_tokens["p90"] >= free.context_tokens["p50"] > 0
    last = size["create_note"] + size["delete_note"] + size["semantic_search"]
    assert max(free.context_tokens["p90"], free.context_tokens["mean"]) <= last
    assert bound.context_tokens["mean"] == pytest.approx(sum(size.values()) / 3)  # each reply holds its own tool alone
    assert bound.context_tokens["mean"] < free.context_tokens["mean"]


def test_replay_credits_a_tool_injected_ahead_of_a_later_step(pipe, tmp_path):
    """A turn with two asks gets both tools at once; the model calls one in its reply and the
    other a message later. Message by message the second is a wrong inject (the reply did not
    call it); the conversation as one stream counts it as used, and a tool never called as not."""
    rows = [{"conversation": "c", "role": "user", "content": "Create a note titled standup with today's action items, then delete the note about onboarding"},
            {"conversation": "c", "role": "assistant", "content": "", "tool_calls": [{"name": "create_note"}]},
            {"conversation": "c", "role": "assistant", "content": "", "tool_calls": [{"name": "delete_note"}]}]  # fmt: skip
    path = tmp_path / "t.jsonl"
    path.write_text(_lines(*rows))
    detections, summary = replay.replay(engine_of(pipe, history=False), replay.read_transcripts([path], pipe.catalog))
    offered = {t for d in detections for t in d.tools}
    assert {"create_note", "delete_note"} <= offered
    assert not any(c for d in detections for t, c in zip(d.tools, d.correct) if t == "delete_note")  # wrong for its own message
    assert summary.used_after_inject == pytest.approx(2 / len(offered))
    assert summary.precision < summary.used_after_inject


def test_cli_replay_json_and_events(tmp_path):
    """A newcomer's first replay on the whole catalog: a fresh store (its own XDG data home),
    so all 605 tools are embedded, which shows progress on stderr while stdout stays one
    JSON document."""
    assert TRANSCRIPTS, "fixtures/transcripts is empty"
    out = tmp_path / "events.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("SIDECAR_STORE", "SIDECAR_CONFIG")}
    env["XDG_DATA_HOME"] = str(tmp_path / "data")
    tools = len(catalog_mod.load([CATALOGS / "ALL.json"]))
    run = subprocess.run(
        [sys.executable, "-m", "sidecar", "replay", *map(str, TRANSCRIPTS), "--catalog", str(CATALOGS / "ALL.json"),
         "--model", models.SMALL_MODEL, "--out", str(out), "--json"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "data" / "sidecar" / "sidecar.db").is_file()  # the store was the fresh one
    # a bar while the catalog's texts are embedded (counted in texts), then one while replaying
    assert re.search(rf"indexing {tools} tools \(\S+\): +\d+%.*\d+/\d+ \[", run.stderr), run.stderr[-2000:]
    assert re.search(r"replaying: +\d+%", run.stderr), run.stderr[-2000:]
    assert run.stdout.count("\n") == 1  # stdout: the summary alone
    summary = json.loads(run.stdout)
    assert {"conversations", "messages", "injections", "precision", "recall", "exact_set", "false_fires", "lead_time_chars"} <= set(summary)
    assert set(summary["lead_time_chars"]) == {"p50", "p90"}
    convs = {json.loads(line)["conversation"] for f in TRANSCRIPTS for line in f.read_text().splitlines() if line.strip()}
    assert summary["conversations"] == len(convs)
    events = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(events) <= summary["injections"] and sum(len(e["tools"]) for e in events) == summary["injections"]
    assert all(e["conversation"] in convs and e["tier"] in ("auto", "confirm") for e in events)


def _replay_cli(tmp_path, transcript, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SIDECAR_STORE": str(tmp_path / "cli.db")}
    run = subprocess.run([sys.executable, "-m", "sidecar", "replay", str(transcript), "--catalog", str(NOTES), "--model", models.SMALL_MODEL,
                          "-q", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    return run


def test_cli_replay_prints_a_dash_where_there_is_nothing_to_score(tmp_path):
    """A conversation where nothing was injected and no tool called has no precision, recall
    or exact set: its line says "–", never "nan" (issue 52); the JSON says null."""
    path = tmp_path / "t.jsonl"
    path.write_text(_lines(
        {"conversation": "chat", "role": "user", "content": "what a lovely morning it is today"},
        {"conversation": "chat", "role": "assistant", "content": "It is! Enjoy the sunshine."},
    ))  # fmt: skip
    text = _replay_cli(tmp_path, path).stdout
    assert "nan" not in text, text
    [line] = [ln for ln in text.splitlines() if ln.strip().startswith("chat:")]
    assert "0 injected, precision –, recall –, exact set –" in line, line
    figures = json.loads(_replay_cli(tmp_path, path, "--json").stdout)["per_conversation"]["chat"]
    assert figures["precision"] is None and figures["recall"] is None


def test_replayed_triggers_are_the_text_that_fired_without_spaces_around_it(tmp_path):
    """The imperative pattern's match ends on the space after its words ("show me "): the
    trigger a user reads is stripped (issue 52), and still sits where it was in the message."""
    turn = "show me my notes about the kubernetes setup"
    path = tmp_path / "t.jsonl"
    path.write_text(_lines(
        {"conversation": "k8s", "role": "user", "content": turn},
        {"conversation": "k8s", "role": "assistant", "content": "", "tool_calls": [{"name": "semantic_search", "arguments": {"query": "kubernetes"}}]},
    ))  # fmt: skip
    _replay_cli(tmp_path, path, "--out", str(tmp_path / "events.jsonl"))
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    [event] = [e for e in events if e["path"] == "high:imperative"]
    assert event["trigger"] and event["trigger"] == event["trigger"].strip() and turn.startswith(event["trigger"]), event
    assert all(e["trigger"] == e["trigger"].strip() for e in events), events


def test_cli_replay_bad_transcript_is_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"conversation": "c", "role": "assistant", "content": "x", "tool_calls": [{"name": "nope"}]}\n')
    env = {**os.environ, "SIDECAR_STORE": str(tmp_path / "cli.db")}
    run = subprocess.run([sys.executable, "-m", "sidecar", "replay", str(bad), "--catalog", str(NOTES), "--model", models.SMALL_MODEL],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)  # fmt: skip
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].startswith("sidecar: error:") and "bad.jsonl:1:" in run.stderr


def test_replay_through_a_server_injects_what_in_process_replay_does(tmp_path):
    """`sidecar replay --url` against a real server on 127.0.0.1 and `replay.replay` in-process
    produce the same detections and summary, to the score.

    Batching alone changes nothing here: the server judges the spans of several frames
    together where in-process replay judges each frame's alone, but each span is embedded and
    ranked on its own. What can differ is *which* spans are judged: under load the server
    lets a growing clause's newer span supersede its pending shorter one (and drops stale
    ones), by design. So the limits here judge clauses whole (`span_words` beyond any
    clause: every span has its own key) and are never shed or go stale; the test checks the server
    dropped nothing, so the equality is exact rather than lucky. And `[gate] after_call` is off:
    the url replay sends no tool_result (it would write call history), so its server hears of
    no call, where in-process replay tells its session of each."""
    limits = ServerConfig(port=0, span_words=10_000, stale_ms=600_000, shed_ms=600_000)
    cfg = config_mod.load(env={}, overrides={("model", "name"): models.SMALL_MODEL, ("catalogs",): [str(CATALOGS / "ALL.json")], ("gate", "after_call"): 0.0})
    pipe = pipeline.from_config(cfg, store=open_store(tmp_path / "s.db"), progress=False)
    convs = replay.read_transcripts(TRANSCRIPTS, pipe.catalog)
    cfg = msgspec.structs.replace(cfg, server=limits)
    engine = engine_of(pipe, cfg)
    detections, summary = replay.replay(engine, convs)
    assert summary.injections > 0

    async def through_server() -> tuple[subprocess.CompletedProcess, dict[str, float]]:
        srv = SidecarServer(cfg, engine=engine)
        await srv.start()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "sidecar", "replay", "--url", srv.url, *map(str, TRANSCRIPTS),
                "--catalog", str(CATALOGS / "ALL.json"), "--out", str(tmp_path / "url.jsonl"), "--json",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT,
            )  # fmt: skip
            out, err = await asyncio.wait_for(proc.communicate(), 600)
            return subprocess.CompletedProcess("replay --url", proc.returncode, out.decode(), err.decode()), dict(srv.pending.dropped)
        finally:
            await srv.shutdown()

    run, dropped = asyncio.run(through_server())
    assert run.returncode == 0, run.stderr
    assert dropped == {"superseded": 0, "shed": 0, "overflow": 0, "stale": 0}
    assert json.loads(run.stdout) == json.loads(msgspec.json.encode(summary))
    got = [json.loads(line) for line in (tmp_path / "url.jsonl").read_text().splitlines()]
    assert got == [json.loads(msgspec.json.encode(d)) for d in detections]
