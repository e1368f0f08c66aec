"""Replies learned from a chat log (issue 49, item 1): the spans of an agent's replies that
commit to an action, paired with the tool the reply then called, read by `sidecar learn
--from` the way user turns are; a later reply span nearly the same puts that tool first. On a
real agent's log nobody here wrote (tau-bench airline, fixtures/transcripts/tau-airline), the
real small model and a real SQLite store."""

from __future__ import annotations

import sqlite3

import pytest

from sidecar import config as config_mod
from sidecar.core import models
from sidecar.core.pipeline import Request
from sidecar.engine import Sidecar
from sidecar.learn.traffic import log_examples, reply_spans
from sidecar.replay import replay
from sidecar.serve.learner import apply_learned, traffic_log
from sidecar.store import open_store
from sidecar.transcripts import read_transcripts

from .conftest import ROOT

HERE = ROOT / "fixtures" / "transcripts" / "tau-airline"
LEARNED = 40  # conversations learned from; the other 20 are replayed


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    store = tmp_path_factory.mktemp("tau") / "s.db"
    cfg = config_mod.load(env={}, overrides={("model", "name"): models.SMALL_MODEL, ("catalogs",): [str(HERE / "catalog.json")],
                                             ("store",): str(store)})  # fmt: skip
    return Sidecar.open(cfg, store=open_store(cfg.store), progress=False)


def test_a_reply_span_is_learned_only_where_the_reply_commits_and_a_call_follows(engine):
    convs = read_transcripts([HERE / "log.jsonl"], engine.catalog)[:LEARNED]
    spans = reply_spans(engine.pipeline, convs)
    assert spans
    for text, tool, conv in spans:
        assert engine.pipeline.route(Request(text, "llm")).path.startswith("high"), text
        assert tool in engine.catalog.names()
    by_id = {c.id: c for c in convs}
    for text, tool, conv in spans:  # the tool is the reply's own first call, or the first call right after it
        msgs = by_id[conv].messages
        k = next(i for i, m in enumerate(msgs) if m.role == "assistant" and text in (m.content or ""))
        after = [c.name for m in msgs[k:] for c in (m.tool_calls or ())][:1]
        assert after == [tool]
    asked = [m for c in convs for i, m in enumerate(c.messages) if m.role == "assistant" and "please confirm" in (m.content or "").lower()]
    assert asked and not any(text in (m.content or "") for m in asked for text, _, _ in spans if "please confirm" in text.lower())


def test_replies_learned_from_a_log_put_the_tool_they_called_first(engine, tmp_path):
    convs = read_transcripts([HERE / "log.jsonl"], engine.catalog)
    played = convs[LEARNED:]
    before = replay(engine, played)[1].by_role["assistant"]
    turns, examples = log_examples(engine.pipeline, convs[:LEARNED])
    replies = [e for e in examples if e.source == "llm"]
    assert replies and all(e.tool is not None and e.vector is not None for e in replies)
    by_text: dict[str, set[str]] = {}
    for e in replies:
        by_text.setdefault(e.text, set()).add(e.tool)
    said = list(by_text.items())[:10]
    unlearned = [engine.judge([Request(text, "llm")])[0].decision.tool for text, _ in said]
    tlog = traffic_log(engine)
    assert tlog.add(examples) == len(examples)
    assert tlog.summary()["replies"] == len(replies)
    assert apply_learned(engine) is not None
    lesson = engine.pipeline.learned
    assert lesson is not None and len(lesson.replies) == len(replies)
    # a span said before ranks the tool its reply called first
    for text, tools in said:
        [j] = engine.judge([Request(text, "llm")])
        assert j.decision.tool in tools, (text, j.decision.tool, tools)
    assert sum(t in tools for t, (_, tools) in zip(unlearned, said)) < len(said)  # not so before (MiniLM: 4 of 10)
    after = replay(engine, played)[1].by_role["assistant"]
    assert after["precision"] >= before["precision"], (before, after)
    assert after["recall"] >= before["recall"], (before, after)
    engine.pipeline.learned = None


def test_a_store_from_before_reply_spans_gains_the_source_column(engine, tmp_path):
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE traffic_examples (id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, model TEXT NOT NULL, "
                   "session TEXT NOT NULL, text TEXT NOT NULL, tool TEXT, vector BLOB NOT NULL)")
        db.execute("INSERT INTO traffic_examples (ts, model, session, text, tool, vector) VALUES (0, 'm', 's', 'find my booking', "
                   "'get_reservation_details', ?)", (bytes(2 * 4),))  # fmt: skip
    from sidecar.learn.traffic import TrafficLog

    tlog = TrafficLog(open_store(str(path)), "m")
    [old] = tlog.examples()
    assert (old.text, old.tool, old.source) == ("find my booking", "get_reservation_details", "user")
