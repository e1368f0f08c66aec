"""`sidecar mcp`, driven by the official SDK's client: the sidecar runs as a real subprocess
(stdio, and once streamable HTTP on 127.0.0.1) in front of real servers: `mcp-server-time`,
the npm filesystem server, and tests/mcp_servers/dying_server.py, which dies mid-call.

find_tool uses the small embedding model; waits are bounded, never timing assertions.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys

import mcp
import pytest

from sidecar.core import models
from sidecar.mcp import config as mcp_config
from sidecar.mcp.connections import ConnectionManager
from sidecar.mcp.meta import CALL_TOOL_DEF, FIND_TOOL_DEF
from tests.conftest import CATALOGS, ROOT
from tests.mcp_support import MISSING, TIME, free_port, fs_spec, listening, run

DYING = {"command": sys.executable, "args": [str(ROOT / "tests" / "mcp_servers" / "dying_server.py")]}
FAST = {"backoff_base": 0.01, "backoff_max": 0.05, "max_connection_retries": 1, "connection_timeout": 30}
KEEP = "filesystem__list_directory"


def write_config(tmp_path, fs_server, fs_root, **servers) -> dict:
    doc = {
        "mcpServers": {"time": TIME, "filesystem": fs_spec(fs_server, fs_root), **servers},
        "sidecar": {**FAST, "keep_tools": [KEEP]},
    }
    (tmp_path / "mcp.json").write_text(json.dumps(doc))
    return doc


def sidecar_args(tmp_path, *flags: str) -> list[str]:
    return ["-m", "sidecar", "mcp", "--config", str(tmp_path / "mcp.json"), "--model", models.SMALL_MODEL,
            "--store", str(tmp_path / "sidecar.db"), *flags]  # fmt: skip


def calls_on_record(store) -> list[tuple]:
    """The raw call log, read through a connection of our own."""
    with sqlite3.connect(store) as db:
        return db.execute("SELECT server, tool, success, error IS NOT NULL, latency_ms IS NOT NULL FROM tool_calls ORDER BY id").fetchall()


def test_stdio_find_call_record_and_fall_back(tmp_path, fs_server, fs_root):
    doc = write_config(tmp_path, fs_server, fs_root, web=DYING)
    store = tmp_path / "sidecar.db"
    params = mcp.StdioServerParameters(command=sys.executable, args=sidecar_args(tmp_path), cwd=str(ROOT), env=dict(os.environ))

    async def body():
        async with mcp.Client(params, read_timeout_seconds=120) as client:
            # The agent sees the two meta-tools and the keep_tools, with their real schemas.
            listed = (await client.list_tools()).tools
            assert [t.name for t in listed] == ["find_tool", "call_tool", "get_tool_alternatives", KEEP]
            assert listed[0].input_schema == FIND_TOOL_DEF["inputSchema"] and listed[1].input_schema == CALL_TOOL_DEF["inputSchema"]
            direct = mcp_config.parse({"mcpServers": {"filesystem": doc["mcpServers"]["filesystem"]}}, "direct.json")
            async with ConnectionManager(direct) as m:
                real = next(t for t in await m.list_tools("filesystem") if t["name"] == "list_directory")
            assert listed[3].input_schema == real["inputSchema"] and listed[3].description == real["description"]

            # find_tool: the recommender's ranking, as full definitions.
            found = await client.call_tool("find_tool", {"query": "what time is it in Tokyo", "limit": 3})
            assert not found.is_error
            tools = found.structured_content["tools"]
            assert tools[0]["name"] == "time__get_current_time" and len(tools) == 3
            assert "timezone" in tools[0]["inputSchema"]["properties"] and tools[0]["description"]
            assert tools[0]["why"] and 0 < tools[0]["score"] <= 1
            assert json.loads(found.content[-1].text) == found.structured_content

            # call_tool dispatches to the live server and the call is on record at once.
            now = await client.call_tool("call_tool", {"name": "time__get_current_time", "arguments": {"timezone": "Asia/Tokyo"}})
            assert not now.is_error and "Asia/Tokyo" in now.content[0].text
            assert calls_on_record(store) == [("time", "get_current_time", 1, 0, 1)]

            # A keep_tool is called directly, proxied the same way.
            listing = await client.call_tool(KEEP, {"path": str(fs_root)})
            assert not listing.is_error and "notes.txt" in listing.content[0].text

            # A failing call (the tool's own error) comes back with fallback suggestions.
            bad = await client.call_tool(
                "call_tool", {"name": "filesystem__read_text_file", "arguments": {"path": str(fs_root / "absent.txt")}}
            )
            assert bad.is_error
            payload = bad.structured_content
            assert payload["tool"] == "filesystem__read_text_file" and "absent.txt" in payload["error"]
            suggested = payload["fallback_suggestions"]
            assert suggested and all(s["name"].startswith("filesystem__") for s in suggested)
            assert all({"description", "inputSchema", "score", "reason"} <= set(s) for s in suggested)
            assert "filesystem__read_text_file" not in [s["name"] for s in suggested]

            # Alternatives on demand: the same stand-ins, for a tool named exactly.
            alts = await client.call_tool("get_tool_alternatives", {"name": "filesystem__read_text_file"})
            assert not alts.is_error and [a["name"] for a in alts.structured_content["alternatives"]] == [s["name"] for s in suggested]
            assert (await client.call_tool("get_tool_alternatives", {"name": "read_text_file"})).is_error  # not its exact name

            # A server that dies mid-call: an error result, and the working stand-in is suggested.
            died = await client.call_tool("call_tool", {"name": "web__fetch_page", "arguments": {"url": "http://127.0.0.1/page"}})
            assert died.is_error and "unavailable" in died.structured_content["error"]
            assert "web__download_page" in [s["name"] for s in died.structured_content["fallback_suggestions"]]
            again = await client.call_tool("call_tool", {"name": "web__download_page", "arguments": {"url": "http://127.0.0.1/page"}})
            assert not again.is_error and "the page at" in again.content[0].text  # the next demand reconnected

            # Names no server lists, and bad meta-tool arguments, are errors and not calls.
            unknown = await client.call_tool("call_tool", {"name": "time__no_such_tool"})
            assert unknown.is_error and "find_tool" in unknown.structured_content["error"]
            assert (await client.call_tool("find_tool", {"query": " "})).is_error
            assert (await client.call_tool("time__convert_time", {})).is_error  # not listed: call it via call_tool

    run(body(), timeout=300)
    assert calls_on_record(store) == [
        ("time", "get_current_time", 1, 0, 1),
        ("filesystem", "list_directory", 1, 0, 1),
        ("filesystem", "read_text_file", 0, 1, 1),
        ("web", "fetch_page", 0, 1, 1),
        ("web", "download_page", 1, 0, 1),
    ]
    done = subprocess.run([sys.executable, "-m", "sidecar", "metrics", "--json", "--store", str(store), "--server", "web"],
                          check=True, capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    web = {t["tool"]: t for t in json.loads(done.stdout)["tools"]}
    assert web["fetch_page"]["failure_count"] == 1 and "unavailable" in web["fetch_page"]["last_error"]
    assert web["download_page"]["success_count"] == 1 and web["download_page"]["avg_latency_ms"] is not None


def test_a_failed_call_is_answered_by_a_fallback_that_takes_its_arguments_when_asked(tmp_path, fs_server, fs_root):
    """auto_retry_fallback: the dying server's fetch_page fails mid-call; download_page takes the
    same arguments and answers, and the result says so. Both calls are on record."""
    doc = write_config(tmp_path, fs_server, fs_root, web=DYING)
    doc["sidecar"]["auto_retry_fallback"] = True
    (tmp_path / "mcp.json").write_text(json.dumps(doc))
    params = mcp.StdioServerParameters(command=sys.executable, args=sidecar_args(tmp_path), cwd=str(ROOT), env=dict(os.environ))

    async def body():
        async with mcp.Client(params, read_timeout_seconds=120) as client:
            got = await client.call_tool("call_tool", {"name": "web__fetch_page", "arguments": {"url": "http://127.0.0.1/page"}})
            assert not got.is_error, got
            assert got.content[0].text.startswith("web__fetch_page failed") and "web__download_page answered instead" in got.content[0].text
            assert "the page at" in got.content[1].text
            missing = await client.call_tool("call_tool", {"name": "filesystem__read_text_file", "arguments": {"path": str(fs_root / "absent.txt")}})
            assert missing.is_error  # its stand-ins fail alike: the first failure is what comes back, with them
            assert missing.structured_content["tool"] == "filesystem__read_text_file"

    run(body(), timeout=300)
    rows = calls_on_record(tmp_path / "sidecar.db")
    assert rows[:2] == [("web", "fetch_page", 0, 1, 1), ("web", "download_page", 1, 0, 1)]


def test_streamable_http_on_loopback(tmp_path, fs_server, fs_root):
    write_config(tmp_path, fs_server, fs_root)
    port = free_port()
    log = tmp_path / "sidecar-http.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, *sidecar_args(tmp_path, "--http", "--port", str(port))],
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)  # fmt: skip

    async def body():
        await listening(port, proc, log, timeout=60)
        async with mcp.Client(f"http://127.0.0.1:{port}/mcp", read_timeout_seconds=120) as client:
            assert [t.name for t in (await client.list_tools()).tools] == ["find_tool", "call_tool", "get_tool_alternatives", KEEP]
            now = await client.call_tool("call_tool", {"name": "time__get_current_time", "arguments": {"timezone": "UTC"}})
            assert not now.is_error and "UTC" in now.content[0].text

    try:
        run(body(), timeout=180)
    finally:
        proc.terminate()
        code = proc.wait(30)
    assert code == 0, log.read_text()
    assert f"http://127.0.0.1:{port}/mcp" in log.read_text()
    assert calls_on_record(tmp_path / "sidecar.db") == [("time", "get_current_time", 1, 0, 1)]


def savings(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "sidecar", "mcp", "--savings", "--json", *args],
                          check=False, capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_savings_of_live_servers(tmp_path, fs_server, fs_root):
    write_config(tmp_path, fs_server, fs_root)
    s = savings("--config", str(tmp_path / "mcp.json"))
    assert "cl100k_base" in s["tokenizer"] and s["sources"] == ["time", "filesystem"] and s["unreachable"] == {}
    assert s["all_tools"]["tools"] == 16 and s["exposed"]["tools"] == 4  # 2 + 14 tools vs find_tool, call_tool, get_tool_alternatives, 1 kept
    assert s["meta_tools_tokens"] < s["exposed"]["tokens"] < s["all_tools"]["tokens"]
    assert s["saved_tokens"] == s["all_tools"]["tokens"] - s["exposed"]["tokens"] > 0
    for side in (s["all_tools"], s["exposed"]):
        assert 2 < side["bytes"] / side["tokens"] < 8  # a BPE count of JSON, not a byte or word count
    assert s["find_tool_answer_tokens"] == pytest.approx(s["mean_tool_tokens"] * 5, abs=1)


def test_savings_of_a_catalog_file_without_servers():
    s = savings("--catalog", str(CATALOGS / "ALL.json"))
    assert s["all_tools"]["tools"] == 605 and s["exposed"]["tools"] == 3
    assert s["exposed"]["tokens"] == s["meta_tools_tokens"] and s["saved_fraction"] > 0.99
    assert s["break_even_find_calls"] > 1


def test_the_savings_line_of_a_find_tool_answer_adds_up():
    """`one find_tool answer: ~N tokens (n x mean ...)`: n x mean is N, and n is find_tool's
    limit, or every tool when a catalog has fewer (issue 52: 2 tools printed "529 (5 x 264)")."""
    for name in ("time.json", "notes.json"):
        done = subprocess.run([sys.executable, "-m", "sidecar", "mcp", "--savings", "--catalog", str(CATALOGS / name)],
                              check=False, capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip
        assert done.returncode == 0, done.stderr
        line = next(ln for ln in done.stdout.splitlines() if ln.startswith("one find_tool answer:"))
        total, n, mean = re.search(r"~\s*([\d,]+) tokens\s+\((\d+) x ([\d.]+), the mean schema", line).groups()
        assert round(int(n) * float(mean)) == int(total.replace(",", "")), line
        figures = savings("--catalog", str(CATALOGS / name))
        assert int(n) == min(figures["find_tool_limit"], figures["all_tools"]["tools"]) == figures["find_tool_answer_tools"], line
        assert figures["find_tool_answer_tokens"] == int(total.replace(",", ""))


def test_savings_name_the_servers_they_could_not_count(tmp_path):
    (tmp_path / "mcp.json").write_text(json.dumps({"mcpServers": {"gone": {"command": MISSING}}, "sidecar": FAST}))
    s = savings("--config", str(tmp_path / "mcp.json"), "--catalog", str(CATALOGS / "time.json"))
    assert "command not found" in s["unreachable"]["gone"] and s["all_tools"]["tools"] == 2


def test_without_a_model_find_tool_says_so_and_call_tool_still_works(tmp_path):
    (tmp_path / "mcp.json").write_text(json.dumps({"mcpServers": {"time": TIME}, "sidecar": FAST}))
    args = ["-m", "sidecar", "mcp", "--config", str(tmp_path / "mcp.json"), "--model", str(tmp_path / "absent.gguf"),
            "--store", str(tmp_path / "sidecar.db")]  # fmt: skip
    params = mcp.StdioServerParameters(command=sys.executable, args=args, cwd=str(ROOT), env=dict(os.environ))

    async def body():
        async with mcp.Client(params, read_timeout_seconds=120) as client:
            assert [t.name for t in (await client.list_tools()).tools] == ["find_tool", "call_tool", "get_tool_alternatives"]
            found = await client.call_tool("find_tool", {"query": "what time is it"})
            assert found.is_error and "the tool index is not available" in found.structured_content["error"]
            assert "absent.gguf" in found.structured_content["error"]
            now = await client.call_tool("call_tool", {"name": "time__get_current_time", "arguments": {"timezone": "UTC"}})
            assert not now.is_error
            failed = await client.call_tool("call_tool", {"name": "time__get_current_time", "arguments": {"timezone": "Nowhere/City"}})
            assert failed.is_error and failed.structured_content["fallback_suggestions"] == []

    run(body())
    assert calls_on_record(tmp_path / "sidecar.db") == [("time", "get_current_time", 1, 0, 1), ("time", "get_current_time", 0, 1, 1)]


def test_mcp_needs_a_config(tmp_path):
    done = subprocess.run([sys.executable, "-m", "sidecar", "mcp"], check=False, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2 and "--config" in done.stderr


@pytest.mark.parametrize(
    "keep, message",
    [
        (["get_current_time"], "give it as server__tool"),
        (["clock__now"], "whose server 'clock' is not in mcpServers"),
        (["off__tool"], "whose server 'off' is disabled"),
    ],
)
def test_keep_tools_must_name_a_configured_server(keep, message):
    doc = {"mcpServers": {"time": TIME, "off": {"command": "x", "disabled": True}}, "sidecar": {"keep_tools": keep}}
    with pytest.raises(mcp_config.McpConfigError, match=message):
        mcp_config.parse(doc, "mcp.json")
