"""`sidecar serve --mcp-config`: live MCP servers' tools in the streaming path, end to end.

Real servers over stdio (`mcp-server-time`, the npm filesystem server, and
tests/mcp_servers/changing_server.py, whose tool list changes), the small real model, a real
SQLite file, a real `sidecar serve` process or an in-process SidecarServer on 127.0.0.1, and
real websocket clients. Waits are bounded polls; nothing asserts on time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading

from sidecar import config as config_mod
from sidecar.core import models
from sidecar import protocol as p
from sidecar.client import SidecarClient, tokens
from sidecar.mcp import config as mcp_config
from sidecar.mcp.state import State
from sidecar.core.pipeline import Pipeline
from sidecar.serve.server import SidecarServer
from tests.conftest import CATALOGS, ROOT
from tests.mcp_support import MISSING, TIME, free_port, fs_spec, listening, run, until
from tests.test_mcp_live import CHANGER, FAST, child_pids

SMALL = models.SMALL_MODEL
WAIT_S = 60  # for one expected message
TIME_TEXT = "Let me check the current time in Tokyo for you."
MULTIPLY_TEXT = "Let me compute the product of two integers with multiply."


async def stream(sc: SidecarClient, stream_id: str, text: str) -> list[p.ServerMessage]:
    """Stream `text` token by token, end the stream, and return what came until `ended`."""
    for tok in tokens(text):
        await sc.token(stream_id, tok)
    await sc.end(stream_id)
    out: list[p.ServerMessage] = []
    while not (out and isinstance(out[-1], p.Ended) and out[-1].stream == stream_id):
        out.append(await sc.recv(WAIT_S))
    assert not [m for m in out if isinstance(m, p.Error)], out
    return out


def injected(msgs: list[p.ServerMessage]) -> dict[str, dict]:
    """The injected tools' definitions, by name."""
    return {t.definition["name"]: t.definition for m in msgs if isinstance(m, p.Inject) for t in m.tools}


def fired(msgs: list[p.ServerMessage]) -> list[str | None]:
    return [m.tool for m in msgs if isinstance(m, p.DecisionReport) and m.fired]


def processes_with(marker: str) -> list[int]:
    """Every process whose command line contains `marker` (Linux /proc)."""
    out = []
    for d in pathlib.Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                if marker in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    out.append(int(d.name))
    return out


@contextlib.asynccontextmanager
async def serving(tmp_path: pathlib.Path, servers: dict, gate_bar: float | None = None):
    """An in-process SidecarServer on 127.0.0.1 over the live `servers`, loaded; `gate_bar`:
    the high-pattern and confirm thresholds, when a test is about what reaches a session, not
    about where the calibration puts its bar."""
    overrides = {("model", "name"): SMALL, ("store",): str(tmp_path / "sidecar.db"), ("server", "port"): 0}
    if gate_bar is not None:
        overrides |= {("gate", "high"): gate_bar, ("gate", "confirm"): gate_bar}
    cfg = config_mod.load(env={}, overrides=overrides)
    live = mcp_config.parse({"mcpServers": servers, "sidecar": FAST}, "test.json")
    server = SidecarServer(cfg, mcp=live)
    await server.start()
    try:
        await asyncio.wait_for(server.loaded.wait(), 120)
        assert server.load_error is None, server.load_error
        yield server
    finally:
        await server.shutdown()


def test_serve_process_injects_live_definitions_merged_with_a_catalog(tmp_path, fs_server, fs_root):
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({
        "mcpServers": {"time": TIME, "filesystem": fs_spec(fs_server, fs_root), "missing": {"command": MISSING}},
        "sidecar": FAST,
    }))  # fmt: skip
    port = free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "sidecar", "serve", "--mcp-config", str(config), "--catalog", str(CATALOGS / "notes.json"),
           "--model", SMALL, "--store", str(tmp_path / "sidecar.db"), "--port", str(port)]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "SIDECAR_CONFIG": ""})
    try:

        async def body():
            await listening(port, proc, log, timeout=120)
            async with await SidecarClient.connect(f"ws://127.0.0.1:{port}", session="live", decisions=True, wait_s=120) as sc:
                tools = set(sc.ready.tools)
                assert {"semantic_search", "time__get_current_time", "time__convert_time", "filesystem__read_text_file"} <= tools
                assert not any(t.startswith("missing__") for t in tools)
                got = injected(await stream(sc, "r1", TIME_TEXT))
                assert "time__get_current_time" in got, got
                schema = got["time__get_current_time"]["inputSchema"]
                assert schema["required"] == ["timezone"] and "IANA timezone" in schema["properties"]["timezone"]["description"]
                got = injected(await stream(sc, "r2", f"Let me read the file {fs_root / 'notes.txt'} to see what it says."))
                read = [n for n in got if n.startswith("filesystem__read")]
                assert read and "path" in got[read[0]]["inputSchema"]["properties"], got
                got = injected(await stream(sc, "r3", "Let me search my notes for the kubernetes setup."))
                assert "semantic_search" in got, got  # the --catalog file's tools are served beside the live ones

        run(body(), timeout=300)
        assert processes_with(str(fs_root)), "the filesystem server runs while serving"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log.read_text()
    assert "missing: not indexed" in text and "command not found" in text, text
    catalog = CATALOGS / "notes.json"  # the start-up line names where the tools came from
    assert f" tools from {catalog} and MCP servers time, filesystem, missing (2 of 3 connected), store {tmp_path / 'sidecar.db'}, " in text, text
    assert processes_with(str(fs_root)) == []  # shutting down stopped the stdio servers


