"""One ranking, kept (issue 52): every entry point ranks a text as the engine does.

`detect`, `recommend`, `eval`, `serve`, the proxy and `sidecar mcp`'s find_tool all go through
`Sidecar.judge` / `Sidecar.rank` (sidecar/engine.py). tests/test_engine.py checks that they
inject the same FIRST tool; here each is asked the same user turns and what it shows of the
ranking (the ordered tool names) is compared with the engine's own, taken as the reference:

- the ranking, `Sidecar.rank(text, top=K)`: `recommend --json`'s results, `eval --items`'
  top three of each item, find_tool's tools;
- the inject, `Judgement.inject(margin)`: `detect --json`'s inject (and its candidates against
  the engine's gate ranking), the tools of `serve`'s inject frame, the tools the proxy adds to
  the upstream request, `eval --items`' injected.

One TOML config sets what differs by default between the doors: the inject margin (1.0, so an
inject holds the ranking's first `max_inject_tools` = K tools rather than the one or two within
the default 0.03), the recommender's top (K), and the proxy's tier policy (a confirm-tier
inject is added too). The inject of a fired turn is the ranking's head (its first K tools),
so every door is compared on the same K tools.

`sidecar mcp` takes no catalog file, only MCP servers: find_tool is compared on the tools of
real servers (the npm filesystem server and mcp-server-time), against the engine over a
catalog written from what those servers list.

A fresh store has learned nothing; a store that holds traffic has (a lesson that reorders the
ranking of user turns, tools that go together). `serve` and the proxy apply it when they
start: the second test asks every door again on such a store, with the engine that applied it
as the reference (`eval`, history-neutral, ranks as the engine without it).

Real parts throughout: the small real model, a real SQLite store in tmp_path, the CLI as a
subprocess, a real server and proxy on 127.0.0.1 (the proxy's upstream is the scripted
OpenAI-compatible server of tests/openai_upstream.py, the client the official openai SDK),
`sidecar mcp` over stdio driven by the official MCP SDK. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import mcp
import openai

from sidecar import config as config_mod
from sidecar import protocol as p
from sidecar.client import SidecarClient
from sidecar.core import models
from sidecar.core.pipeline import Request
from sidecar.engine import Sidecar
from sidecar.mcp import config as mcp_config
from sidecar.mcp.connections import ConnectionManager
from sidecar.proxy.app import ProxyServer
from sidecar.serve.learner import apply_learned
from sidecar.serve.server import SidecarServer
from sidecar.transcripts import read_transcripts

from .conftest import CATALOGS, ROOT
from .mcp_support import TIME, fs_spec, until
from .openai_upstream import Scripted, Upstream

CATALOG = CATALOGS / "filesystem.json"
K = 3  # tools compared: the ranking's head, and what an inject holds
TIED = 1e-3  # recommendation scores this close swap between a batched and a single embedding
TEXTS = [  # user turns that name no tool; some fire, some stay silent (ranked all the same)
    "open the settings file and show me what is in it",  # two asks: each ask's best joins the inject (here within the head)
    "write these notes into a new file named todo.txt",
    "move the old report into the backup directory",
    "list everything in the downloads folder",
    "show me the whole tree of the src directory",
    "when was config.yaml last modified",
    "which directories am I allowed to access",
    "make a new folder called archive in my documents",
    "how big are the files in my photos folder",
]
LIVE_TEXTS = [  # for find_tool, over the filesystem and time servers
    "open the settings file and show me what is in it",
    "write these notes into a new file named todo.txt",
    "list everything in the downloads folder",
    "when was config.yaml last modified",
    "what time is it in Tokyo",
    "convert 3pm London time to New York time",
]
BFCL = ROOT / "fixtures" / "transcripts" / "bfcl-multi-turn"
CATALOG_SERVER = ROOT / "tests" / "mcp_servers" / "catalog_server.py"
LOGGED = 50  # conversations of BFCL's learn.jsonl the store learns from: enough for a lesson in force (25 were, before the index read past the APIs' shared paragraph)
LEARNED_TEXTS = [  # the heads of user turns of BFCL's replay.jsonl (the half not learned from) whose ranking the lesson changes
    "I have secured my car by locking all doors and applying the parking brake.",
    "I'm ready to proceed with booking the flight.",
    "Great! To proceed, I'd like to ascertain the estimated airfare from tranquil Rivermist",
    "Open up ticket 654321.",
    "Let's share the updates on tire status.",
]
BOUND_S = 300


def _env() -> dict[str, str]:
    """The environment of a child: no SIDECAR_* variable but what the test gives it."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}


