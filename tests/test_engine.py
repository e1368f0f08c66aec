"""One engine: detect, eval, replay and serve inject the same first tool for the same text and
catalog, because every one of them judges through `Sidecar.judge` (real model, real store,
a real server on 127.0.0.1 and the real CLI)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import msgspec

from sidecar import config as config_mod
from sidecar.core import models
from sidecar import protocol as p, replay
from sidecar.lab import evaluate
from sidecar.client import SidecarClient
from sidecar.engine import Sidecar
from sidecar.lab.evaluate import Labeled
from sidecar.core.pipeline import Request
from sidecar.serve.server import SidecarServer
from sidecar.store import open_store

from .conftest import CATALOGS, ROOT

CATALOG = CATALOGS / "filesystem.json"
TEXTS = [  # user turns that name no tool: the ranking, not a pattern, decides which tool is first
    "please look through the project folder for every yaml file",
    "open the settings file and show me what is in it",
    "make a new folder called archive in my documents",
    "write these notes into a new file named todo.txt",
    "move the old report into the backup directory",
    "list everything in the downloads folder",
]
BOUND_S = 300


def test_detect_eval_replay_and_serve_inject_the_same_first_tool(tmp_path):
    cfg = config_mod.load(env={}, overrides={("model", "name"): models.SMALL_MODEL, ("catalogs",): [str(CATALOG)],
                                             ("store",): str(tmp_path / "s.db"), ("server", "port"): 0})  # fmt: skip
    engine = Sidecar.open(cfg, progress=False)
    judged = engine.judge([Request(t) for t in TEXTS])
    first = {t: j.first for t, j in zip(TEXTS, judged)}
    fired = [t for t in TEXTS if first[t] is not None]
    assert len(fired) >= 3, first  # enough of them fire for the comparison to mean something
    assert len({first[t] for t in fired}) >= 2  # and not all for one tool

    # detect, as a user runs it
    for text in fired:
        out = subprocess.run([sys.executable, "-m", "sidecar", "detect", "--json", "--model", models.SMALL_MODEL, "--catalog", str(CATALOG),
                              "--store", str(tmp_path / "s.db"), text], capture_output=True, text=True, timeout=BOUND_S, cwd=ROOT)  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["inject"][0]["tool"] == first[text], text

    # eval: labelled with the engine's own first tools, every fired item is "fired with the right tool"
    items = [Labeled(t, first[t]) for t in fired]
    report = evaluate.evaluate(Sidecar.open(cfg, progress=False, history=False), items)
    assert report.gate.tp_rate == 1.0 and report.gate.correct_rate == 1.0

    # replay: each text as a user turn
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"conversation": f"c{i}", "role": "user", "content": t}) + "\n" for i, t in enumerate(fired)))
    detections, _ = replay.replay(engine, replay.read_transcripts([path], engine.catalog))
    assert {d.conversation: d.tools[0] for d in detections} == {f"c{i}": first[t] for i, t in enumerate(fired)}

    # serve: a real server and client
    async def served() -> dict[str, str]:
        server = SidecarServer(cfg, engine=Sidecar(cfg, engine.pipeline, open_store(tmp_path / "serve.db"), None))
        await server.start()
        try:
            async with await SidecarClient.connect(server.url, session="agree") as sc:
                got = {}
                for i, text in enumerate(fired):
                    await sc.user(f"u{i}", text)
                    await sc.end(f"u{i}")
                    while True:
                        m = await sc.recv(60)
                        if isinstance(m, p.Inject):
                            got[text] = m.tools[0].definition["name"]
                        if isinstance(m, p.Ended):
                            break
                return got
        finally:
            await server.shutdown()

    assert asyncio.run(asyncio.wait_for(served(), BOUND_S)) == {t: first[t] for t in fired}


def test_a_turn_of_several_asks_injects_a_tool_for_each(tmp_path):
    """Issue 31: "search ..., then delete ..." needs two tools; each ask is gated and ranked on
    its own and the inject holds both, in the order the asks come. A turn of one ask is judged
    as before, and `server.split_asks = false` turns it off."""
    from sidecar.core import asks

    assert asks.split("search my notes for the kubernetes setup, then delete the note about groceries") == [
        "search my notes for the kubernetes setup", "delete the note about groceries"]
    assert asks.split("salt and pepper, please") == ["salt and pepper, please"]  # "and" before no request verb
    assert asks.split("First, find my flight. Then book it. Finally, email me the receipt.") == [
        "find my flight", "book it", "email me the receipt"]
    overrides = {("model", "name"): models.SMALL_MODEL, ("catalogs",): [str(CATALOGS / "notes.json")], ("store",): str(tmp_path / "s.db")}
    engine = Sidecar.open(config_mod.load(env={}, overrides=overrides), progress=False, history=False)
    two = "search my notes for the kubernetes setup, then delete the note about groceries"
    [j] = engine.judge([Request(two)])
    assert {"semantic_search", "delete_note"} <= {r.tool for r in j.inject(0.05)}
    assert [r.tool for r in j.asks] == ["semantic_search", "delete_note"]  # each ask's best, in the order they come
    [one] = engine.judge([Request("search my notes for the kubernetes setup")])
    assert one.asks == [] and [r.tool for r in one.inject(0.05)] == ["semantic_search"]
    off = Sidecar(msgspec.structs.replace(engine.cfg, server=msgspec.structs.replace(engine.cfg.server, split_asks=False)), engine.pipeline, None, None)
    [j_off] = off.judge([Request(two)])
    assert j_off.asks == [] and len(j_off.inject(0.05)) < len(j.inject(0.05))


def test_a_turn_fires_on_its_strongest_ask(tmp_path):
    """A long turn whose request is one sentence among chatter ("It has been a long week ...
    Then search my notes for ...") reads, whole, like talk: the request's own sentence fires
    the turn, with that ask's tool first and the trigger where the ask stands in the turn
    (BFCL multi-turn, untuned: recall of the called tools 0.475 -> 0.549 at the same
    precision). The chatter alone stays silent."""
    overrides = {("model", "name"): models.SMALL_MODEL, ("catalogs",): [str(CATALOGS / "notes.json")], ("store",): str(tmp_path / "s.db")}
    engine = Sidecar.open(config_mod.load(env={}, overrides=overrides), progress=False, history=False)
    chatter = "We had a lovely dinner with my parents last night and talked about old times for hours."
    ask = "search my notes for the kubernetes setup"
    turn = f"{chatter} Then {ask}."
    [alone] = engine.judge([Request(chatter)])
    assert not alone.decision.fired
    [whole] = Sidecar(msgspec.structs.replace(engine.cfg, server=msgspec.structs.replace(engine.cfg.server, split_asks=False)),
                      engine.pipeline, None, None).judge([Request(turn)])  # fmt: skip
    assert not whole.decision.fired  # read whole, the turn is talk: what the asks are for
    [j] = engine.judge([Request(turn)])
    assert j.decision.fired and j.first == "semantic_search", (j.decision, j.first)
    trig = j.decision.trigger
    assert trig is not None and turn[trig.start : trig.end] == trig.text and trig.start >= len(chatter), trig


def test_under_a_lesson_an_ask_is_held_to_the_bar_without_it(tmp_path):
    """A lesson from traffic fits its bar on whole turns; the sentences of a chatty turn taken
    one by one are mostly statements, so an ask adds its tool only where it would fire without
    the lesson. Here the lesson's bar fires anything: the statement alone fires, as an ask it
    adds nothing, and the request beside it still does."""
    from sidecar.learn.traffic import Example, Learned

    overrides = {("model", "name"): models.SMALL_MODEL, ("catalogs",): [str(CATALOGS / "notes.json")], ("store",): str(tmp_path / "s.db")}
    engine = Sidecar.open(config_mod.load(env={}, overrides=overrides), progress=False, history=False)
    request, statement, talk = "search my notes for the kubernetes setup", "My notes are a mess these days.", "thanks, that is all for today"
    [plain] = engine.judge([Request(statement)])
    assert not plain.decision.fired  # without a lesson a statement is silent
    pipe = engine.pipeline
    vectors = pipe.queries.embed(pipe.embedder, [request, talk]).vectors
    pipe.learned = Learned.of([Example(request, "semantic_search", vectors[0], "s"), Example(talk, None, vectors[1], "s")],
                              pipe.catalog.names(), bar=0.0001)  # fmt: skip
    [alone] = engine.judge([Request(statement)])
    assert alone.decision.fired  # the lesson's bar fires it on its own
    [turn] = engine.judge([Request(f"{request}. {statement}")])
    assert turn.decision.fired and [r.tool for r in turn.asks] == ["semantic_search"], [r.tool for r in turn.asks]
