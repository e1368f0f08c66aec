"""The core flow on the real models: provisioned GGUF, real SQLite store, notes catalog."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import msgspec
import numpy as np
import pytest

from sidecar.core import catalog as catalog_mod
from sidecar import config as config_mod
from sidecar.core import models, pipeline
from sidecar.core.pipeline import Request
from sidecar.store import open_store
from tests.conftest import CATALOGS, ROOT

NOTES = CATALOGS / "notes.json"
MODELS = [models.DEFAULT_MODEL, models.SMALL_MODEL]


def _pipeline(model: str, store_path, catalogs=(NOTES,)) -> pipeline.Pipeline:
    cfg = config_mod.load(env={}, overrides={("model", "name"): model, ("catalogs",): [str(c) for c in catalogs]})
    return pipeline.from_config(cfg, store=open_store(store_path), progress=False)


@pytest.fixture(scope="session", params=MODELS)
def pipe(request, tmp_path_factory) -> pipeline.Pipeline:
    return _pipeline(request.param, tmp_path_factory.mktemp("store") / "sidecar.db")


def test_request_for_an_action_fires_the_right_tool(pipe):
    d = pipe.detect("let me search my notes for the kubernetes setup")
    assert d.path == "high:let_me"
    assert d.tool == "semantic_search"
    assert d.fired and d.tier in ("auto", "confirm")
    assert d.score >= d.threshold == pipe.thresholds.high
    assert d.trigger is not None and d.trigger.text.lower().startswith("let me")


def test_llm_narration_fires_with_the_llm_strategy(pipe):
    d = pipe.detect("I should call create_note to save this meeting summary.", "llm")
    assert d.fired and d.tool == "create_note"
    assert d.source == "llm"


@pytest.mark.parametrize("text", [
    "Your note about the kubernetes cluster upgrade has been saved in the ops folder.",  # a result
    "Could you please check which of your notes on kubernetes you want me to update?",  # asks the user
])  # fmt: skip
def test_a_reply_that_commits_to_no_action_is_not_judged(pipe, text):
    """[gate] replies = "commit" (the default): the model's own text fires only on a commitment
    ("let me ...", "I'll ..."); anything else is blocked before it is embedded. The same words
    from the user, or with replies = "any", are judged."""
    assert pipe.replies_commit
    misses = pipe.queries.misses
    d = pipe.detect(text, "llm")
    assert d.path == "negative:uncommitted" and not d.fired and not d.candidates
    assert pipe.queries.misses == misses  # nothing embedded
    assert pipe.detect(text).candidates  # a user turn is judged
    judged = copy.copy(pipe)
    judged.replies_commit = False
    assert judged.detect(text, "llm").kind == "fallback" and judged.detect(text, "llm").candidates
    assert pipe.detect("Let me update your kubernetes note with the new steps.", "llm").path == "high:let_me"


def test_replies_are_configured_and_checked(pipe):
    cfg = config_mod.load(env={}, overrides={("model", "name"): pipe.embedder.name, ("catalogs",): [str(NOTES)], ("gate", "replies"): "any"})
    assert not pipeline.from_config(cfg, embedder=pipe.embedder, store=pipe.store, progress=False).replies_commit
    with pytest.raises(config_mod.ConfigError, match="replies"):
        config_mod.load(env={}, overrides={("gate", "replies"): "sometimes"})


@pytest.mark.parametrize(
    "text",
    ["the search algorithm runs in O(n log n)", "our CRUD layer wraps every table", "CREATE TABLE notes (id int)"],
)
def test_negative_patterns_are_weighed_by_the_head_and_block_without_one(pipe, text):
    d = pipe.detect(text)  # the built-in head has the match as a feature: it weighs, it does not obey
    assert d.path.startswith("fallback:negative:") and d.kind == "fallback"
    assert not d.fired and d.candidates and d.score is not None and d.score < d.threshold
    bare = copy.copy(pipe)
    bare.head = None  # no head to weigh it: the pattern blocks, before any embedding
    d = bare.detect(text)
    assert d.path.startswith("negative:") and d.path == "negative:" + pipe.detect(text).path.split(":")[-1]
    assert not d.fired and d.tool is None
    assert d.timing_ms.embed == 0.0 and d.candidates == []


def test_small_talk_stays_silent(pipe):
    for text in ["thanks, that was really helpful!", "what a lovely morning it is today"]:
        d = pipe.detect(text)
        assert not d.fired, (text, d.tool, d.score)
        assert d.path == "fallback" and d.threshold == pipe.thresholds.fallback


def test_a_request_no_tool_of_the_catalog_answers_stays_silent(tmp_path_factory):
    """With only a file server, questions about the weather or the time read like requests
    (the head alone gave "what's the weather in Paris tomorrow?" 0.97) but no tool matches
    them: the built-in head's match floor keeps them silent, and file requests still fire."""
    for model in MODELS:
        pipe = _pipeline(model, tmp_path_factory.mktemp("floor") / "s.db", [CATALOGS / "filesystem.json"])
        assert pipe.head.floor is not None
        for text in ["what's the weather in Paris tomorrow?", "is it going to rain in Berlin today?"]:
            d = pipe.detect(text)
            assert not d.fired and d.score < pipe.head.floor, (model, text, d.score)
        for text in ["list the files in ~/Downloads", "read the README in my project folder"]:
            d = pipe.detect(text)
            assert d.fired, (model, text, d.score)