def _sidecar(*args: str) -> str:
    """`python -m sidecar ARGS`'s stdout (it must succeed)."""
    out = subprocess.run([sys.executable, "-m", "sidecar", *args], check=False, capture_output=True, text=True, timeout=BOUND_S, cwd=ROOT, env=_env())
    assert out.returncode == 0, f"sidecar {' '.join(args)}: exit {out.returncode}\n{out.stderr[-3000:]}"
    return out.stdout


def _write_config(tmp_path, catalogs: list[str], store: str) -> str:
    path = tmp_path / "sidecar.toml"
    path.write_text(
        f"catalogs = {json.dumps(catalogs)}\n"
        f"store = {json.dumps(store)}\n"
        f'[model]\nname = "{models.SMALL_MODEL}"\n'
        f"[server]\nhost = \"127.0.0.1\"\nport = 0\ninject_margin = 1.0\nmax_inject_tools = {K}\n"
        f"[recommend]\ntop = {K}\n"
        '[proxy]\nhost = "127.0.0.1"\nport = 0\nconfirm_tools = "include"\non_narration = "off"\nfind_tools = "never"\n'
        "[cases]\nfill = false\n"  # serve and the proxy add the packs' cases after they start: every door on the descriptions alone
    )
    return str(path)


def test_detect_recommend_eval_serve_and_the_proxy_rank_as_the_engine_does(tmp_path):
    toml = _write_config(tmp_path, [str(CATALOG)], str(tmp_path / "s.db"))
    cfg = config_mod.load(toml, env={})
    engine = Sidecar.open(cfg, progress=False)

    # The reference: the engine's ranking of each text, and what it injects (the gate fired).
    ranking = {t: [r.tool for r in engine.rank(Request(t), K).results] for t in TEXTS}
    judged = dict(zip(TEXTS, engine.judge([Request(t) for t in TEXTS])))
    inject = {t: [r.tool for r in j.inject(cfg.server.inject_margin)] for t, j in judged.items()}
    gate = {t: [c.tool for c in j.decision.candidates] for t, j in judged.items()}
    fired = [t for t in TEXTS if judged[t].decision.fired]

    # The comparison means something: rankings of K tools, several different first tools, most
    # turns fire, and an inject is the ranking's head (judge's vector ranks as rank's own).
    assert all(len(ranking[t]) == K for t in TEXTS), ranking
    assert len({ranking[t][0] for t in TEXTS}) >= 2, ranking
    assert len(fired) >= len(TEXTS) // 2 + 1, fired
    for t in fired:
        assert [r.tool for r in judged[t].ranked.results] == ranking[t], t
        assert inject[t][:K] == ranking[t], (t, inject[t])
    assert any(judged[t].asks for t in fired)  # a turn of several asks, each ranked on its own, is among them
    assert all(inject[t] == [] for t in TEXTS if t not in fired)

    _detect(toml, TEXTS, fired, inject, gate)
    _recommend(toml, TEXTS, ranking)
    # eval, labelled with the engine's own first tools: every item right (or missed where the
    # gate is silent), and each item's top three and inject as the engine has them
    _eval(toml, tmp_path, TEXTS, fired, ranking, inject, {t: {r.tool: r.score for r in engine.rank(Request(t), 10).results} for t in TEXTS})
    assert _served(cfg, TEXTS) == inject
    assert _proxied(toml, TEXTS) == inject
    engine.close()


