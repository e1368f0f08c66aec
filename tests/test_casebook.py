"""Written cases for tools whose catalog ships none (issue 48): the shipped packs apply by what a
tool is, never to a changed tool; a case writer behind a real OpenAI-compatible HTTP server on
127.0.0.1 writes once per tool into a real SQLite store, and a reply that is not the asked JSON
is refused for that tool alone."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from sidecar.core import catalog as catalog_mod
from sidecar.core.casebook import Written, builtin, clean, tool_key
from sidecar.learn.writer import WriterError, few_shot_prompt, parse_lines, parse_reply, sift
from tests.openai_upstream import Scripted, Upstream

ROOT = pathlib.Path(__file__).resolve().parent.parent
CATALOGS = ROOT / "fixtures" / "catalogs"


def sidecar(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sidecar", *args], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


def test_clean_keeps_plain_bounded_distinct_text():
    got = clean(["  **Save** this\x00 note  ", "save THIS note", '"list my files"', "`rm -rf /`", "word " * 41, 7, "", "- a bullet"], most=4)
    assert got == ("Save this note", "list my files", "rm -rf /", "a bullet")
    assert len(clean([f"request {i}" for i in range(50)])) == 24


def test_a_pack_applies_by_what_the_tool_is_and_never_to_a_changed_one():
    single = catalog_mod.load([CATALOGS / "filesystem.json"]).get("write_file")
    merged = catalog_mod.load([CATALOGS / "ALL.json"]).get("filesystem__write_file")
    assert tool_key(single) == tool_key(merged)  # a server's own catalog and a merged one are the same tool
    book = builtin()
    written = book.get(single)
    assert written is not None and written.origin == "pack:filesystem" and len(written.cases) >= 10
    changed = catalog_mod.from_tools([{**single.definition(), "name": "write_file", "description": single.description + " Now also zips it."}])
    assert book.get(changed.get("write_file")) is None
    filled = book.fill(catalog_mod.load([CATALOGS / "filesystem.json"]), 5)
    assert all(len(t.cases or ()) >= 10 for t in filled)
    own = catalog_mod.load([CATALOGS / "notes.json"])  # a catalog with its own cases keeps them
    assert book.fill(own, 5) is own


def test_every_shipped_pack_matches_its_catalog():
    """bench/build_packs.py --check: the packs are what the written cases and the catalogs give."""
    out = subprocess.run([sys.executable, "bench/build_packs.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert len(builtin()) >= 600


def test_a_reply_that_is_not_the_asked_json_is_refused():
    ok = parse_reply('```json\n{"requests": ["save my notes", "write hello to a.txt", "store this"], "near_misses": ["what is a file?"]}\n```', "t", "w")
    assert ok == Written(("save my notes", "write hello to a.txt", "store this"), ("what is a file?",), "w")
    for bad in ("Sure! Here are some requests: save my notes", '{"cases": ["a", "b", "c"]}', '{"requests": ["only one"]}', "[1, 2, 3]"):
        with pytest.raises(WriterError, match="^t: "):
            parse_reply(bad, "t", "w")


def test_cases_write_asks_an_openai_compatible_api_once_per_tool(tmp_path):
    """Against a real HTTP server on 127.0.0.1: time.json's two tools are written, kept in the
    store, shown as the writer's, and a second run asks nothing. A tool whose reply is prose
    fails alone, with its name."""
    catalog = tmp_path / "tools.json"
    tools = catalog_mod.load([CATALOGS / "time.json"])
    catalog.write_text(json.dumps({"server": "clock", "tools": [t.definition() for t in tools]}))  # the same tools under another server name
    good = {"requests": ["what time is it in Tokyo", "convert 3pm Paris time to New York", "is it morning in Sydney now?"],
            "near_misses": ["time zones are confusing"]}
    store = str(tmp_path / "store.db")
    with Upstream([Scripted(text=json.dumps(good)), Scripted(text="I cannot help with that.")]) as up:
        out = sidecar("cases", "write", "--catalog", str(catalog), "--store", store, "--writer", f"openai:{up.url}",
                      "--writer-model", "m", "--replace-packs", "-q")  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert "wrote cases for 1 of 2 tools" in out.stdout
        assert "not JSON" in out.stderr and tools.tools[1].name in out.stderr
        assert up.requests[0].body["model"] == "m" and "get_current_time" in up.requests[0].body["messages"][1]["content"]
        asked = len(up.requests)
        again = sidecar("cases", "write", "--catalog", str(catalog), "--store", store, "--writer", f"openai:{up.url}",
                        "--writer-model", "m", "--replace-packs", "-q")  # fmt: skip
        assert again.returncode == 1 and len(up.requests) == asked + 1  # only the failed tool is asked again, and fails again
    shown = json.loads(sidecar("cases", "show", "--catalog", str(catalog), "--store", store, "--json").stdout)
    first = next(r for r in shown if r["tool"] == tools.tools[0].name)
    assert first["source"] == f"openai:{up.url}" and first["cases"][0] == "what time is it in Tokyo"


def test_cases_write_without_a_writer_says_how_to_name_one(tmp_path):
    out = sidecar("cases", "write", "--catalog", str(CATALOGS / "time.json"), "--store", str(tmp_path / "s.db"), "--replace-packs")
    assert out.returncode == 2 and "--writer openai:URL" in out.stderr


def test_serve_writes_cases_in_the_background_and_reindexes_with_them(tmp_path):
    """A real `sidecar serve` with a writer: it answers at once, then writes cases for the tools no
    pack covers (here time.json's, their descriptions changed) through a real HTTP server on
    127.0.0.1, keeps them in its store and reindexes; `cases show` then names the writer."""
    import sqlite3
    import time as time_mod

    from tests.conftest import serve_process

    tools = [{**t.definition(), "description": t.description + " (self-hosted)"} for t in catalog_mod.load([CATALOGS / "time.json"])]
    catalog = tmp_path / "clock.json"
    catalog.write_text(json.dumps({"server": "clock", "tools": tools}))
    reply = {"requests": ["what time is it in Lagos", "current time in Oslo please", "is it late in Tokyo right now?"], "near_misses": []}
    store = tmp_path / "store.db"
    with Upstream([Scripted(text=json.dumps(reply))]) as up:
        config = tmp_path / "sidecar.toml"
        config.write_text(f'[cases]\nfill = true\nwriter = "openai:{up.url}"\nwriter_model = "m"\n')
        with serve_process(["--config", str(config), "--catalog", str(catalog), "--store", str(store), "--model", "all-minilm-l6-v2"], tmp_path) as served:
            deadline = time_mod.monotonic() + 120
            while "reindexed" not in served.log_text() and time_mod.monotonic() < deadline:
                time_mod.sleep(0.5)
            assert "2 of 2 tools written" in served.log_text(), served.log_text()[-2000:]
        assert len(up.requests) == 2
    rows = sqlite3.connect(store).execute("SELECT writer FROM written_cases").fetchall()
    assert rows == [(f"openai:{up.url}",)] * 2
    shown = json.loads(sidecar("cases", "show", "--config", str(config), "--catalog", str(catalog), "--store", str(store), "--json").stdout)
    assert [r["source"] for r in shown] == [f"openai:{up.url}"] * 2 and all(r["indexed"] for r in shown)


def test_serve_is_ready_on_descriptions_then_adds_the_packs_and_remembers_its_fit(tmp_path):
    """A real `sidecar serve` on the defaults ([cases] fill) over filesystem.json, whose tools a
    shipped pack covers: it listens before the cases are in (ready on the descriptions), then
    reindexes with them in the background; a real client's "how big is report.pdf" is then
    injected get_file_info first (descriptions alone: list_directory_with_sizes), the gate
    judging it on the descriptions as before. The catalog's own fit is kept in the store: a second start reads it
    instead of fitting again."""
    import asyncio
    import sqlite3
    import time as time_mod

    from sidecar import protocol as p
    from sidecar.client import SidecarClient
    from tests.conftest import serve_process

    store = tmp_path / "store.db"
    args = ["--catalog", str(CATALOGS / "filesystem.json"), "--store", str(store), "--model", "all-minilm-l6-v2"]

    async def ask(url: str) -> list[str | None]:
        """The best tool of each span that fired."""
        async with await SidecarClient.connect(url, session="s", decisions=True) as sc:
            await sc.user("u", "how big is report.pdf")
            await sc.end("u")
            got = []
            while not isinstance(msg := await sc.recv(60), p.Ended):
                got.append(msg)
            return [m.tool for m in got if isinstance(m, p.DecisionReport) and m.fired]

    with serve_process(args, tmp_path) as served:
        deadline = time_mod.monotonic() + 180
        while "written cases added" not in served.log_text() and time_mod.monotonic() < deadline:
            time_mod.sleep(0.5)
        log = served.log_text()
        assert log.index("listening on") < log.index("written cases added"), log[-2000:]
        best = asyncio.run(ask(served.url))
    assert best == ["get_file_info"], best
    fits = sqlite3.connect(store).execute("SELECT key, created FROM self_fits ORDER BY key").fetchall()
    assert fits
    with serve_process(args, tmp_path, name="again") as served:
        deadline = time_mod.monotonic() + 120
        while "written cases added" not in served.log_text() and time_mod.monotonic() < deadline:
            time_mod.sleep(0.5)
        assert "written cases added" in served.log_text()
        assert asyncio.run(ask(served.url)) == ["get_file_info"]
    assert sqlite3.connect(store).execute("SELECT key, created FROM self_fits ORDER BY key").fetchall() == fits  # read, not fitted again


def _tool(name: str, description: str, **props) -> catalog_mod.Tool:
    return catalog_mod.from_tools([{"name": name, "description": description, "inputSchema": {"type": "object", "properties": props}}],
                                  origin="test").get(name)  # fmt: skip


def test_a_base_model_gets_a_completion_open_at_its_first_bullet():
    tool = _tool("book_reservation", "Book a reservation.", user_id={"type": "string"}, origin={"type": "string"})
    prompt = few_shot_prompt(tool)
    assert prompt.endswith("Tool: book_reservation\nDescription: Book a reservation.\nParameters: user_id, origin\nRequests:\n-")
    assert prompt.count("Requests:\n- ") == 2  # the two worked examples, each a list of requests


def test_a_base_models_lines_are_read_to_the_end_of_its_list_without_fragments():
    tool = _tool("cancel_reservation", "Cancel the whole reservation.")
    completion = (" Cancel my booking ZFA04Y please\n- I can't fly on Friday, call the whole trip off\n- 16.46\n- sum,\n"
                  "  - a nested item ends the list\n- never read")
    assert parse_lines(completion, tool) == ["Cancel my booking ZFA04Y please", "I can't fly on Friday, call the whole trip off"]
    assert parse_lines(" cancel_reservation for trip ZFA04Y now\n- call off my flight to Boston\nTool: next", tool) == ["call off my flight to Boston"]
    assert parse_lines("Server: x", tool) == []


@pytest.fixture(scope="module")
def small_embedder():
    from sidecar import config as config_mod
    from sidecar.core import models
    from sidecar.core.pipeline import open_embedder

    return open_embedder(config_mod.load(env={}, overrides={("model", "name"): models.SMALL_MODEL}), None, progress=False)


def test_sift_drops_repeats_and_what_the_embedding_places_nearer_another_tool(small_embedder):
    weather = _tool("get_current_weather", "Get the current weather for a city.")
    mail = _tool("send_email", "Send an email to someone.")
    flights = _tool("search_flights", "Search for flights between two airports on a date.")
    written = [
        (weather, Written(("weather in berlin right now", "is it raining in Oslo at the moment", "send an email to bob about lunch",
                           "how hot is it in Phoenix today", "tell me something"), (), "w")),
        (mail, Written(("email priya that the meeting moved", "send a note to my landlord by email", "write to lee@studio.co saying I'm late",
                        "tell me something"), (), "w")),
        (flights, Written(("book me a table for two", "is it raining in Oslo", "what's the weather in Paris"), (), "w")),
    ]  # fmt: skip
    bare = sift(written, [weather, mail, flights])  # no embedder: repeats only
    assert bare.repeated == 2 and all("tell me something" not in w.cases for _, w in bare.kept)
    got = sift(written, [weather, mail, flights], small_embedder)
    kept = {t.name: w.cases for t, w in got.kept}
    assert "send an email to bob about lunch" not in kept["get_current_weather"]
    assert {"weather in berlin right now", "how hot is it in Phoenix today"} <= set(kept["get_current_weather"])
    assert len(kept["send_email"]) == 3
    assert got.misplaced >= 3 and [t.name for t in got.emptied] == ["search_flights"]  # none of its three is about flights
