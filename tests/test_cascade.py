"""The cascade: MiniLM screens every fallback-path text and settles the clear "no tool" ones, so
only the rest reach nomic (real models, a real SQLite store, a real server on 127.0.0.1).
What is counted is the main model's work: texts that reach its query cache (hits + misses)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from sidecar import engine as engine_mod
from sidecar.core import models
from sidecar.lab import cascade
from sidecar import config as config_mod
from sidecar import protocol as p
from sidecar.core.catalog import load as load_catalog
from sidecar.client import SidecarClient
from sidecar.engine import CascadeStats, Sidecar
from sidecar.core.pipeline import Request
from sidecar.serve.server import SidecarServer

from .conftest import CATALOGS

SMALL_TALK = "haha thanks, that was a really fun chat, have a lovely evening!"
TOOL_REQUEST = "where are my notes on the kubernetes cluster upgrade?"
HIGH = "let me search my notes for the kubernetes setup"  # high.txt: "let me search ..."
NEGATIVE = "the search algorithm in this paper is quite slow"  # negative.txt: talks about a tool verb


def _cfg(tmp, **cascade_keys):
    overrides = {("catalogs",): [str(CATALOGS / "notes.json")], ("store",): str(tmp / "s.db"), ("server", "port"): 0,
                 ("model", "name"): models.DEFAULT_MODEL, ("cascade", "screen"): models.SMALL_MODEL}  # fmt: skip
    overrides.update({("cascade", k): v for k, v in cascade_keys.items()})
    return config_mod.load(env={}, overrides=overrides)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Sidecar.open(_cfg(tmp_path_factory.mktemp("cascade"), reject_below=0.1), progress=False, history=False)
    yield eng
    eng.close()


def main_texts(engine: Sidecar) -> int:
    """Texts the main model was asked to embed (its query cache sees every one)."""
    q = engine.pipeline.queries
    return q.hits + q.misses


def screened(engine: Sidecar) -> int:
    q = engine.screen.queries
    return q.hits + q.misses


def test_the_engine_has_a_screen_of_the_small_model_on_the_same_catalog(engine):
    assert engine.pipeline.embedder.name == models.DEFAULT_MODEL
    assert engine.screen is not None and engine.screen.embedder.name == models.SMALL_MODEL
    assert engine.screen.catalog is engine.catalog and engine.screen.patterns is engine.pipeline.patterns
    assert engine.screen.head is not None  # its built-in calibration: the cutoff is a probability


def test_small_talk_is_settled_without_the_main_model(engine):
    before, stats = main_texts(engine), (engine.cascade_stats.settled, engine.cascade_stats.passed)
    [j] = engine.judge([Request(SMALL_TALK)])
    d = j.decision
    assert main_texts(engine) == before  # nomic never saw it
    assert d.path == engine_mod.SETTLED_PATH and d.kind == "fallback" and not d.fired and d.tier is None and j.ranked is None
    assert d.score is not None and d.score < 0.1 and d.threshold == 0.1
    assert (engine.cascade_stats.settled, engine.cascade_stats.passed) == (stats[0] + 1, stats[1])


def test_a_clear_tool_request_reaches_the_main_model(engine):
    before, passed = main_texts(engine), engine.cascade_stats.passed
    [j] = engine.judge([Request(TOOL_REQUEST)])
    assert main_texts(engine) == before + 1
    assert engine.cascade_stats.passed == passed + 1
    d = j.decision
    assert d.path == "fallback" and d.fired and d.tool in engine.catalog.names(), d
    assert d.timing_ms.total >= d.timing_ms.embed > 0  # the screen's time is counted in


def test_a_mixed_batch_sends_only_the_unsettled_texts_to_the_main_model(engine):
    before = main_texts(engine)
    judged = engine.judge([Request(SMALL_TALK), Request(TOOL_REQUEST), Request("ok, sounds good to me.")])
    assert [j.decision.path for j in judged] == [engine_mod.SETTLED_PATH, "fallback", engine_mod.SETTLED_PATH]
    assert main_texts(engine) == before + 1


def test_a_high_pattern_text_is_never_settled_and_a_negative_match_is_screened_like_any_fallback_text(engine):
    everything = Sidecar(with_cutoff(engine.cfg, 1.0), engine.pipeline, None, None, engine.screen)  # settles every fallback text
    main0, screen0 = main_texts(engine), screened(engine)
    high, neg, small = everything.judge([Request(HIGH), Request(NEGATIVE), Request(SMALL_TALK)])
    assert high.decision.kind == "high" and high.decision.path != engine_mod.SETTLED_PATH
    # the built-in heads weigh a negative match rather than obey it: the text takes the fallback path
    assert engine.pipeline.route(Request(NEGATIVE)).path.startswith("fallback:negative:")
    assert neg.decision.path == small.decision.path == engine_mod.SETTLED_PATH
    assert main_texts(engine) == main0 + 1  # the high one only
    assert screened(engine) == screen0 + 2  # the small talk and the negative match: high texts skip the screen


def with_cutoff(cfg, cut: float):
    return msgspec.structs.replace(cfg, cascade=msgspec.structs.replace(cfg.cascade, reject_below=cut))


def test_a_session_catalog_keeps_the_screen(engine):
    other = load_catalog([CATALOGS / "time.json"])  # two tools: few for nomic to embed
    derived = engine.with_catalog(other, persist=False)
    assert derived.screen is not None and derived.screen is not engine.screen
    assert derived.screen.catalog is derived.catalog and engine.screen.catalog is engine.catalog
    assert derived.cascade_stats is engine.cascade_stats  # /metrics counts every session's texts
    before, settled = main_texts(derived), engine.cascade_stats.settled
    [j] = derived.judge([Request(SMALL_TALK)])
    assert j.decision.path == engine_mod.SETTLED_PATH and main_texts(derived) == before
    assert engine.cascade_stats.settled == settled + 1
    assert all(c.tool in set(other.names()) for c in j.decision.candidates)  # the screen ranked the session's tools


def test_metrics_count_settled_and_passed_texts(engine, tmp_path):
    """A real server and client: /metrics shows what the screen settled and passed on."""
    served = Sidecar(engine.cfg, engine.pipeline, None, None, engine.screen, CascadeStats())

    async def run() -> tuple[float, float]:
        server = SidecarServer(engine.cfg, engine=served)
        await server.start()
        try:
            async with await SidecarClient.connect(server.url, session="c", decisions=True) as sc:
                for i, text in enumerate([SMALL_TALK, TOOL_REQUEST]):
                    await sc.user(f"u{i}", text)
                    await sc.end(f"u{i}")
                    while not isinstance(await sc.recv(60), p.Ended):
                        pass
            m = server.metrics
            return m.value("sidecar_cascade_texts_total", outcome="settled"), m.value("sidecar_cascade_texts_total", outcome="passed")
        finally:
            await server.shutdown()

    assert asyncio.run(asyncio.wait_for(run(), 120)) == (1.0, 1.0)


def test_the_cutoff_is_the_highest_that_loses_at_most_the_allowance():
    # 100 positives the main model fires on; four are on the fallback path with low screen probabilities
    prob = [0.01, 0.02, 0.03, 0.30] + [0.9] * 96 + [0.005, 0.2, 0.5]  # then three negatives
    kinds = ["fallback"] * 100 + ["fallback", "fallback", "fallback"]
    fired = [True] * 100 + [False, True, False]
    positive = [True] * 100 + [False] * 3
    one = cascade.fit_reject_below(prob, kinds, fired, positive, max_loss=0.01)
    assert one.reject_below == 0.02  # settles 0.01 only: one of 100
    assert (one.lost_positives, one.main_fired_positives) == (1, 100)
    assert one.settled_negatives_share == pytest.approx(1 / 3)  # 0.005
    two = cascade.fit_reject_below(prob, kinds, fired, positive, max_loss=0.02)
    assert two.reject_below == 0.03 and two.lost_positives == 2
    # the 0.2 negative the main model fires on is settled from 0.2 up: a false fire removed
    three = cascade.fit_reject_below(prob, kinds, fired, positive, max_loss=0.03)
    assert three.reject_below == 0.30 and three.removed_false_fires == 1 and three.lost_positives == 3
    assert cascade.fit_reject_below(prob, kinds, fired, positive, max_loss=0.0).reject_below == 0.01  # loses none


def test_high_and_blocked_texts_are_outside_the_fit():
    prob = [0.0, float("nan"), 0.5, 0.6]
    kinds = ["high", "negative", "fallback", "fallback"]
    out = cascade.fit_reject_below(prob, kinds, [True, False, True, False], [True, False, True, False], max_loss=0.0)
    assert out.reject_below == 0.5  # the high positive at 0.0 is never settled, so it does not bound the cutoff
    assert out.lost_positives == 0 and out.settled_share == 0.0
    assert out.reaching_main_share == 0.75  # the blocked one is embedded by neither model


def test_config_rejects_a_bad_cascade():
    with pytest.raises(config_mod.ConfigError, match=r"cascade.reject_below=1.5"):
        config_mod.load(env={}, overrides={("cascade", "reject_below"): 1.5})
    with pytest.raises(config_mod.ConfigError, match=r"cascade.screen='tiny-bert'"):
        config_mod.load(env={}, overrides={("cascade", "screen"): "tiny-bert"})
    assert config_mod.load(env={}, overrides={("cascade", "screen"): "all-minilm-l6-v2:q8_0"}).cascade.screen == "all-minilm-l6-v2:q8_0"


def test_the_cascade_is_skipped_when_the_screen_is_the_main_model(engine):
    cfg = msgspec.structs.replace(engine.cfg, cascade=msgspec.structs.replace(engine.cfg.cascade, screen=models.DEFAULT_MODEL + ":q8_0"))
    assert engine_mod.screen_pipeline(cfg, engine.pipeline, progress=False) is None


def test_the_screen_follows_a_catalog_reindexed_in_place(engine):
    """Live MCP servers reindex the engine's pipeline in place; the screen catches up on the next judgement."""
    derived = engine.with_catalog(load_catalog([CATALOGS / "time.json"]), persist=False)
    derived.pipeline.reindex(load_catalog([CATALOGS / "fetch.json"]), persist=False)
    assert derived.screen.catalog is not derived.catalog
    [j] = derived.judge([Request(SMALL_TALK)])
    assert derived.screen.catalog is derived.catalog
    assert {c.tool for c in j.decision.candidates} <= set(derived.catalog.names())