def test_a_store_that_learned_from_traffic_ranks_alike_everywhere(tmp_path):
    """A store that holds traffic (a chat log read by `sidecar learn --from`, as a server
    records its own) teaches a lesson and the tools that go together; `serve` and the proxy
    apply it when they start, and so must `detect`, `recommend` and find_tool, or they show a
    ranking the server does not use (issue 52: they did not). `eval` stays history-neutral by
    design: it measures the calibration alone, as the engine ranks without the store's learning.

    The catalog: BFCL multi-turn's 128 functions (fixtures/transcripts/bfcl-multi-turn, a log
    nobody here wrote), named bfcl__tool so that `sidecar mcp` sees the same names over
    tests/mcp_servers/catalog_server.py, a real MCP server listing them as written."""
    listed = json.loads((BFCL / "catalog.json").read_text())
    catalog = tmp_path / "bfcl.json"
    catalog.write_text(json.dumps({"tools": [{**t, "name": f"bfcl__{t['name']}"} for t in listed["tools"]]}))
    log = tmp_path / "learn.jsonl"
    with log.open("w") as out:
        for line in (BFCL / "learn.jsonl").read_text().splitlines()[:LOGGED]:
            conversation = json.loads(line)
            for m in conversation["messages"]:
                for call in m.get("tool_calls") or ():
                    call["function"]["name"] = f"bfcl__{call['function']['name']}"
            out.write(json.dumps(conversation) + "\n")
    toml = _write_config(tmp_path, [str(catalog)], str(tmp_path / "s.db"))
    learned = json.loads(_sidecar("learn", "--json", "-q", "--config", toml, "--from", str(log)))
    assert learned["in_use"] and learned["sequences"]["rules"], learned["fit"]  # a lesson in force, and tools that go together

    turns = [m.content for c in read_transcripts([BFCL / "replay.jsonl"]) for m in c.messages if m.role == "user"]
    texts = [next(t for t in turns if t.startswith(head)) for head in LEARNED_TEXTS]
    cfg = config_mod.load(toml, env={})
    plain = Sidecar.open(cfg, progress=False, history=False)  # what eval judges with: no history, no lesson
    engine = Sidecar.open(cfg, progress=False)
    assert apply_learned(engine) is not None and engine.pipeline.learned is not None  # the reference: as `serve` starts
    ranking = {t: [r.tool for r in engine.rank(Request(t), K).results] for t in texts}
    judged = dict(zip(texts, engine.judge([Request(t) for t in texts])))
    inject = {t: [r.tool for r in j.inject(cfg.server.inject_margin)] for t, j in judged.items()}
    gate = {t: [c.tool for c in j.decision.candidates] for t, j in judged.items()}
    unlearned = {t: [r.tool for r in plain.rank(Request(t), K).results] for t in texts}
    plain_judged = dict(zip(texts, plain.judge([Request(t) for t in texts])))
    plain_inject = {t: [r.tool for r in j.inject(cfg.server.inject_margin)] for t, j in plain_judged.items()}

    # The comparison means something: every turn fires, the lesson reorders every ranking and
    # changes the first tool of some, several first tools, and learned neighbours join some injects.
    assert all(judged[t].decision.fired for t in texts)
    assert all(len(ranking[t]) == K and ranking[t] != unlearned[t] for t in texts), (ranking, unlearned)
    assert any(ranking[t][0] != unlearned[t][0] for t in texts)
    assert len({ranking[t][0] for t in texts}) >= 3, ranking
    assert all(inject[t][:K] == ranking[t] for t in texts) and any(len(inject[t]) > K for t in texts), inject

    _detect(toml, texts, texts, inject, gate)
    _recommend(toml, texts, ranking)
    plain_scores = {t: {r.tool: r.score for r in plain.rank(Request(t), 10).results} for t in texts}
    _eval(toml, tmp_path, texts, [t for t in texts if plain_judged[t].decision.fired], unlearned, plain_inject, plain_scores)
    assert _served(cfg, texts) == inject
    mcp_json = tmp_path / "mcp.json"
    mcp_json.write_text(json.dumps({"mcpServers": {"bfcl": {"command": sys.executable, "args": [str(CATALOG_SERVER), str(BFCL / "catalog.json")]}}}))
    assert _found(mcp_json, toml, cfg.store, texts) == ranking
    assert _proxied(toml, texts) == inject  # last: the proxy records each request's turn in the store's traffic
    engine.close()
    plain.close()