def test_a_tool_added_by_list_changed_reaches_a_session_started_before(tmp_path):
    servers = {"changer": {"command": sys.executable, "args": [str(CHANGER)]}, "time": TIME}

    async def body():
        # MiniLM's built-in bar (0.83) sits over this text (0.69-0.71): arithmetic reads
        # to its gate head as something a model does itself.
        async with serving(tmp_path, servers, gate_bar=0.5) as server:
            pipe = server.engine.pipeline
            threads: list[str] = []  # where the engine's own pipeline is reindexed
            beside: list[str] = []  # where the copy that embeds the change first is built
            reindex = Pipeline.reindex

            def recorded(self, *args, **kwargs):  # a spy on the real reindex: which thread runs it
                (threads if self is pipe else beside).append(threading.current_thread().name)
                return reindex(self, *args, **kwargs)

            async with await SidecarClient.connect(server.url, session="before", decisions=True) as sc:
                assert "changer__multiply" not in sc.ready.tools
                assert "changer__multiply" not in injected(await stream(sc, "r1", MULTIPLY_TEXT))

                Pipeline.reindex = recorded
                try:
                    assert (await server.live.call("changer__grow")).content[0].text == "grown"
                    await until(lambda: "changer__multiply" in server.engine.catalog.names(), what="list_changed to be indexed")
                    await server.live.settled()
                finally:
                    Pipeline.reindex = reindex
                assert threads and set(threads) == {"sidecar-model_0"}, threads
                assert beside and set(beside) == {"sidecar-index_0"}, beside  # the new tools' texts were embedded there first
                assert server.live.history[-1].embedded == 0  # ... so the model thread embedded none

                got = injected(await stream(sc, "r2", MULTIPLY_TEXT))
                assert "changer__multiply" in got, got
                assert got["changer__multiply"]["description"] == "Multiply two integers and return the product."
                assert set(got["changer__multiply"]["inputSchema"]["properties"]) == {"a", "b"}
                assert "changer__add" not in server.engine.catalog.names()  # removed by the change

    run(body(), timeout=300)


def test_a_killed_servers_tools_are_withheld_until_it_is_back(tmp_path):
    servers = {"changer": {"command": sys.executable, "args": [str(CHANGER)]}, "time": TIME}

    async def body():
        async with serving(tmp_path, servers) as server:
            manager = server.live.manager
            async with await SidecarClient.connect(server.url, session="kill", decisions=True) as sc:
                assert "time__get_current_time" in injected(await stream(sc, "up", TIME_TEXT))

                (pid,) = child_pids("mcp_server_time")
                os.kill(pid, signal.SIGKILL)
                await until(lambda: manager.state("time") == State.FAILED, what="the lost connection to be noticed")
                assert server.live.unavailable() == {"time"}

                msgs = await stream(sc, "down", TIME_TEXT)
                assert fired(msgs) == ["time__get_current_time"], msgs  # the gate still asks for the time tool...
                assert injected(msgs) == {}, msgs  # ...which is withheld, and no unrelated tool is promoted instead

                # Judging while it was down was the demand that reconnects it (backoff, breaker).
                await until(lambda: manager.state("time") == State.CONNECTED, timeout=60, what="the lazy reconnect")
                assert child_pids("mcp_server_time") not in ([], [pid])
                assert "time__get_current_time" in injected(await stream(sc, "back", TIME_TEXT))

    run(body(), timeout=300)
