"""A catalog with its own cases fits its own gate and ranker weights when indexed (issue 30):
the pure gate fit, and the real small model on a small intent catalog with a real SQLite store."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest

from sidecar import config as config_mod
from sidecar.core import models, pipeline
from sidecar.learn import selffit
from sidecar.core.calibration import Calibration, builtin
from sidecar.store import open_store

from .test_learned_classifier import HELD_BACK, INTENTS

CHIT_CHAT = ["tell me a joke", "thanks, that's all", "who won the football match last night", "book a table for two at 8"]


def test_the_gate_puts_its_bar_between_in_scope_and_simulated_out_of_scope_cases():
    rng = np.random.default_rng(0)
    inside = np.clip(rng.normal(0.9, 0.05, 400), 0.01, 0.99)  # best probabilities of cases judged out of fold
    outside = np.clip(rng.normal(0.5, 0.15, 400), 0.01, 0.99)  # of cases whose whole tool was left out
    gate = selffit._gate(inside, outside)
    t = gate.thresholds
    assert t.high == t.fallback == t.confirm and t.confirm <= t.auto <= 1.0
    logits = lambda p: np.log(np.array([[p, (1 - p) / 2, (1 - p) / 2]]))  # noqa: E731  a classifier's logits with best probability p
    probability = [float(gate.probability(logits(p))[0]) for p in (0.4, 0.6, 0.8, 0.95)]
    assert probability == sorted(probability)  # monotone in the classifier's confidence
    assert float(gate.probability(logits(0.95))[0]) >= t.confirm > float(gate.probability(logits(0.5))[0])
    fired_in = np.mean([float(gate.probability(logits(p))[0]) >= t.confirm for p in inside])
    fired_out = np.mean([float(gate.probability(logits(p))[0]) >= t.confirm for p in outside])
    assert fired_in > 0.9 and fired_out < 0.2


def _catalog(tmp_path) -> str:
    tools = [{"name": n, "description": n.replace("_", " "), "inputSchema": {"type": "object"}, "cases": c} for n, c in INTENTS.items()]
    path = tmp_path / "bank.json"
    path.write_text(json.dumps({"server": "bank", "tools": tools}))
    return str(path)


def _pipe(tmp_path, keys: dict | None = None) -> pipeline.Pipeline:
    overrides = {("model", "name"): models.SMALL_MODEL, ("catalogs",): [_catalog(tmp_path)], **(keys or {})}
    return pipeline.from_config(config_mod.load(env={}, overrides=overrides), store=open_store(tmp_path / "s.db"), progress=False)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> pipeline.Pipeline:
    return _pipe(tmp_path_factory.mktemp("selffit"))


def test_an_intent_catalog_fits_its_own_gate_and_ranker(fitted):
    thresholds, origin = fitted.thresholds_in_force
    assert origin == "builtin+self-fit" and thresholds != fitted.thresholds
    own = fitted.own[str(fitted.strategies["user"])]
    assert own.rows == sum(len(c) for c in INTENTS.values())
    assert own.ranker.weights != builtin(models.SMALL_MODEL).ranker.weights
    assert own.ranker.weights[3] > 0  # the classifier view counts (the built-in ranker gives it no weight)
    assert own.ranker.weights[4:] == builtin(models.SMALL_MODEL).ranker.weights[4:]  # the action views' are held (cases open with their tool's verb)
    right = [d.fired and d.tool == want for d, (_, want) in zip(fitted.detect_batch([pipeline.Request(t) for t, _ in HELD_BACK]).decisions, HELD_BACK)]
    assert sum(right) >= 4, right  # paraphrases none of the cases: fired, with the right intent
    assert not any(d.fired for d in fitted.detect_batch([pipeline.Request(t) for t in CHIT_CHAT]).decisions)


def test_a_calibration_file_or_explicit_thresholds_or_the_switch_turn_it_off(tmp_path, fitted):
    cal = tmp_path / "cal.json"
    cal.write_bytes(msgspec.json.encode(msgspec.structs.replace(builtin(models.SMALL_MODEL), examples=None)))
    for keys in ({("calibration",): str(cal)}, {("gate", "fallback"): 0.5}, {("index", "self_fit"): False}):
        pipe = _pipe(tmp_path, keys)
        assert pipe.own == {} and "self-fit" not in pipe.thresholds_in_force[1], keys
    assert isinstance(builtin(models.SMALL_MODEL), Calibration)


def test_a_catalog_without_own_cases_keeps_the_built_in_calibration(tmp_path):
    from .conftest import CATALOGS

    cfg = config_mod.load(env={}, overrides={("model", "name"): models.SMALL_MODEL, ("catalogs",): [str(CATALOGS / "notes.json")]})
    pipe = pipeline.from_config(cfg, store=open_store(tmp_path / "s.db"), progress=False)
    assert pipe.own == {} and pipe.thresholds_in_force == (pipe.thresholds, "builtin")


def test_a_catalog_past_the_tool_limit_keeps_the_built_in_calibration(fitted):
    index = fitted.index_for("user")
    small = selffit.SelfFit(max_tools=len(index.names) - 1)
    assert selffit.own_fit(index, fitted.lexical, fitted.symbolic, fitted.ranker, "m", index.names, small) is None
    assert selffit.own_fit(index, fitted.lexical, fitted.symbolic, fitted.ranker, "m", index.names) is not None