def _detect(toml: str, texts: list[str], fired: list[str], inject: dict, gate: dict) -> None:
    """`sidecar detect --json`, as a user runs it: its inject, and its candidates (the gate's ranking, by match)."""
    for t in texts:
        got = json.loads(_sidecar("detect", "--json", "-q", "--config", toml, t))
        assert got["fired"] == (t in fired), t
        assert [r["tool"] for r in got["inject"]] == inject[t], t
        assert [c["tool"] for c in got["candidates"]] == gate[t], t


def _recommend(toml: str, texts: list[str], ranking: dict) -> None:
    """`sidecar recommend --json`: its results, in order."""
    for t in texts:
        got = json.loads(_sidecar("recommend", "--json", "-q", "--config", toml, t))
        assert [r["tool"] for r in got["results"]] == ranking[t], t


def _eval(toml: str, tmp_path, texts: list[str], fired: list[str], ranking: dict, inject: dict, scores: dict) -> None:
    """`sidecar eval --items`, labelled with `ranking`'s first tools: every item right where the
    gate fires (missed where it is silent), and each item's top three and inject as given.

    eval embeds its texts 16 at a time, the other doors one at a time, and llama.cpp's batched
    vectors differ from single ones in the 4th decimal (../shared/notes): two tools whose
    scores (`scores`, the reference's) lie within `TIED` of each other may swap places here."""
    labeled, items = tmp_path / "own.jsonl", tmp_path / "items.jsonl"
    labeled.write_text("".join(json.dumps({"text": t, "expect": ranking[t][0]}) + "\n" for t in texts))
    report = json.loads(_sidecar("eval", "--json", "-q", "--config", toml, "--labeled", str(labeled), "--items", str(items)))
    assert report["ranking"]["top1"] == 1.0 and report["gate"]["correct_rate"] == report["gate"]["tp_rate"], report["gate"]
    outcomes = {o["text"]: o for o in map(json.loads, items.read_text().splitlines())}
    assert set(outcomes) == set(texts)
    for t, o in outcomes.items():
        assert o["verdict"] == ("right" if t in fired else "missed"), o
        assert _alike(o["top"], ranking[t], scores[t]), (t, o["top"], ranking[t])
        assert _alike(o.get("injected", []), inject[t], scores[t]), t  # left out when empty


def _alike(got: list[str], want: list[str], scores: dict[str, float]) -> bool:
    """The same tools in the same order, but for neighbours whose scores are tied within TIED."""
    return len(got) == len(want) and all(g == w or abs(scores.get(g, -1.0) - scores.get(w, 2.0)) <= TIED for g, w in zip(got, want))


def _served(cfg, texts: list[str]) -> dict[str, list[str]]:
    """`serve`: a real server (loading its own engine from the config, and what the store
    learned, before any turn is sent) and client; the tools of each turn's injects, one stream a turn."""

    async def body() -> dict[str, list[str]]:
        server = SidecarServer(cfg)
        await server.start()
        try:
            await asyncio.wait_for(server.loaded.wait(), BOUND_S)
            assert server.load_error is None, server.load_error
            await until(lambda: server.learner.last is not None, BOUND_S, "serve's first refit from the store's traffic")
            got: dict[str, list[str]] = {}
            async with await SidecarClient.connect(server.url, session="one-ranking") as sc:
                for i, t in enumerate(texts):
                    await sc.user(f"u{i}", t)
                    await sc.end(f"u{i}")
                    got[t] = []
                    while not isinstance(m := await sc.recv(60), p.Ended):
                        if isinstance(m, p.Inject):
                            got[t] += [tool.definition["name"] for tool in m.tools]
            return got
        finally:
            await server.shutdown()

    return asyncio.run(asyncio.wait_for(body(), BOUND_S))