def test_the_cascade_command_fits_and_reports(engine, tmp_path, capsys):
    """`sidecar cascade --json` on a small labelled set: the fitted cutoff keeps every request
    nomic fires on (max-loss 0 of a handful), settles small talk, and reports both gates."""
    import json

    from sidecar import cli

    rows = [{"text": t, "expect": None} for t in (SMALL_TALK, "ok, sounds good to me.", "I hope your weekend was relaxing.")]
    rows += [{"text": TOOL_REQUEST, "expect": "semantic_search"}, {"text": HIGH, "expect": "semantic_search"}]
    labeled = tmp_path / "l.jsonl"
    labeled.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["cascade", "--labeled", str(labeled), "--catalog", str(CATALOGS / "notes.json"), "--store", engine.cfg.store,
            "--model", models.DEFAULT_MODEL, "--screen", models.SMALL_MODEL, "--max-loss", "0", "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    cut = out["cutoff"]
    assert out["fitted"] and cut["texts"] == 5 and cut["lost_positives"] == 0
    assert cut["settled_negatives_share"] > 0  # some small talk never reaches nomic
    assert out["gate_cascade"]["tp_rate"] == out["gate_main"]["tp_rate"]


def test_eval_and_serve_agree_with_a_cascade(engine):
    """`eval` judges through `Sidecar.judge` as `serve` does: with the cascade on, every text
    gets the same path, verdict and first injected tool from `evaluate.score` as from a real
    server's user turns (settled small talk included)."""
    from sidecar.lab import evaluate

    texts = [SMALL_TALK, TOOL_REQUEST, "ok, sounds good to me.", HIGH, "add a note that the demo moved to friday"]
    items = [evaluate.Labeled(t, "semantic_search" if t in (TOOL_REQUEST, HIGH) else None) for t in texts]
    scored = evaluate.score(engine, items)
    assert engine_mod.SETTLED_PATH in [d.path for d in scored.decisions]  # the screen settled something
    assert any(d.fired for d in scored.decisions)
    served = Sidecar(engine.cfg, engine.pipeline, None, None, engine.screen, CascadeStats())

    async def run() -> list[tuple[str, bool, str | None]]:
        server = SidecarServer(engine.cfg, engine=served)
        await server.start()
        out = []
        try:
            async with await SidecarClient.connect(server.url, session="agree", decisions=True) as sc:
                for i, text in enumerate(texts):
                    await sc.user(f"u{i}", text)
                    await sc.end(f"u{i}")
                    path, fired, first = None, False, None
                    while not isinstance(m := await sc.recv(60), p.Ended):
                        if isinstance(m, p.DecisionReport):
                            path, fired = m.path, m.fired
                        elif isinstance(m, p.Inject):
                            first = m.tools[0].definition["name"]
                    out.append((path, fired, first))
        finally:
            await server.shutdown()
        return out

    served_out = asyncio.run(asyncio.wait_for(run(), 120))
    evaluated = [(d.path, d.fired, f if d.fired else None) for d, f in zip(scored.decisions, scored.first)]
    assert served_out == evaluated
