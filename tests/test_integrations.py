"""docs/integrations.md's recipes that can run here, run as written.

The ```python block after `<!-- recipe: NAME -->` is saved as a script and run with the SDK's
environment (`OPENAI_BASE_URL`, `ANTHROPIC_BASE_URL` and the key) pointed at a real `sidecar
proxy` on 127.0.0.1, in front of the scripted upstream of tests/openai_upstream.py, with the real
`mcp-server-time` behind it and the small model: the proxy and upstream tests/test_proxy_messages.py
starts. The script must print the answer the upstream gave only after the proxy ran the time tool,
and the upstream must have received the tool and the time server's real result.

LiteLLM, Open WebUI, LibreChat and the Vercel AI SDK are not installed here: their recipes are
config lines checked against their docs (the doc says so); only their `sidecar` command lines are
checked, against the CLI's parser.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import sys

import pytest

from sidecar import cli
from tests.conftest import ROOT
from tests.mcp_support import run
from tests.openai_upstream import Scripted
from tests.test_proxy import GET_TIME, tool_messages
from tests.test_proxy_messages import behind, results_of

DOC = ROOT / "docs" / "integrations.md"
KEY = "sk-recipe-key-5b1e"
ANSWER = "It is noon in Tokyo."


def recipe(name: str) -> str:
    """The ```python block marked `<!-- recipe: NAME -->` in docs/integrations.md."""
    found = re.findall(rf"<!-- recipe: {name} -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(found) == 1, f"docs/integrations.md: expected one ```python block after <!-- recipe: {name} -->, found {len(found)}"
    return found[0]


async def run_script(path, code: str, **env: str) -> str:
    """`python path` with `env` added; its stdout (it must exit 0)."""
    path.write_text(code)
    proc = await asyncio.create_subprocess_exec(sys.executable, str(path), env={**os.environ, **env},
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, f"{path.name} exited {proc.returncode}:\n{err.decode()}"
    return out.decode()


def tool_then_answer() -> list[Scripted]:
    """The model calls the time tool the proxy added, then answers from its result."""
    return [Scripted(calls=[(GET_TIME, {"timezone": "Asia/Tokyo"})]), Scripted(text=ANSWER)]


def test_the_openai_recipe_runs_as_written(tmp_path):
    async def body():
        async with behind(tmp_path, tool_then_answer()) as (up, server):
            out = await run_script(tmp_path / "ask.py", recipe("openai"), OPENAI_BASE_URL=server.url, OPENAI_API_KEY=KEY)
            assert out == ANSWER + "\n", out
            first, second = up.chats
            assert GET_TIME in first.tool_names and first.headers["authorization"] == f"Bearer {KEY}"
            [result] = tool_messages(second.body)
            assert json.loads(result["content"])["timezone"] == "Asia/Tokyo"  # the real time server's answer
            assert server.app.metrics.value("sidecar_proxy_mcp_calls_total", outcome="ok") == 1

    run(body(), timeout=180)


def test_the_anthropic_recipe_runs_as_written(tmp_path):
    async def body():
        async with behind(tmp_path, tool_then_answer()) as (up, server):
            out = await run_script(tmp_path / "tokyo.py", recipe("anthropic"), ANTHROPIC_BASE_URL=server.url.removesuffix("/v1"),
                                   ANTHROPIC_API_KEY=KEY)  # fmt: skip
            assert out == ANSWER + "\n", out
            first, second = up.messages
            assert GET_TIME in first.tool_names
            [result] = results_of(second.body)
            assert json.loads(result["content"])["timezone"] == "Asia/Tokyo"
            assert server.app.metrics.value("sidecar_proxy_mcp_calls_total", outcome="ok") == 1

    run(body(), timeout=180)


def sidecar_lines(text: str) -> list[str]:
    """The `sidecar ...` commands of the doc's ```sh blocks and of its transcripts (``` blocks,
    `$ sidecar ...`)."""
    out, lang = [], None  # lang: None outside a block, else the block's language ("" for none)
    for line in text.splitlines():
        if line.startswith("```"):
            lang = line[3:].strip() if lang is None else None
        elif lang in ("sh", "") and line.removeprefix("$ ").startswith("sidecar "):
            out.append(line.removeprefix("$ "))
    return out


def test_the_recipes_sidecar_commands_parse():
    """Every `sidecar` command line of the recipes (the untested ones too) is one the CLI takes."""
    lines = sidecar_lines(DOC.read_text())
    assert {shlex.split(line, comments=True)[1] for line in lines} == {"proxy", "serve"}, lines
    parser = cli.build_parser()
    for line in lines:
        try:
            parser.parse_args(shlex.split(line, comments=True)[1:])
        except SystemExit:
            pytest.fail(f"docs/integrations.md: `{line}` is not a command sidecar takes")