def _proxied(toml: str, texts: list[str]) -> dict[str, list[str]]:
    """The proxy: the tools it adds to the upstream request, in order (the client sends none)."""

    async def body() -> dict[str, list[str]]:
        with Upstream([Scripted(text="Done.")]) as up:
            server = ProxyServer(config_mod.load(toml, env={}, overrides={("proxy", "upstream"): up.url}))
            try:
                await server.start()
                await until(lambda: server.app.learner.last is not None, BOUND_S, "the proxy's first refit from the store's traffic")
                client = openai.AsyncOpenAI(base_url=server.url, api_key="sk-test", max_retries=0, timeout=60)
                for t in texts:
                    done = await client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": t}])
                    assert done.choices[0].message.content == "Done."
            finally:
                await server.shutdown()
            assert len(up.chats) == len(texts)  # one upstream request a turn: nothing restarted
            return {t: req.tool_names for t, req in zip(texts, up.chats)}

    return asyncio.run(asyncio.wait_for(body(), BOUND_S))


def _found(mcp_json, toml: str, store: str, texts: list[str], limit: int = K) -> dict[str, list[str]]:
    """`sidecar mcp` over stdio, driven by the official MCP SDK: find_tool's tools, in order."""
    params = mcp.StdioServerParameters(
        command=sys.executable, cwd=str(ROOT), env={**_env(), "SIDECAR_CONFIG": toml},
        args=["-m", "sidecar", "mcp", "--config", str(mcp_json), "--model", models.SMALL_MODEL, "--store", store],
    )  # fmt: skip

    async def body() -> dict[str, list[str]]:
        async with mcp.Client(params, read_timeout_seconds=120) as client:
            got = {}
            for t in texts:
                res = await client.call_tool("find_tool", {"query": t, "limit": limit})
                assert not res.is_error, res.content
                got[t] = [tool["name"] for tool in res.structured_content["tools"]]
            return got

    return asyncio.run(asyncio.wait_for(body(), BOUND_S))


def test_find_tool_ranks_live_tools_as_the_engine_does(tmp_path, fs_server, fs_root):
    """`sidecar mcp` over the npm filesystem server and mcp-server-time: find_tool's tools, in
    order, are the engine's ranking over a catalog of what the same servers list."""
    servers = {"filesystem": fs_spec(fs_server, fs_root), "time": TIME}
    (tmp_path / "mcp.json").write_text(json.dumps({"mcpServers": servers}))
    listed = tmp_path / "listed"
    listed.mkdir()

    async def listings() -> None:
        async with ConnectionManager(mcp_config.parse({"mcpServers": servers}, "mcp.json")) as manager:
            for name in servers:
                tools = await manager.list_tools(name)
                (listed / f"{name}.json").write_text(json.dumps({"server": name, "tools": tools}))

    asyncio.run(asyncio.wait_for(listings(), BOUND_S))
    toml = _write_config(tmp_path, [str(listed)], str(tmp_path / "ref.db"))
    engine = Sidecar.open(config_mod.load(toml, env={}), progress=False)
    ranking = {t: [r.tool for r in engine.rank(Request(t), K).results] for t in LIVE_TEXTS}
    engine.close()
    assert all(len(ranking[t]) == K for t in LIVE_TEXTS), ranking
    assert {ranking[t][0].split("__")[0] for t in LIVE_TEXTS} == {"filesystem", "time"}, ranking  # both servers' tools come first somewhere
    assert len({ranking[t][0] for t in LIVE_TEXTS}) >= 3, ranking

    assert _found(tmp_path / "mcp.json", toml, str(tmp_path / "mcp.db"), LIVE_TEXTS) == ranking
