"""Learning from an outside multi-turn chat log (issue 31): BFCL's multi-turn conversations
(fixtures/transcripts/bfcl-multi-turn, nobody here wrote them), half read as a log the way
`sidecar learn --from` reads it, the other half replayed before and after, on the real small
model and a real SQLite store. A third of their turns call several tools ("start the car":
lock the doors, press the brake, start the engine)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from sidecar import config as config_mod
from sidecar.core import models
from sidecar.engine import Sidecar
from sidecar.serve.learner import apply_learned, traffic_log
from sidecar.replay import replay
from sidecar.store import open_store
from sidecar.learn.traffic import Example, log_examples, turns_of
from sidecar.transcripts import read_transcripts

from .conftest import ROOT

HERE = ROOT / "fixtures" / "transcripts" / "bfcl-multi-turn"
REPLAYED = 50  # of the 100 held-out conversations: enough to tell, quick enough for every run
BOUND_S = 300


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    store = tmp_path_factory.mktemp("mt") / "s.db"
    cfg = config_mod.load(env={}, overrides={("model", "name"): models.SMALL_MODEL, ("catalogs",): [str(HERE / "catalog.json")],
                                             ("store",): str(store)})  # fmt: skip
    return Sidecar.open(cfg, store=open_store(cfg.store), progress=False)


def test_a_log_of_multi_tool_turns_teaches_the_tools_each_turn_needs(engine):
    played = read_transcripts([HERE / "replay.jsonl"], engine.catalog)[:REPLAYED]
    before = replay(engine, played)[1]
    assert apply_learned(engine) is not None and engine.pipeline.learned is None  # nothing recorded yet: nothing learned
    turns, examples = log_examples(engine.pipeline, read_transcripts([HERE / "learn.jsonl"], engine.catalog))
    assert sum(len(t.calls) > 1 for t in turns) > len(turns) / 4
    traffic_log(engine).add(examples)
    outcome = apply_learned(engine)
    assert outcome is not None and engine.pipeline.learned is not None, outcome
    rules = engine.sequences.around("startEngine", most=4)
    assert {(r.tool, r.relation) for r in rules} >= {("pressBrakePedal", "before")}, rules
    assert all(r.unit == "turns" and r.why.endswith(" turns") for r in rules)
    after = replay(engine, played)[1]
    assert after.recall >= before.recall + 0.10, (before, after)  # the target: +10 points of recall ...
    assert after.precision >= before.precision - 0.02, (before, after)  # ... at no loss of precision


def test_a_turn_that_called_several_tools_is_judged_whole():
    """Each tool a turn called is an example of its own. Judged one by one, a turn whose first
    tool was one of them counted as a miss for the others, and the folds split the turn, so
    its own text, a case of one tool in training, judged it as that tool against another's
    label: the lesson of a multi-tool log never passed (the test above fails without this)."""
    v = np.eye(3, dtype=np.float32)
    examples = [Example("lock the doors and start the car", t, v[0], "log:a") for t in ("lockDoors", "pressBrakePedal", "startEngine")]
    examples += [Example("what's the weather", None, v[1], "log:a"), Example("lock the doors and start the car", "startEngine", v[0], "log:b")]
    assert turns_of(examples) == [[0, 1, 2], [3], [4]]


def test_learn_from_a_chat_log_says_which_tools_go_together(engine, tmp_path):
    args = ["--model", models.SMALL_MODEL, "--catalog", str(HERE / "catalog.json"), "--store", str(tmp_path / "s.db")]
    done = subprocess.run([sys.executable, "-m", "sidecar", "learn", *args, "--from", str(HERE / "learn.jsonl"), "--json"],
                          capture_output=True, text=True, timeout=BOUND_S, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["in_use"] and doc["sequences"]["sessions"] > 100
    found = {(r["tool"], r["relation"], r["anchor"]) for r in doc["sequences"]["rules"]}
    assert ("pressBrakePedal", "before", "startEngine") in found, sorted(found)
