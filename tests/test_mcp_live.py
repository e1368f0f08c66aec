"""Live catalogs against real MCP servers over stdio: `mcp-server-time` (PyPI, the test
extra), `@modelcontextprotocol/server-filesystem` (npm, installed here into the pytest
cache), and tests/mcp_servers/changing_server.py, a small server written with the SDK
whose tool list changes. Plus the pure parts: config, backoff, breaker, diffs.

Backoffs are shrunk in the tests; waits are bounded polls, never timing assertions.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from sidecar.core import catalog as catalog_mod
from sidecar import config as config_mod
from sidecar.core import models, pipeline
from sidecar.core.catalog import Catalog
from sidecar.mcp import config as mcp_config
from sidecar.mcp.connections import ConnectionManager, ServerUnavailable
from sidecar.mcp.live import LiveCatalog, build_catalog
from sidecar.mcp.state import Breaker, State, backoff_delays, diff, schema_hash
from sidecar.core.pipeline import Request
from sidecar.store import open_store
from tests.conftest import CATALOGS, ROOT
from tests.mcp_support import MISSING, TIME, free_port, fs_spec, listening, run, until

CHANGER = ROOT / "tests" / "mcp_servers" / "changing_server.py"
FAST = {"backoff_base": 0.01, "backoff_max": 0.05, "max_connection_retries": 2, "connection_timeout": 20}


def cfg(servers: dict, **options) -> mcp_config.McpConfig:
    return mcp_config.parse({"mcpServers": servers, "sidecar": {**FAST, **options}}, "test.json")


def changer_spec(protocol: str = "auto", pages: int = 0) -> dict:
    return {"command": sys.executable, "args": [str(CHANGER), "--pages", str(pages)], "protocol": protocol}


def child_pids(marker: str) -> list[int]:
    """Our child processes whose command line contains `marker` (Linux /proc)."""
    out = []
    for d in pathlib.Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and marker in cmdline:
            out.append(int(d.name))
    return out


# ---- pure parts ------------------------------------------------------------------------


def test_backoff_schedule_doubles_up_to_the_cap():
    assert backoff_delays(5) == [1, 2, 4, 8, 16]
    assert backoff_delays(3) == [1, 2, 4]
    assert backoff_delays(7) == [1, 2, 4, 8, 16, 16, 16]
    assert backoff_delays(0) == []
    assert backoff_delays(3, base=0.5, cap=1) == [0.5, 1, 1]


def test_breaker_opens_fails_fast_then_allows_one_trial():
    b = Breaker(retries=3, reset_after=60)
    assert b.state == State.CONFIGURED and b.allow(0)
    assert b.plan(0) == [1, 2, 4] and b.state == State.CONNECTING
    assert b.failed(10, "boom") == 60
    assert b.state == State.FAILED and b.last_error == "boom"
    assert not b.allow(69.9)  # open: fail fast
    with pytest.raises(RuntimeError):
        b.plan(30)
    assert b.allow(70)
    assert b.plan(70) == []  # half-open: one trial, no retries
    assert b.failed(71, "again") == 120  # the window doubles
    assert not b.allow(190) and b.allow(191)
    b.plan(191)
    b.succeeded()
    assert b.state == State.CONNECTED and b.last_error is None and b.allow(191)
    assert b.plan(200) == [1, 2, 4]  # closed again: full cycles
    b.succeeded()
    b.lost("connection lost")
    assert b.state == State.FAILED and b.allow(200)  # a lost connection is retried on demand


def test_schema_hash_and_diff():
    a = {"name": "t", "description": "d", "inputSchema": {"type": "object", "properties": {"x": {}, "y": {}}}}
    reordered = {"inputSchema": {"properties": {"y": {}, "x": {}}, "type": "object"}, "description": "d", "name": "t"}
    assert schema_hash(a) == schema_hash(reordered)
    assert schema_hash(a) == schema_hash({**a, "annotations": {"readOnlyHint": True}})  # not part of the hash
    assert schema_hash(a) != schema_hash({**a, "description": "e"})
    d = diff({"a": "1", "b": "2", "c": "3"}, {"b": "2", "c": "x", "d": "4"})
    assert (d.added, d.updated, d.removed, d.unchanged) == (["d"], ["c"], ["a"], ["b"])
    assert d.changed and d.counts() == "1 added, 1 updated, 1 removed, 1 unchanged"
    assert not diff({"a": "1"}, {"a": "1"}).changed


def test_config_reads_the_standard_file(tmp_path):
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({
        "mcpServers": {
            "fs": {"command": "npx", "args": ["-y", "x"], "env": {"A": "1"}, "cwd": "sub", "autoApprove": ["read_file"]},
            "remote": {"url": "https://example.com/mcp", "headers": {"Authorization": "Bearer t"}},
            "old": {"type": "sse", "url": "http://127.0.0.1:9/sse"},
            "off": {"command": "x", "disabled": True},
        },
        "globalShortcut": "Ctrl+Space",
        "sidecar": {"preconnect_servers": ["fs"], "max_connection_retries": 5},
    }))  # fmt: skip
    c = mcp_config.load(path)
    assert list(c.servers) == ["fs", "remote", "old"] and c.disabled == ["off"]
    assert [s.transport for s in c.servers.values()] == ["stdio", "http", "sse"]
    assert c.servers["fs"].env == {"A": "1"} and c.servers["fs"].cwd == str(tmp_path / "sub")
    assert c.options.preconnect_servers == ["fs"] and c.options.max_connection_retries == 5
    assert c.options.connection_timeout == 30 and mcp_config.Options().max_connection_retries == 3


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"servers": {}}, 'expected {"mcpServers"'),
        ({"mcpServers": {"a": {"command": "x", "url": "http://h"}}}, "server 'a': has both"),
        ({"mcpServers": {"a": {"args": []}}}, "server 'a': needs \"command\""),
        ({"mcpServers": {"a": {"command": "x", "args": "not a list"}}}, "server 'a': Expected `array`"),
        ({"mcpServers": {"a": {"url": "ftp://h"}}}, "server 'a': \"url\" must be"),
        ({"mcpServers": {"a__b": {"command": "x"}}}, "server 'a__b': name must not contain"),
        ({"mcpServers": {"a": {"command": "x", "protocol": "1999"}}}, "server 'a': \"protocol\" must be"),
        ({"mcpServers": {"a": {"command": "x"}}, "sidecar": {"preconnect_servers": ["b"]}}, "names 'b', which is not in mcpServers"),
        ({"mcpServers": {}, "sidecar": {"connection_timeout": 0}}, "connection_timeout=0.0 must be positive"),
        ({"mcpServers": {}, "sidecar": {"retries": 1}}, "unknown field `retries`"),
    ],
)
def test_config_errors_name_the_file_and_server(tmp_path, doc, message):
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(mcp_config.McpConfigError) as e:
        mcp_config.load(path)
    assert str(e.value).startswith(str(path)) and message in str(e.value), str(e.value)


def test_config_file_errors(tmp_path):
    with pytest.raises(mcp_config.McpConfigError, match="cannot read"):
        mcp_config.load(tmp_path / "absent.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(mcp_config.McpConfigError, match="not valid JSON"):
        mcp_config.load(tmp_path / "bad.json")


def test_build_catalog_names_tools_server__tool():
    base = catalog_mod.load([CATALOGS / "notes.json"])
    live = {
        "time": [{"name": "get_current_time", "description": "Now.", "inputSchema": {"type": "object"}, "execution": {}}],
        "broken": [{"description": "no name"}, {"name": "ok"}],
    }
    cat = build_catalog(live, base)
    assert cat.names()[: len(base)] == base.names()
    t = cat.get("time__get_current_time")
    assert t is not None and t.server == "time" and t.bare_name == "get_current_time"
    assert cat.get("broken__ok") is not None and len(cat) == len(base) + 2  # the nameless tool is skipped
    assert "mcp:time" in cat.sources


# ---- real servers ------------------------------------------------------------------------


def test_lazy_connection_lists_and_calls_real_servers(fs_server, fs_root):
    c = cfg({"time": TIME, "filesystem": fs_spec(fs_server, fs_root)})

    async def body():
        async with ConnectionManager(c) as m:
            assert [s.state for s in m.status()] == ["configured", "configured"]  # nothing started yet
            tools = await m.list_tools("filesystem")
            assert m.state("filesystem") == State.CONNECTED and m.state("time") == State.CONFIGURED
            names = [t["name"] for t in tools]
            expected = [t["name"] for t in json.loads((CATALOGS / "filesystem.json").read_text())["tools"]]
            assert sorted(names) == sorted(expected)
            assert all("inputSchema" in t and t["description"] for t in tools)
            result = await m.call("filesystem", "read_text_file", {"path": str(fs_root / "notes.txt")})
            assert not result.is_error and "three nodes" in result.content[0].text

            result = await m.call("time", "get_current_time", {"timezone": "UTC"})
            assert not result.is_error and "UTC" in result.content[0].text
            assert sorted(t["name"] for t in await m.list_tools("time")) == ["convert_time", "get_current_time"]

            status = {s.name: s for s in m.status()}
            assert status["filesystem"].tools == 14 and status["time"].tools == 2
            assert status["time"].connected_at.endswith("Z") and status["time"].last_error is None
            assert status["time"].tools_changed_at is not None
            assert m.unavailable() == frozenset()
        assert child_pids(str(fs_server)) == []  # closing stopped the servers

    run(body())


def test_pagination_is_followed():
    c = cfg({"paged": changer_spec(pages=1)})

    async def body():
        async with ConnectionManager(c) as m:
            names = [t["name"] for t in await m.list_tools("paged")]
            assert names == ["add", "echo", "grow", "pid"]  # four pages of one

    run(body())


def test_streamable_http_server_by_url(tmp_path):
    port = free_port()
    log_file = (tmp_path / "http-server.log").open("w")
    proc = subprocess.Popen([sys.executable, str(CHANGER), "--http", str(port)], stdout=log_file, stderr=subprocess.STDOUT)
    c = cfg({"remote": {"url": f"http://127.0.0.1:{port}/mcp"}})

    async def body():
        await listening(port, proc, tmp_path / "http-server.log")
        async with ConnectionManager(c) as m:
            await m.ensure("remote")
            assert m.state("remote") == State.CONNECTED and m.status()[0].transport == "http"
            assert [t["name"] for t in await m.list_tools("remote")] == ["add", "echo", "grow", "pid"]
            assert (await m.call("remote", "add", {"a": 2, "b": 3})).structured_content == {"result": 5}

    try:
        run(body())
    finally:
        proc.terminate()
        proc.wait(10)
        log_file.close()


def test_preconnect_servers_connect_in_the_background():
    c = cfg({"time": TIME, "changer": changer_spec()}, preconnect_servers=["time"])

    async def body():
        async with ConnectionManager(c) as m:
            await until(lambda: m.state("time") == State.CONNECTED, what="time to preconnect")
            assert m.state("changer") == State.CONFIGURED

    run(body())


def test_failing_command_backs_off_then_the_circuit_fails_fast(tmp_path, caplog):
    starts = tmp_path / "starts"
    dies = {"command": sys.executable, "args": ["-c", f"import sys; open({str(starts)!r}, 'a').write('x'); print('boom: no config', file=sys.stderr); sys.exit(3)"]}
    c = cfg({"missing": {"command": MISSING}, "dies": dies}, max_connection_retries=2, circuit_reset=60)
    now = [1000.0]

    async def body():
        async with ConnectionManager(c, clock=lambda: now[0]) as m:
            with caplog.at_level(logging.INFO, logger="sidecar.mcp"):
                with pytest.raises(ServerUnavailable, match="command not found"):
                    await m.ensure("missing")
                with pytest.raises(ServerUnavailable) as e:
                    await m.call("dies", "anything")
            assert "boom: no config" in str(e.value) and e.value.retry_in == 60
            assert starts.read_text() == "xxx"  # one attempt + 2 retries
            logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dies:")]
            assert [m_.split(" failed")[0] for m_ in logged[:2]] == ["dies: attempt 1", "dies: attempt 2"]
            assert "cannot connect after 3 attempt(s)" in logged[-1]

            status = {s.name: s for s in m.status()}
            assert status["dies"].state == "failed" and "boom" in status["dies"].last_error
            assert status["missing"].state == "failed" and MISSING in status["missing"].last_error
            assert m.unavailable() == {"missing", "dies"}

            # Open circuit: fails fast, nothing is started.
            with pytest.raises(ServerUnavailable, match="failing fast"):
                await m.list_tools("dies")
            assert starts.read_text() == "xxx"
            # After the reset window: one trial attempt (no retries), then open for twice as long.
            now[0] += 61
            with pytest.raises(ServerUnavailable) as e:
                await m.ensure("dies")
            assert starts.read_text() == "xxxx" and e.value.retry_in == 120

    run(body())


def test_a_server_killed_mid_session_does_not_take_the_manager_down(fs_server, fs_root):
    c = cfg({"filesystem": fs_spec(fs_server, fs_root), "time": TIME})

    async def body():
        async with ConnectionManager(c) as m:
            await m.connect_all()
            (pid,) = child_pids(str(fs_server))
            os.kill(pid, signal.SIGKILL)
            await until(lambda: m.state("filesystem") == State.FAILED, what="the lost connection to be noticed")
            status = {s.name: s for s in m.status()}
            assert "connection lost" in status["filesystem"].last_error
            assert status["filesystem"].tools == 14  # the last listing is kept for the index
            assert m.unavailable() == {"filesystem"}
            # The other server is untouched.
            assert not (await m.call("time", "get_current_time", {"timezone": "UTC"})).is_error
            # The next demand reconnects.
            result = await m.call("filesystem", "list_directory", {"path": str(fs_root)})
            assert "notes.txt" in result.content[0].text and m.state("filesystem") == State.CONNECTED
            assert child_pids(str(fs_server)) not in ([], [pid])
            assert m.unavailable() == frozenset()

    run(body())


def test_a_preconnected_server_that_dies_is_reconnected_in_the_background():
    c = cfg({"changer": changer_spec()}, preconnect_servers=["changer"])

    async def body():
        async with ConnectionManager(c) as m:
            await until(lambda: m.state("changer") == State.CONNECTED, what="preconnect")
            pid = (await m.call("changer", "pid")).structured_content["result"]
            os.kill(pid, signal.SIGKILL)
            await until(lambda: m.state("changer") != State.CONNECTED, what="the loss to be noticed")
            await until(lambda: m.state("changer") == State.CONNECTED, what="the background reconnect")
            assert (await m.call("changer", "pid")).structured_content["result"] != pid

    run(body())


# ---- live catalog -> pipeline ---------------------------------------------------------


def _pipeline(store_path) -> pipeline.Pipeline:
    cfg_ = config_mod.load(env={}, overrides={("model", "name"): models.SMALL_MODEL})
    return pipeline.from_config(cfg_, catalog=Catalog([]), store=open_store(store_path), progress=False)


# list_changed via subscriptions/listen | a plain notification; a change's texts embedded first
# on the model's second context (the server's default), so the model thread's reindex embeds none
@pytest.mark.parametrize("protocol, beside", [("auto", False), ("legacy", False), ("auto", True)])
def test_live_catalog_reindexes_only_what_changed(tmp_path, caplog, protocol, beside):
    from concurrent.futures import ThreadPoolExecutor

    pipe = _pipeline(tmp_path / "sidecar.db")
    c = cfg({"changer": changer_spec(protocol), "time": TIME})

    async def body():
        async with ConnectionManager(c) as m:
            live = LiveCatalog(m, pipe, indexer=ThreadPoolExecutor(1) if beside else None)
            with caplog.at_level(logging.INFO, logger="sidecar.mcp"):
                await m.connect_all()
                await until(lambda: len(pipe.catalog) == 6, what="both servers indexed")
                await live.settled()
            names = set(pipe.catalog.names())
            assert names == {"changer__add", "changer__echo", "changer__grow", "changer__pid", "time__get_current_time", "time__convert_time"}
            assert pipe.catalog.get("time__convert_time").server == "time"
            assert sum(s.added for s in live.history) == 6
            before = dict(pipe.index_for("user").entries)
            runs = len(live.history)

            assert (await live.call("changer__grow")).content[0].text == "grown"
            with caplog.at_level(logging.INFO, logger="sidecar.mcp"):
                await until(lambda: "changer__multiply" in pipe.catalog.names(), what="list_changed to reach the index")
                await live.settled()
            s = live.history[-1]
            assert len(live.history) == runs + 1
            assert (s.added, s.updated, s.removed, s.unchanged, s.tools) == (1, 1, 1, 4, 6)
            assert s.embedded + s.cached > 0
            assert (s.embedded == 0) == beside, s  # beside: the new texts were in the store already
            after = pipe.index_for("user").entries
            for name in ("changer__grow", "changer__pid", "time__get_current_time", "time__convert_time"):
                assert after[name] is before[name]  # reused, not re-embedded
            assert after["changer__echo"] is not before["changer__echo"] and "changer__add" not in after
            assert "shouting" in pipe.catalog.get("changer__echo").description
            assert pipe.rank_batch([Request("multiply two numbers")])[0][0].tool == "changer__multiply"
            logged = [r.getMessage() for r in caplog.records]
            assert any("live catalog: 6 tools from 2 server(s): 1 added, 1 updated, 1 removed, 4 unchanged" in x for x in logged), logged
            assert any(x.startswith("changer: tools/list: 4 tools (1 added, 1 updated, 1 removed, 2 unchanged)") for x in logged)
            live.close()

    run(body())


# ---- CLI ---------------------------------------------------------------------------------


def test_servers_cli_json_end_to_end(tmp_path, fs_server, fs_root):
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({
        "mcpServers": {"time": TIME, "filesystem": fs_spec(fs_server, fs_root), "missing": {"command": MISSING}},
        "sidecar": {**FAST, "preconnect_servers": ["time"]},
    }))  # fmt: skip

    def servers(*flags: str) -> dict:
        done = subprocess.run([sys.executable, "-m", "sidecar", "servers", "--config", str(path), *flags],
                              check=False, capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return {s["name"]: s for s in json.loads(done.stdout)["servers"]}

    lazy = servers("--json")
    assert {n: s["state"] for n, s in lazy.items()} == {"time": "connected", "filesystem": "configured", "missing": "configured"}
    assert lazy["filesystem"]["tools"] is None and lazy["time"]["tools"] == 2

    every = servers("--connect", "--json")
    assert {n: (s["state"], s["tools"]) for n, s in every.items()} == {
        "time": ("connected", 2), "filesystem": ("connected", 14), "missing": ("failed", None)}  # fmt: skip
    for s in every.values():
        assert {"name", "state", "tools", "connected_at", "last_error"} <= set(s)
    assert every["filesystem"]["connected_at"] and every["filesystem"]["last_error"] is None
    assert "command not found" in every["missing"]["last_error"] and every["missing"]["connected_at"] is None

    done = subprocess.run([sys.executable, "-m", "sidecar", "servers", "--mcp-config", str(path)],
                          check=False, capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0 and "time" in done.stdout and "configured" in done.stdout

    path.write_text(json.dumps({"mcpServers": {"a": {"command": "x", "url": "http://h"}}}))
    done = subprocess.run([sys.executable, "-m", "sidecar", "servers", "--config", str(path)], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and f"{path}: server 'a': has both" in done.stderr