def test_batch_matches_single_calls(pipe):
    texts = ["let me search my notes for the kubernetes setup", "please delete the note about groceries", "nice weather"]
    batch = pipe.detect_batch([Request(t) for t in texts]).decisions
    for t, b in zip(texts, batch):
        s = pipe.detect(t)
        assert (b.tool, b.fired, b.path) == (s.tool, s.fired, s.path)
        assert b.score == pytest.approx(s.score, abs=2e-3)


def test_overlong_text_is_cut_and_says_so(pipe):
    long = "let me create a note about " + " ".join(f"topic{i}" for i in range(pipe.embedder.max_tokens))
    d = pipe.detect(long)
    assert d.truncated
    assert not pipe.detect("let me create a note").truncated


def test_candidates_are_ranked_by_the_blend(pipe):
    d = pipe.detect("open my note called groceries")
    scores = [c.score for c in d.candidates]
    assert scores == sorted(scores, reverse=True)
    assert len(d.candidates) == min(pipe.top_k, len(pipe.catalog))
    bound = sum(abs(w) for w in pipe.ranker.weights)  # each view lies within [-1, 1]
    assert all(-bound <= s <= bound + 1e-3 for s in scores)
    assert 0.0 <= d.score <= 1.0  # the decision's score is the gate head's probability
    assert len({c.tool for c in d.candidates}) == len(d.candidates)


def test_detect_names_the_gate_probability_and_the_tools_match_apart(pipe):
    """`detect`'s text: the gate's probability is never printed as a tool's score (it was:
    "silent: best update_note scored 0.000 ... next: semantic_search 0.340")."""
    from sidecar.output import describe

    d = pipe.detect("what a lovely morning it is today")
    assert not d.fired and d.probability == d.score and 0 <= d.probability < d.threshold
    text = describe(d)
    assert text.startswith(f"silent: probability {d.probability:.3f} that it needs a tool, below {d.threshold:.2f} ({d.path})"), text
    ranking = ", ".join(f"{c.tool} {c.score:.3f}" for c in d.candidates[:4])
    assert f"\n  ranked by match: {ranking}\n" in text and "scored" not in text
    bare = copy.copy(pipe)
    bare.head = None  # an uncalibrated model: the thresholds compare the best match, and say so
    d = bare.detect("let me search my notes for the kubernetes setup")
    assert d.probability is None and d.score == d.candidates[0].score
    assert f"match {d.score:.3f} of semantic_search (no gate head" in describe(d)


def test_second_build_reads_every_vector_from_the_store(tmp_path):
    db = tmp_path / "s.db"
    first = _pipeline(models.SMALL_MODEL, db)
    stats = first.index_for("user").stats
    assert stats.embedded > 0 and stats.cached == 0
    second = _pipeline(models.SMALL_MODEL, db)
    again = second.index_for("user").stats
    assert again.embedded == 0 and again.cached == stats.embedded
    v1 = first.index_for("user").matrix
    v2 = second.index_for("user").matrix
    assert np.array_equal(v1, v2)


def test_reindex_embeds_only_what_changed(tmp_path):
    pipe = _pipeline(models.SMALL_MODEL, tmp_path / "s.db")
    tools = list(pipe.catalog)
    tools[0] = msgspec.structs.replace(tools[0], cases=[*tools[0].cases, "jot down a quick memo"])
    tools = tools[:-1]  # one tool removed
    changed = catalog_mod.Catalog(tools, ["<edited>"])
    built = pipe.reindex(changed)
    stats = built[str(pipe.strategies["user"])].stats
    assert (stats.updated, stats.removed, stats.unchanged) == (1, 1, len(tools) - 1)
    assert stats.embedded == 1  # the new case; the rest come from the previous index
    assert pipe.catalog is changed and len(pipe.index_for("user")) == len(tools)


def test_the_index_reads_each_description_without_what_the_servers_tools_all_say(tmp_path):
    """BFCL multi-turn's tools each begin with their API's paragraph ("This tool belongs to the
    Gorilla file system. It is a simple file system that ..."): the index embeds and derives
    from what follows; the catalog served keeps the whole description."""
    bfcl = ROOT / "fixtures" / "transcripts" / "bfcl-multi-turn" / "catalog.json"
    pipe = _pipeline(models.SMALL_MODEL, tmp_path / "s.db", [bfcl])
    entry = pipe.index_for("user").entries["cat"]
    assert entry.primary_text == "cat: Display the contents of a file of any extension from currrent directory."
    assert not any("belongs to" in t for t in entry.texts)
    assert pipe.catalog.get("cat").description.startswith("This tool belongs to the Gorilla file system.")
    d = pipe.detect("show me what is written in report.txt")
    assert d.candidates[0].tool == "cat"


