"""Transcripts as chats are really logged (OpenAI `messages`, Anthropic content blocks, our
JSONL), read into one shape and replayed in-process and through a real `sidecar serve`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from sidecar.core import catalog as catalog_mod
from sidecar import config as config_mod
from sidecar.core import models
from sidecar import replay
from sidecar.engine import Sidecar
from sidecar.transcripts import TranscriptError, read_transcripts
from tests.conftest import CATALOGS, ROOT, serve_process

FIXTURES = ROOT / "fixtures" / "transcripts"
OPENAI = sorted((FIXTURES / "openai").iterdir())
ANTHROPIC = sorted((FIXTURES / "anthropic").iterdir())
BFCL = FIXTURES / "bfcl-live"
SERVERS = ["filesystem", "git", "github", "time", "fetch", "arxiv", "memory", "slack"]
CATALOG_FILES = [str(CATALOGS / f"{s}.json") for s in SERVERS]
WAIT_S = 180


@pytest.fixture(scope="module")
def cat() -> catalog_mod.Catalog:
    return catalog_mod.load(CATALOG_FILES)


def _shape(conv) -> list[tuple[str, list[str]]]:
    return [(m.role, [c.name for c in m.tool_calls or ()]) for m in conv.messages]


# Reading ------------------------------------------------------------------------------------


def test_openai_json_list_of_conversations(cat):
    convs = read_transcripts([FIXTURES / "openai" / "coding.json"], cat)
    assert [(c.id, c.format) for c in convs] == [("openai-release-notes", "openai"), ("coding#2", "openai")]
    notes = convs[0]
    assert _shape(notes) == [  # the system message is left out; tool results stay as context
        ("user", []), ("assistant", ["git__git_log"]), ("tool", []), ("assistant", []),
        ("user", []), ("assistant", ["slack__slack_post_message"]), ("tool", []), ("assistant", []),
    ]  # fmt: skip
    call = notes.messages[1]
    assert call.content == "" and call.tool_calls[0].arguments == {"repo_path": ".", "max_count": 20}  # content null, arguments a JSON string
    assert notes.messages[5].content == "I'll post the notes to #releases."  # a list of text parts
    assert convs[1].messages[1].content == "" and _shape(convs[1])[1] == ("assistant", ["time__get_current_time"])  # content ""


def test_openai_jsonl_one_conversation_a_line(cat):
    convs = read_transcripts([FIXTURES / "openai" / "lookup.jsonl"], cat)
    assert [c.id for c in convs] == ["openai-fetch-pep", "openai-big-files", "openai-mutex"]
    assert {c.format for c in convs} == {"openai"}
    assert [n for _, names in _shape(convs[1]) for n in names] == ["filesystem__list_directory_with_sizes", "filesystem__read_text_file"]
    assert _shape(convs[2]) == [("user", []), ("assistant", [])]


def test_openai_bare_list_single_object_and_older_shapes(tmp_path):
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps([
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "what is in notes.txt?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]},
        {"role": "assistant", "content": None, "function_call": {"name": "read_file", "arguments": "{\"path\": \"notes.txt\"}"}},
        {"role": "function", "name": "read_file", "content": "milk, eggs"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't share that."}],
         "tool_calls": [{"function": {"name": "write_file", "arguments": {"path": "x"}}}]},
    ]))  # fmt: skip
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}))
    convs = read_transcripts([bare, one])
    assert [(c.id, c.format) for c in convs] == [("bare", "openai"), ("one", "openai")]
    assert _shape(convs[0]) == [("user", []), ("assistant", ["read_file"]), ("tool", []), ("assistant", ["write_file"])]
    assert convs[0].messages[0].content == "what is in notes.txt?"
    assert convs[0].messages[1].tool_calls[0].arguments == {"path": "notes.txt"}
    assert convs[0].messages[3].content == "I can't share that." and convs[0].messages[3].tool_calls[0].arguments == {"path": "x"}


def test_anthropic_content_blocks(cat):
    convs = read_transcripts(ANTHROPIC, cat)
    by_id = {c.id: c for c in convs}
    assert set(by_id) == {"anthropic-flaky-issue", "anthropic-open-prs", "anthropic-rag-papers"}
    assert {c.format for c in convs} == {"anthropic"}
    rag = by_id["anthropic-rag-papers"]  # a top-level system prompt, left out
    assert _shape(rag) == [
        ("user", []), ("assistant", ["arxiv__search_papers"]), ("tool", []), ("assistant", []),
        ("user", []), ("assistant", ["memory__add_observations"]), ("tool", []), ("assistant", []),
        ("user", []), ("assistant", []),
    ]  # fmt: skip
    assert rag.messages[1].content == "I'll search arXiv for retrieval-augmented code generation."
    assert rag.messages[1].tool_calls[0].arguments == {"query": "retrieval-augmented generation code", "max_results": 5}
    assert rag.messages[5].content == ""  # thinking is not text; the turn only calls a tool
    assert rag.messages[6].content == "added 1 observation to user"  # tool_result with text blocks
    # a tool_result and a new question in one user message: the result, then the user turn
    assert _shape(by_id["anthropic-open-prs"]) == [("user", []), ("assistant", ["github__list_pull_requests"]), ("tool", []), ("user", []), ("assistant", [])]
    assert by_id["anthropic-open-prs"].messages[3].content == "and which one is oldest?"
    assert _shape(by_id["anthropic-flaky-issue"])[1] == ("assistant", ["github__create_issue"])


def test_our_jsonl_is_still_read_and_formats_mix_across_files(cat):
    ours = sorted(FIXTURES.glob("*.jsonl"))
    all_cat = catalog_mod.load([CATALOGS / "ALL.json"])
    convs = read_transcripts([*ours, *OPENAI, *ANTHROPIC], all_cat)
    ids = {json.loads(line)["conversation"] for f in ours for line in f.read_text().splitlines() if line.strip()}
    assert sum(c.format == "sidecar" for c in convs) == len(ids)
    assert sum(c.format == "openai" for c in convs) == 5 and sum(c.format == "anthropic" for c in convs) == 3


def test_bfcl_live_sample_reads_against_its_catalog():
    bfcl = catalog_mod.load([BFCL / "catalog.json"])
    convs = read_transcripts([BFCL / "sample.jsonl"], bfcl)
    assert len(convs) == 44 and {c.format for c in convs} == {"openai"}
    assert all([m.role for m in c.messages] == ["user", "assistant"] and c.messages[1].content == "" for c in convs)
    called = [c for c in convs if c.messages[1].tool_calls]
    assert len(called) == 33 and all(not c.id.startswith("live_irrelevance") for c in called)
    assert max(len(c.messages[1].tool_calls) for c in called) >= 2  # parallel calls


def test_bfcl_live_sample_is_rebuilt_byte_for_byte(tmp_path):
    """From the source lines it was made of (`source/`, the shared data's sampled lines), so a
    clone without ../shared/data checks it too."""
    run = subprocess.run([sys.executable, str(BFCL / "convert.py"), "--slice", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "44 conversations, 33 with tool calls, 80 tools"
    for name in ("sample.jsonl", "catalog.json"):
        assert (tmp_path / name).read_bytes() == (BFCL / name).read_bytes(), name
    source = [json.loads(line) for line in (BFCL / "source" / "bfcl-live.items.jsonl").read_text().splitlines()]
    assert [c["id"] for c in map(json.loads, (BFCL / "sample.jsonl").read_text().splitlines())] == [i["id"] for i in source]


def _doc(*messages: dict, **top) -> str:
    return json.dumps({**top, "messages": list(messages)}, indent=1)


USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(("name", "body", "needle"), [
    ("broken.json", '[\n {"messages": [\n  {"role": "user", "content": "hi"},\n ]}\n]', r"broken\.json:3:36: not valid JSON \(trailing comma"),
    ("role.jsonl", json.dumps({"messages": [USER]}) + "\n" + json.dumps({"messages": [USER, {"role": "robot", "content": "x"}]}) + "\n",
     r"role\.jsonl:2: \$\.messages\[1\]\.role: Invalid enum value 'robot'"),
    ("part.json", json.dumps([{"messages": [USER, {"role": "assistant", "content": [{"type": "video"}]}]}], indent=1),
     r"part\.json: \$\[0\]\.messages\[1\]\.content\[0\]\.type: Invalid value 'video'"),
    ("args.json", _doc(USER, {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "read_file", "arguments": "{\"path\": "}}]}),
     r"args\.json: \$\.messages\[1\]\.tool_calls\[0\]\.function\.arguments: not valid JSON"),
    ("array.json", _doc(USER, {"role": "assistant", "tool_calls": [{"function": {"name": "read_file", "arguments": "[1]"}}]}),
     r"\$\.messages\[1\]\.tool_calls\[0\]\.function\.arguments: must encode a JSON object, got list"),
    ("misplaced.json", _doc({"role": "user", "content": [{"type": "tool_use", "name": "read_file", "input": {}}]}),
     r'misplaced\.json: \$\.messages\[0\]\.content\[0\]: a "tool_use" block in a user message'),
    ("mixed.json", _doc({"role": "system", "content": "s"}, USER, {"role": "assistant", "content": [{"type": "tool_use", "name": "read_file"}]}),
     r'mixed\.json: \$\.messages\[2\]\.content\[0\]: a "tool_use" block \(Anthropic\) in a conversation with role "system" \(OpenAI\) at \$\.messages\[0\]'),
    ("unknown.jsonl", json.dumps({"messages": [USER, {"role": "assistant", "tool_calls": [{"function": {"name": "nope"}}]}]}) + "\n",
     r"unknown\.jsonl:1: \$\.messages\[1\]: tool_calls name tools not in the catalog: nope"),
    ("other.json", '{"conversations": []}', r"other\.json:1: not a transcript"),  # a one-line document: its line
    ("bare.jsonl", json.dumps(USER) + "\n" + json.dumps(USER) + "\n", r'bare\.jsonl:1: a message without "conversation"'),
    ("empty.json", "\n\n", r"empty\.json: empty file"),
    ("nothing.json", _doc({"role": "system", "content": "only a prompt"}), r"nothing\.json: no user or assistant messages"),
])  # fmt: skip
def test_malformed_files_name_where(tmp_path, name, body, needle):
    path = tmp_path / name
    path.write_text(body)
    with pytest.raises(TranscriptError, match=needle):
        read_transcripts([path], catalog_mod.load([CATALOGS / "filesystem.json"]))


def test_a_conversation_id_used_twice_is_refused(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.jsonl"
    a.write_text(_doc(USER, id="c1"))
    b.write_text(json.dumps({"conversation": "c1", "role": "user", "content": "hi"}) + "\n")
    with pytest.raises(TranscriptError, match=r"b\.jsonl:1: conversation 'c1' is already an openai conversation of .*a\.json"):
        read_transcripts([a, b])
    b.write_text(json.dumps({"id": "c1", "messages": [USER]}) + "\n")
    with pytest.raises(TranscriptError, match=r"b\.jsonl:1: \$\.id: conversation id 'c1' is already used in .*a\.json"):
        read_transcripts([a, b])


# Replaying ----------------------------------------------------------------------------------


def _config(tmp_path, catalogs: list[str]) -> config_mod.Config:
    return config_mod.load(env={}, overrides={("model", "name"): models.SMALL_MODEL, ("catalogs",): catalogs, ("store",): str(tmp_path / "s.db")})


def _replayed_messages(convs) -> int:
    return sum(m.role != "tool" for c in convs for m in c.messages)


def test_openai_and_anthropic_files_replay_in_process(tmp_path):
    """Assistant turns that only call tools (content null, "" or tool_use blocks alone) are
    scored, never streamed as a stream that does not exist."""
    engine = Sidecar.open(_config(tmp_path, CATALOG_FILES), progress=False, history=False)
    convs = read_transcripts([*OPENAI, *ANTHROPIC], engine.catalog)
    detections, summary = replay.replay(engine, convs)
    assert summary.conversations == 8 and summary.messages == _replayed_messages(convs)
    assert summary.injections > 0 and detections
    assert any(d.role == "user" and any(d.correct) for d in detections)  # injected on the turn a tool-only reply answered
    assert summary.recall > 0


def test_bfcl_live_sample_replays_in_process(tmp_path):
    engine = Sidecar.open(_config(tmp_path, [str(BFCL / "catalog.json")]), progress=False, history=False)
    convs = read_transcripts([BFCL / "sample.jsonl"], engine.catalog)
    detections, summary = replay.replay(engine, convs)
    assert summary.messages == 88 and summary.injections > 0
    assert all(d.role == "user" for d in detections)  # every reply is empty: injections come on the question
    assert summary.recall > 0 and summary.precision > 0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A real `sidecar serve` on 127.0.0.1 that wants a token; its log in a file. Spans never
    go stale (a loaded machine would drop them by design, and the counts with them)."""
    tmp = tmp_path_factory.mktemp("served")
    (tmp / "serve.toml").write_text('[server]\ntoken = "s3cret"\nstale_ms = 600000\nshed_ms = 600000\n')
    args = ["--config", str(tmp / "serve.toml"), "--model", models.SMALL_MODEL,
            *[a for f in CATALOG_FILES for a in ("--catalog", f)], "--store", str(tmp / "serve.db")]  # fmt: skip
    with serve_process(args, tmp, env={"SIDECAR_TOKEN": None}, timeout=WAIT_S) as server:
        yield server.url, tmp


def _replay_url(url: str, tmp, token: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SIDECAR_TOKEN"} | ({"SIDECAR_TOKEN": token} if token else {})
    return subprocess.run(
        [sys.executable, "-m", "sidecar", "replay", "--url", url, *map(str, OPENAI), *map(str, ANTHROPIC),
         *[a for f in CATALOG_FILES for a in ("--catalog", f)], "--out", str(tmp / "events.jsonl"), "--json"],
        capture_output=True, text=True, env={**env, "SIDECAR_STORE": str(tmp / "cli.db")}, cwd=ROOT, timeout=WAIT_S,
    )  # fmt: skip


def test_openai_and_anthropic_files_replay_through_sidecar_serve(served, cat):
    url, tmp = served
    run = _replay_url(url, tmp, "s3cret")
    assert run.returncode == 0, run.stderr
    assert "error" not in run.stderr
    summary = json.loads(run.stdout)
    convs = read_transcripts([*OPENAI, *ANTHROPIC], cat)
    assert summary["conversations"] == 8 and summary["messages"] == _replayed_messages(convs)
    assert summary["injections"] > 0 and summary["recall"] > 0
    events = [json.loads(line) for line in (tmp / "events.jsonl").read_text().splitlines()]
    assert events and sum(len(e["tools"]) for e in events) == summary["injections"]


@pytest.mark.parametrize(("url", "needle"), [
    (None, "sidecar refused the connection: HTTP 401"),  # the served sidecar, without its token
    ("http://127.0.0.1:9", "isn't a valid URI"),
])  # fmt: skip
def test_replay_url_errors_are_one_line(served, url, needle):
    served_url, tmp = served
    run = _replay_url(url or served_url, tmp, None)
    assert run.returncode == 2
    last = run.stderr.strip().splitlines()[-1]
    assert "Traceback" not in run.stderr and re.search(r"^(?:.*\r)?sidecar: error: replay --url \S+: ", last) and needle in last