def test_whole_catalog_of_real_servers_ranks_a_plain_request(tmp_path):
    pipe = _pipeline(models.SMALL_MODEL, tmp_path / "s.db", [CATALOGS / "filesystem.json", CATALOGS / "git.json"])
    d = pipe.detect("show me the git log of the last five commits")
    assert d.candidates[0].tool == "git__git_log"
    assert all("__" in c.tool for c in d.candidates)


# --- the CLI, end to end ---------------------------------------------------------------------


def _cli(*args: str, tmp_path, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "SIDECAR_STORE": str(tmp_path / "cli.db")}
    return subprocess.run([sys.executable, "-m", "sidecar", *args], capture_output=True, text=True, env=env, cwd=ROOT, input=stdin, timeout=120)


def test_cli_detect_json(tmp_path):
    run = _cli("detect", "--json", "--catalog", str(NOTES), "please create a new note: the deploy is on friday", tmp_path=tmp_path)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["model"] == models.DEFAULT_MODEL and out["thresholds_origin"] == "builtin"
    assert out["tool"] == "create_note" and out["fired"] is True
    assert 0.5 < out["probability"] <= 1 and out["probability"] >= out["threshold"]  # the gate head's
    assert "score" not in out  # one name per scale: the gate's probability, a tool's match, its relevance
    assert out["candidates"][0] == {"tool": out["tool"], "match": out["match"], "case": out["case"]}
    assert [set(c) for c in out["candidates"]] == [{"tool", "match", "case"}] * len(out["candidates"])
    assert out["inject"] and all(set(t) == {"tool", "relevance", "why"} and 0 < t["relevance"] <= 1 for t in out["inject"])
    assert {"high", "fallback", "auto", "confirm"} <= set(out["thresholds"]) and out["thresholds"]["tools"] == {}
    assert out["timing_ms"]["total"] > 0


def test_cli_detect_relevance_moves_with_the_match(tmp_path):
    """The relevance shown on an inject follows how clearly the text matches its tool: a text
    whose best match stands far above the rest shows a higher one than a text whose best match
    barely leads, each within 0..1 (issue 52: every inject showed 0.85, the best tool's score
    with no call history)."""
    clear, vague = "let me search my notes for the kubernetes setup", "find my note about the kubernetes cluster setup"
    shown, lead = {}, {}
    for text in (clear, vague):
        out = json.loads(_cli("detect", "--json", "--catalog", str(NOTES), text, tmp_path=tmp_path).stdout)
        assert out["fired"] and out["inject"], out
        first, second = out["candidates"][:2]
        lead[text] = first["match"] - second["match"]  # the gate's ranking: how far the best stands out
        line = _cli("detect", "--catalog", str(NOTES), text, tmp_path=tmp_path).stdout.splitlines()[0]
        shown[text] = float(line.split("(relevance ")[1].split(")")[0])
        assert shown[text] == round(out["inject"][0]["relevance"], 2), line
        assert 0 < shown[text] <= 1
    assert lead[clear] > lead[vague] + 0.1, lead  # the texts do differ in match quality
    assert shown[clear] > shown[vague] + 0.1, shown


def test_cli_detect_json_of_a_silent_decision_names_no_tool(tmp_path):
    """The README's silent example: `--json` says fired false and names no tool (nor a match or
    case for it), where it once named the gate's best as if injected (issue 52); the gate's
    ranking still shows it first among the candidates."""
    out = json.loads(_cli("detect", "--json", "--catalog", str(NOTES), "the search in our notes app is slow", tmp_path=tmp_path).stdout)
    assert out["fired"] is False and out["tier"] is None and out["inject"] == []
    assert out["tool"] is None and out["match"] is None and out["case"] is None, out
    assert out["candidates"] and set(out["candidates"][0]) == {"tool", "match", "case"}


def test_cli_detect_reads_stdin_and_default_model(tmp_path):
    run = _cli("detect", "--catalog", str(NOTES), tmp_path=tmp_path, stdin="let me search my notes for the kubernetes setup\n")
    assert run.returncode == 0, run.stderr
    assert "semantic_search" in run.stdout.splitlines()[0]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--catalog", "missing.json", "hi"], "missing.json: cannot read"),
        (["--catalog", str(NOTES), "--model", "no-such-model", "hi"], "unknown model 'no-such-model'"),
        (["--catalog", str(NOTES), "--model", "/nowhere/m.gguf", "hi"], "no such model file"),
        (["--catalog", str(NOTES), "--patterns", str(ROOT / "tests"), "hi"], "lists.txt"),
    ],
)
def test_cli_user_errors_are_one_line(tmp_path, args, needle):
    run = _cli("detect", *args, tmp_path=tmp_path)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sidecar: error:") and needle in lines[0], run.stderr
