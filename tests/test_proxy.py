"""`sidecar proxy`: an OpenAI-compatible endpoint that adds the injected tools and runs the MCP ones.

The client is the official `openai` SDK (streaming and not); the upstream is
tests/openai_upstream.py, a real HTTP server on 127.0.0.1 playing scripted replies in OpenAI's
chunk shapes and recording what reached it; behind the proxy run real MCP servers over stdio
(`mcp-server-time`, the npm filesystem server), the small real model and a real SQLite store.
The assertions are on what reached the upstream (tools added, tool results appended,
restarts), what the SDK saw, and what the store recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import subprocess
import sys

import httpx2
import openai
import pytest

from sidecar import config as config_mod
from sidecar.core import asks, models
from sidecar.core.pipeline import Request
from sidecar.mcp import config as mcp_config
from sidecar.proxy import shapes
from sidecar.proxy.app import ProxyServer
from tests.conftest import CATALOGS, ROOT
from tests.mcp_support import TIME, free_port, fs_spec, run
from tests.openai_upstream import USAGE, Scripted, Upstream
from tests.test_mcp_live import FAST

SMALL = models.SMALL_MODEL
TOKYO = "What time is it in Tokyo right now?"
CHAT = "Hi there, how was your weekend?"
NARRATES = "Let me check the current time in Tokyo for you."
GET_TIME = "time__get_current_time"
OWN_TOOL = {"type": "function", "function": {"name": "lookup_order", "description": "Look up a shop order by its number.",
                                             "parameters": {"type": "object", "properties": {"number": {"type": "string"}}}}}  # fmt: skip
# The gate's bars where a test is about what reaches the upstream, not about where the calibration
# puts them (MiniLM gives the Tokyo question P = 0.90 over the time server alone).
BARS = {("gate", "auto"): 0.85, ("gate", "confirm"): 0.5, ("gate", "high"): 0.85}


@contextlib.asynccontextmanager
async def proxying(tmp_path: pathlib.Path, upstream: str, servers: dict | None = None, catalogs: list[str] | None = None,
                   bars: dict | None = BARS, **proxy):  # fmt: skip
    """An in-process proxy on 127.0.0.1 (a free port) over `upstream`, the live `servers`, loaded.
    find_tools is not offered unless asked for (`find_tools="always"`): these tests are about
    what the inject adds (tests/test_proxy_find_tools.py has the search)."""
    proxy.setdefault("find_tools", "never")
    overrides = {("model", "name"): SMALL, ("store",): str(tmp_path / "sidecar.db"), ("proxy", "port"): 0,
                 ("proxy", "upstream"): upstream, ("catalogs",): catalogs, **(bars or {})}  # fmt: skip
    overrides |= {("proxy", k): v for k, v in proxy.items()}
    cfg = config_mod.load(env={}, overrides=overrides)
    live = mcp_config.parse({"mcpServers": servers, "sidecar": FAST}, "test.json") if servers else None
    catalog = None
    if catalogs:
        from sidecar.core import catalog as catalog_mod

        catalog = catalog_mod.load(catalogs)
    server = ProxyServer(cfg, mcp=live, catalog=catalog)
    try:
        await server.start()
        yield server
    finally:
        await server.shutdown()


def client(server: ProxyServer, key: str = "sk-test-secret") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url, api_key=key, max_retries=0, timeout=60)


def tool_messages(body: dict) -> list[dict]:
    return [m for m in body["messages"] if m["role"] == "tool"]


def calls_of(server: ProxyServer) -> dict[str, object]:
    """The call history the store holds, by server__tool."""
    listing = server.engine.history.listing()
    return {f"{t.server}__{t.tool}": t for t in listing.tools}


# ---- the whole path, streamed and not ---------------------------------------------------------


def test_a_stream_gets_the_injected_tool_and_its_call_is_run_within_the_request(tmp_path):
    replies = [Scripted(calls=[(GET_TIME, {"timezone": "Asia/Tokyo"})]), Scripted(text="It is noon in Tokyo.")]

    async def body():
        with Upstream(replies) as up:
            async with proxying(tmp_path, up.url, {"time": TIME}) as server:
                stream = await client(server).chat.completions.create(
                    model="scripted", messages=[{"role": "user", "content": TOKYO}], tools=[OWN_TOOL], stream=True,
                    stream_options={"include_usage": True})  # fmt: skip
                chunks = [c async for c in stream]
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                assert text == "It is noon in Tokyo."
                assert not [c for c in chunks if c.choices and c.choices[0].delta.tool_calls], "the proxy's call is not the client's"
                assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
                assert len({c.id for c in chunks}) == 1, "one completion across both upstream calls"
                assert chunks[-1].usage.total_tokens == 2 * USAGE["total_tokens"], "usage of both upstream calls"
                first, second = up.chats
                assert first.tool_names[0] == "lookup_order" and GET_TIME in first.tool_names, first.tool_names
                assert first.headers["authorization"] == "Bearer sk-test-secret"
                [result] = tool_messages(second.body)
                assert result["tool_call_id"] == "call_0_time__get_current_ti"
                assert json.loads(result["content"])["timezone"] == "Asia/Tokyo"  # the real time server's answer
                assistant = second.body["messages"][-2]
                assert assistant["tool_calls"][0]["function"] == {"name": GET_TIME, "arguments": '{"timezone": "Asia/Tokyo"}'}
                assert "lookup_order" in second.tool_names
                recorded = calls_of(server)[GET_TIME]
                assert recorded.call_count == 1 and recorded.success_count == 1
                metrics = server.app.metrics
                assert metrics.value("sidecar_proxy_mcp_calls_total", outcome="ok") == 1
                assert metrics.value("sidecar_proxy_tools_added_sum") >= 1
                assert 0 < metrics.value("sidecar_proxy_schema_tokens_sent_total") < metrics.value("sidecar_proxy_catalog_schema_tokens")

    run(body(), timeout=180)


def test_a_whole_request_runs_a_filesystem_tool_and_answers(tmp_path, fs_server, fs_root):
    path = str(fs_root / "notes.txt")
    replies = [Scripted(calls=[("filesystem__read_text_file", {"path": path})]), Scripted(text="Your notes describe three nodes.")]

    async def body():
        with Upstream(replies) as up:
            async with proxying(tmp_path, up.url, {"filesystem": fs_spec(fs_server, fs_root)}, bars=None) as server:
                done = await client(server).chat.completions.create(
                    model="scripted", messages=[{"role": "user", "content": f"Show me the contents of {path}"}])
                assert done.choices[0].message.content == "Your notes describe three nodes."
                assert done.choices[0].message.tool_calls is None and done.choices[0].finish_reason == "stop"
                assert done.usage.total_tokens == 2 * USAGE["total_tokens"]
                first, second = up.chats
                assert "filesystem__read_text_file" in first.tool_names, first.tool_names
                [result] = tool_messages(second.body)
                assert "kubernetes setup: three nodes" in result["content"]
                assert calls_of(server)["filesystem__read_text_file"].success_count == 1

    run(body(), timeout=180)


def test_calls_of_the_clients_own_tools_go_back_to_it(tmp_path):
    replies = [Scripted(text="Checking.", calls=[("lookup_order", {"number": "A-17"})])]

    async def body():
        with Upstream(replies) as up:
            async with proxying(tmp_path, up.url, {"time": TIME}) as server:
                stream = await client(server).chat.completions.create(
                    model="scripted", messages=[{"role": "user", "content": TOKYO}], tools=[OWN_TOOL], stream=True)
                chunks = [c async for c in stream]
                calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
                assert calls[0].index == 0 and calls[0].function.name == "lookup_order"
                assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"number": "A-17"}
                assert chunks[-1].choices[0].finish_reason == "tool_calls"
                assert len(up.chats) == 1, "nothing is run for the client's own tool"
                # its next request carries the result: the judged turn is still the Tokyo question
                done = await client(server).chat.completions.create(model="scripted", tools=[OWN_TOOL], messages=[
                    {"role": "user", "content": TOKYO},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": GET_TIME, "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "noon"}])  # fmt: skip
                assert done.choices[0].message.tool_calls[0].function.name == "lookup_order"
                assert GET_TIME in up.chats[1].tool_names  # a tool the conversation called stays offered

    run(body(), timeout=180)


def test_concurrent_streams_each_get_their_tools_and_their_answer(tmp_path):
    async def body():
        with Upstream([Scripted(text="Here you are.", pause_s=0.01)]) as up:
            async with proxying(tmp_path, up.url, {"time": TIME}) as server:
                c = client(server)

                async def one(i: int) -> str:
                    stream = await c.chat.completions.create(model="scripted", stream=True, user=f"agent-{i}",
                                                             messages=[{"role": "user", "content": TOKYO if i % 2 else CHAT}])  # fmt: skip
                    return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

                assert await asyncio.gather(*(one(i) for i in range(8))) == ["Here you are."] * 8
                by_turn = {r.body["user"]: r.tool_names for r in up.chats}
                assert all((GET_TIME in by_turn[f"agent-{i}"]) == bool(i % 2) for i in range(8)), by_turn

    run(body(), timeout=180)


def scraped(text: str) -> dict[str, float]:
    """A /metrics page's samples by name (labels left off: the ones read here have none)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples if not s.labels}


def test_metrics_count_each_request_once(tmp_path):
    """/metrics after three requests (streamed and not, with tools added and without) says
    three requests, and as many schema tokens sent and saved as the upstream really received."""
    from sidecar.mcp.savings import count_tokens

    async def body():
        with Upstream([Scripted(text="Fine.")]) as up:
            async with proxying(tmp_path, up.url, {"time": TIME}) as server:
                c = client(server)
                await c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": TOKYO}])
                stream = await c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": TOKYO}], stream=True)
                [_ async for _ in stream]
                await c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": CHAT}])
                async with httpx2.AsyncClient() as http:
                    for _ in range(100):  # a request is counted once its answer is on its way: the last may still be
                        metrics = scraped((await http.get(server.url + "/metrics")).text)
                        if metrics["sidecar_proxy_tools_added_count"] >= 3:
                            break
                        await asyncio.sleep(0.05)
                added = [r.body.get("tools") or [] for r in up.chats]
                assert [bool(tools) for tools in added] == [True, True, False], [r.tool_names for r in up.chats]
                sent = [count_tokens(json.dumps(tools, separators=(",", ":"), ensure_ascii=False)) if tools else 0 for tools in added]
                every = metrics["sidecar_proxy_catalog_schema_tokens"]
                assert metrics["sidecar_proxy_tools_added_count"] == 3
                assert metrics["sidecar_proxy_tools_added_sum"] == sum(len(tools) for tools in added)
                assert metrics["sidecar_proxy_schema_tokens_sent_total"] == sum(sent)
                assert metrics["sidecar_proxy_schema_tokens_saved_total"] == sum(every - n for n in sent)

    run(body(), timeout=180)


def test_a_short_follow_up_is_judged_with_the_turn_before_it(tmp_path):
    follow_up = "And in Paris?"

    async def body():
        with Upstream([Scripted(text="Fine.")]) as up:
            async with proxying(tmp_path, up.url, {"time": TIME}) as server:
                c = client(server)
                await c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": follow_up}])
                await c.chat.completions.create(model="scripted", messages=[
                    {"role": "user", "content": TOKYO}, {"role": "assistant", "content": "It is noon in Tokyo."},
                    {"role": "user", "content": follow_up}])  # fmt: skip
                await c.chat.completions.create(model="scripted", messages=[
                    {"role": "user", "content": TOKYO}, {"role": "assistant", "content": "It is noon in Tokyo."},
                    {"role": "user", "content": "Thanks! By the way, I am planning a long trip to Japan next spring with my family."}])  # fmt: skip
                alone, followed, long_turn = up.chats
                assert alone.body.get("tools") is None, "the follow-up alone asks for nothing"
                assert GET_TIME in followed.tool_names
                assert long_turn.body.get("tools") is None, "a turn that says enough is judged alone"

    run(body(), timeout=180)


def test_tool_choice_none_or_a_named_function_adds_nothing(tmp_path):
    async def body():
        with Upstream([Scripted(text="Fine.")]) as up:
            async with proxying(tmp_path, up.url, {"time": TIME}) as server:
                c = client(server)
                msgs = [{"role": "user", "content": TOKYO}]
                await c.chat.completions.create(model="scripted", messages=msgs, tools=[OWN_TOOL], tool_choice="none")
                await c.chat.completions.create(model="scripted", messages=msgs, tools=[OWN_TOOL],
                                                tool_choice={"type": "function", "function": {"name": "lookup_order"}})  # fmt: skip
                await c.chat.completions.create(model="scripted", messages=msgs, tools=[OWN_TOOL], tool_choice="required")
                assert [r.tool_names for r in up.chats[:2]] == [["lookup_order"], ["lookup_order"]]
                assert up.chats[0].body["tool_choice"] == "none"
                assert GET_TIME in up.chats[2].tool_names

    run(body(), timeout=180)


def test_a_confirm_tier_inject_adds_tools_only_when_included(tmp_path):
    confirm = {("gate", "auto"): 0.9999, ("gate", "confirm"): 0.5, ("gate", "high"): 0.85}  # the Tokyo question (P 0.90): confirm tier

    async def body():
        with Upstream([Scripted(text="Fine.")]) as up:
            for policy in ("exclude", "include"):
                async with proxying(tmp_path, up.url, {"time": TIME}, bars=confirm, confirm_tools=policy) as server:
                    await client(server).chat.completions.create(model="scripted", messages=[{"role": "user", "content": TOKYO}])
            assert up.chats[0].body.get("tools") is None
            assert GET_TIME in up.chats[1].tool_names

    run(body(), timeout=180)


# ---- errors in OpenAI's shape -----------------------------------------------------------------


def test_errors_come_in_openai_shape(tmp_path):
    async def body():
        with Upstream([Scripted(text="late", delay_s=3.0), Scripted(status=429, error={"error": {
                "message": "slow down", "type": "rate_limit_error", "param": None, "code": "rate_limited"}})]) as up:  # fmt: skip
            async with proxying(tmp_path, up.url, catalogs=[str(CATALOGS / "notes.json")], read_timeout_s=1.0) as server:
                c = client(server)
                with pytest.raises(openai.APIStatusError) as slow:
                    await c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": CHAT}])
                assert slow.value.status_code == 504 and slow.value.body["code"] == "upstream_timeout"
                with pytest.raises(openai.RateLimitError) as limited:  # the upstream's own error passes through
                    await c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": CHAT}], stream=True)
                assert limited.value.body["message"] == "slow down"
                async with httpx2.AsyncClient() as http:
                    for payload, param in [({"messages": [{"role": "user", "content": "x"}]}, "model"),
                                           ({"model": "m", "messages": []}, "messages"),
                                           ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
                                           ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {}}]},
                                            "tools[0].function.name"),
                                           ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "always"}, "tool_choice")]:  # fmt: skip
                        resp = await http.post(server.url + "/chat/completions", json=payload)
                        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
                    resp = await http.post(server.url + "/chat/completions", content=b"{not json")
                    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
                    assert (await http.get(server.url + "/chat/completions")).status_code == 405
                    resp = await http.get(server.url + "/models", headers={"authorization": "Bearer k"})
                    assert resp.json()["data"][0]["id"] == "scripted" and up.requests[-1].headers["authorization"] == "Bearer k"
                    assert (await http.post(server.url + "/chat/completions", json={}, headers={"host": "evil.example"})).status_code == 421
        async with proxying(tmp_path, f"http://127.0.0.1:{free_port()}/v1", catalogs=[str(CATALOGS / "notes.json")]) as server:
            with pytest.raises(openai.APIStatusError) as down:
                await client(server).chat.completions.create(model="m", messages=[{"role": "user", "content": CHAT}], stream=True)
            assert down.value.status_code == 502 and down.value.body["code"] == "upstream_unreachable"
            with pytest.raises(openai.BadRequestError) as bad:
                await client(server).chat.completions.create(model="m", messages=[{"role": "user", "content": CHAT}], stream="yes")  # type: ignore[arg-type]
            assert bad.value.body["param"] == "stream"

    run(body(), timeout=180)


def test_a_client_that_goes_away_cancels_the_upstream_call(tmp_path):
    async def body():
        with Upstream([Scripted(text=" ".join(["word"] * 200), pause_s=0.05), Scripted(text="late", delay_s=3.0)]) as up:
            async with proxying(tmp_path, up.url, catalogs=[str(CATALOGS / "notes.json")]) as server:
                stream = await client(server).chat.completions.create(model="scripted", messages=[{"role": "user", "content": CHAT}], stream=True)
                async for _ in stream:
                    break
                await stream.close()
                for _ in range(200):  # bounded: the upstream notices within a few of its chunks
                    if up.cut:
                        break
                    await asyncio.sleep(0.05)
                assert up.cut == [0] and not up.done, "the upstream stream was broken off, not played to its end"
                assert server.app.metrics.value("sidecar_proxy_cancelled_total") == 1
                with pytest.raises(openai.APITimeoutError):  # a whole request given up while the upstream thinks
                    await client(server).with_options(timeout=0.5).chat.completions.create(
                        model="scripted", messages=[{"role": "user", "content": CHAT}])
                for _ in range(100):
                    if server.app.metrics.value("sidecar_proxy_cancelled_total") == 2:
                        break
                    await asyncio.sleep(0.05)
                assert server.app.metrics.value("sidecar_proxy_cancelled_total") == 2
                assert server.app.metrics.value("sidecar_proxy_requests_total", api="chat", mode="whole", status="200") == 0

    run(body(), timeout=180)


def test_a_stream_the_upstream_cuts_short_ends_in_an_error_event(tmp_path):
    async def body():
        with Upstream([Scripted(text="one two three four five six", cut_after=3)]) as up:
            async with proxying(tmp_path, up.url, catalogs=[str(CATALOGS / "notes.json")]) as server:
                stream = await client(server).chat.completions.create(model="scripted", messages=[{"role": "user", "content": CHAT}], stream=True)
                seen = []
                with pytest.raises(openai.APIError) as cut:
                    async for chunk in stream:
                        seen += [chunk.choices[0].delta.content or ""] if chunk.choices else []
                assert "".join(seen) == "one two " and "ended before its reply" in cut.value.message
                assert server.app.metrics.value("sidecar_proxy_upstream_errors_total", kind="cut") == 1

    run(body(), timeout=180)


def test_a_failing_mcp_tool_becomes_a_tool_message_with_the_error_and_fallbacks(tmp_path):
    replies = [Scripted(calls=[(GET_TIME, {"timezone": "Not/AZone"})]), Scripted(text="Sorry, that zone is unknown.")]

    async def body():
        with Upstream(replies) as up:
            async with proxying(tmp_path, up.url, {"time": TIME}) as server:
                done = await client(server).chat.completions.create(model="scripted", messages=[{"role": "user", "content": TOKYO}])
                assert done.choices[0].message.content == "Sorry, that zone is unknown."
                [result] = tool_messages(up.chats[1].body)
                note = json.loads(result["content"])
                assert "Not/AZone" in note["error"] and note["tool"] == GET_TIME
                assert "time__convert_time" in note["fallback_suggestions"]
                assert "time__convert_time" in up.chats[1].tool_names  # the fallback is offered for the next round
                recorded = calls_of(server)[GET_TIME]
                assert recorded.failure_count == 1 and "Not/AZone" in recorded.last_error
                assert server.app.metrics.value("sidecar_proxy_mcp_calls_total", outcome="error") == 1

    run(body(), timeout=180)


def test_tool_rounds_are_bounded(tmp_path):
    replies = [Scripted(calls=[(GET_TIME, {"timezone": "UTC"})])]  # the model never stops calling

    async def body():
        with Upstream(replies) as up:
            async with proxying(tmp_path, up.url, {"time": TIME}, max_tool_rounds=2) as server:
                done = await client(server).chat.completions.create(model="scripted", messages=[{"role": "user", "content": TOKYO}])
                assert len(up.chats) == 3 and len(tool_messages(up.chats[-1].body)) == 2
                assert done.choices[0].finish_reason == "stop" and done.choices[0].message.tool_calls is None
                assert calls_of(server)[GET_TIME].call_count == 2

    run(body(), timeout=180)


# ---- narration --------------------------------------------------------------------------------


def test_a_narrated_tool_is_annotated_in_the_stream(tmp_path):
    async def body():
        with Upstream([Scripted(text=NARRATES)]) as up:
            async with proxying(tmp_path, up.url, {"time": TIME}) as server:
                stream = await client(server).chat.completions.create(model="scripted", messages=[{"role": "user", "content": CHAT}], stream=True)
                chunks = [c async for c in stream]
                assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == NARRATES
                notes = [c.model_extra["sidecar"]["narration"] for c in chunks if c.model_extra and "sidecar" in c.model_extra]
                assert notes and notes[0]["tools"][0]["function"]["name"] == GET_TIME and notes[0]["action"] == "annotate"
                assert up.chats[0].body.get("tools") is None and len(up.chats) == 1
                async with httpx2.AsyncClient() as http:  # the raw stream: an SSE comment names the tool too
                    raw = (await http.post(server.url + "/chat/completions", timeout=60, json={
                        "model": "m", "stream": True, "messages": [{"role": "user", "content": CHAT}]})).text  # fmt: skip
                assert f": sidecar narration: {GET_TIME}" in raw and raw.rstrip().endswith("data: [DONE]")
                assert server.app.metrics.value("sidecar_proxy_narrations_total", action="annotate") == 2

    run(body(), timeout=180)


def test_a_narrated_tool_restarts_the_call_with_the_tool_added_streamed_or_whole(tmp_path):
    replies = [Scripted(text=NARRATES), Scripted(calls=[(GET_TIME, {"timezone": "Asia/Tokyo"})]), Scripted(text="It is noon there.")]

    async def body():
        with Upstream(replies * 2) as up:
            async with proxying(tmp_path, up.url, {"time": TIME}, on_narration="restart") as server:
                c = client(server)
                stream = await c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": CHAT}], stream=True)
                chunks = [c async for c in stream]
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                assert text.startswith(NARRATES[:10]) and text.endswith("It is noon there.")  # one continuous stream
                assert len({c.id for c in chunks}) == 1
                first, second, third = up.chats
                assert first.body.get("tools") is None and GET_TIME in second.tool_names
                said = second.body["messages"][-1]
                assert said["role"] == "assistant" and NARRATES.startswith(said["content"][:10])  # the reply so far goes along
                assert json.loads(tool_messages(third.body)[0]["content"])["timezone"] == "Asia/Tokyo"
                done = await c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": CHAT}])
                assert done.choices[0].message.content == "It is noon there."  # the client saw nothing of the first reply
                [note] = done.model_extra["sidecar"]["narration"]
                assert note["action"] == "restart" and note["tools"][0]["function"]["name"] == GET_TIME
                first, second, third = up.chats[3:]
                assert GET_TIME in second.tool_names and second.body["messages"] == first.body["messages"]
                assert tool_messages(third.body) and server.app.metrics.value("sidecar_proxy_restarts_total") == 2

    run(body(), timeout=180)


# ---- the command ------------------------------------------------------------------------------


def test_the_proxy_command_serves_and_never_logs_the_key(tmp_path):
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"time": TIME}, "sidecar": FAST}))
    port = free_port()
    log = tmp_path / "proxy.log"
    secret = "sk-never-in-a-log-4f1c"
    with Upstream([Scripted(status=500, error={"error": {"message": "boom", "type": "server_error", "param": None, "code": None}}),
                   Scripted(text="ok")]) as up:  # fmt: skip
        cmd = [sys.executable, "-m", "sidecar", "proxy", "--upstream", up.url, "--mcp-config", str(config), "--model", SMALL,
               "--store", str(tmp_path / "sidecar.db"), "--port", str(port)]  # fmt: skip
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "SIDECAR_CONFIG": ""})
        try:
            async def body():
                for _ in range(1200):  # bounded: until it says it listens
                    if "proxy listening on" in log.read_text() or proc.poll() is not None:
                        break
                    await asyncio.sleep(0.1)
                assert "proxy listening on http://127.0.0.1:" in log.read_text(), log.read_text()
                c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=secret, max_retries=0)
                with pytest.raises(openai.InternalServerError):
                    await c.chat.completions.create(model="m", messages=[{"role": "user", "content": TOKYO}])
                done = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": TOKYO}])
                assert done.choices[0].message.content == "ok"
                async with httpx2.AsyncClient() as http:
                    metrics = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
                assert 'sidecar_proxy_requests_total{api="chat",mode="whole",status="500"} 1.0' in metrics
                assert 'sidecar_proxy_requests_total{api="chat",mode="whole",status="200"} 1.0' in metrics

            run(body(), timeout=240)
            assert all(r.headers["authorization"] == f"Bearer {secret}" for r in up.chats)
        finally:
            proc.terminate()
            proc.wait(60)
    assert proc.returncode == 0, log.read_text()
    assert secret not in log.read_text()


# ---- the pure core ----------------------------------------------------------------------------


def test_sse_reader_reads_events_in_any_pieces():
    stream = b'data: {"a": 1}\r\n\r\n: keep-alive\n\ndata: {"b":\ndata: 2}\n\ndata: [DONE]\n\n'
    whole = [(e.data, e.comment) for e in shapes.SSEReader().feed(stream)]
    assert whole == [('{"a": 1}', None), (None, "keep-alive"), ('{"b":\n2}', None), ("[DONE]", None)]
    for size in (1, 2, 3, 7):
        reader = shapes.SSEReader()
        got = [e for k in range(0, len(stream), size) for e in reader.feed(stream[k : k + size])] + reader.end()
        assert [(e.data, e.comment) for e in got] == whole, size


def test_reply_holds_back_the_proxys_calls_and_renumbers_the_clients():
    reply = shapes.Reply(lambda name: name.startswith("time__"))
    base = {"id": "x", "object": "chat.completion.chunk"}

    def delta(d, finish=None):
        return {**base, "choices": [{"index": 0, "delta": d, "finish_reason": finish}]}

    assert reply.feed(delta({"role": "assistant", "content": "Hi"}))["choices"][0]["delta"]["content"] == "Hi"
    assert reply.feed(delta({"tool_calls": [{"index": 0, "id": "a", "type": "function", "function": {"name": "time__now", "arguments": ""}}]})) is None
    assert reply.feed(delta({"tool_calls": [{"index": 0, "function": {"arguments": '{"tz"'}}]})) is None
    out = reply.feed(delta({"tool_calls": [{"index": 1, "id": "b", "type": "function", "function": {"name": "own", "arguments": "{}"}}]}))
    assert out["choices"][0]["delta"]["tool_calls"][0]["index"] == 0
    assert reply.feed(delta({}, "tool_calls")) is None and reply.finish_reason == "tool_calls"
    assert reply.feed({**base, "choices": [], "usage": {"total_tokens": 3}}) is None and reply.usage == {"total_tokens": 3}
    assert [c.name for c in reply.our_calls] == ["time__now"] and reply.our_calls[0].arguments == '{"tz"'
    assert reply.client_finish() == "tool_calls"
    message = reply.assistant_message()
    assert [c["id"] for c in message["tool_calls"]] == ["a", "b"] and message["content"] == "Hi"
    only_ours = shapes.Reply(lambda name: True)
    only_ours.take_message({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "t", "arguments": "{}"}}]},
                           "tool_calls", None)  # fmt: skip
    assert only_ours.client_finish() == "stop" and only_ours.our_calls[0].id == "c"


def test_tools_are_added_after_the_clients_and_never_replace_them():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [OWN_TOOL]}
    mine = shapes.function_tool({"name": "lookup_order", "description": "other", "inputSchema": {"type": "object"}})
    added = shapes.function_tool({"name": "fs.read/file", "description": "Read", "inputSchema": {"type": "object", "properties": {}}})
    out = shapes.with_tools(body, [mine, added])
    assert [t["function"]["name"] for t in out["tools"]] == ["lookup_order", "fs_read_file"]
    assert out["tools"][0] is OWN_TOOL and body["tools"] == [OWN_TOOL]
    assert shapes.add_usage({"total_tokens": 2, "details": {"cached": 1}}, {"total_tokens": 3, "details": {"cached": 2}}) == {
        "total_tokens": 5, "details": {"cached": 3}}  # fmt: skip
    assert shapes.user_turns([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]},
                              {"role": "assistant", "content": "b"}, {"role": "user", "content": " "}]) == ["a"]  # fmt: skip


def test_the_proxy_learns_each_fresh_turn_with_the_tools_the_model_called(tmp_path):
    """Learning from traffic needs no client code behind the proxy: it sees the model's calls.
    A request ending with a user turn is an example of the tools called in answer (the proxy's
    own MCP tools and the client's alike), or of none; a request carrying tool results continues
    a turn already recorded."""
    replies = [Scripted(calls=[(GET_TIME, {"timezone": "Asia/Tokyo"})]), Scripted(text="It is noon in Tokyo."),
               Scripted(text="Lovely, thanks!"), Scripted(text="Checking.", calls=[("lookup_order", {"number": "A-17"})]),
               Scripted(text="It has shipped.")]  # fmt: skip

    async def body():
        with Upstream(replies) as up:
            async with proxying(tmp_path, up.url, {"time": TIME}) as server:
                c = client(server)
                await c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": TOKYO}], tools=[OWN_TOOL])
                await c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": CHAT}], tools=[OWN_TOOL])
                order = [{"role": "user", "content": "where is my order A-17?"}]
                done = await c.chat.completions.create(model="scripted", messages=order, tools=[OWN_TOOL])
                call = done.choices[0].message.tool_calls[0]
                await c.chat.completions.create(model="scripted", tools=[OWN_TOOL], messages=[
                    *order, {"role": "assistant", "content": None, "tool_calls": [
                        {"id": call.id, "type": "function", "function": {"name": "lookup_order", "arguments": call.function.arguments}}]},
                    {"role": "tool", "tool_call_id": call.id, "content": "shipped"}])  # fmt: skip
                await server.app.learner.drain()
                return [(e.text, e.tool, e.session[:6]) for e in server.app.learner.log.examples()]

    examples = run(body(), timeout=180)
    assert examples == [(TOKYO, GET_TIME, "proxy:"), (CHAT, None, "proxy:"), ("where is my order A-17?", "lookup_order", "proxy:")], examples


def test_a_turn_of_several_asks_and_its_follow_up_cost_one_embedding_call(tmp_path):
    """Issue 50: a user turn's asks, the short follow-up joined to the turn before it and the
    gate share one batched embedding call, in the engine and through the proxy, and each ask
    still brings its own tool, the one it gets judged alone. Counted: the model's calls that
    embed any of the turn's texts (the real model; background work embeds other texts)."""
    turn = "search my notes for the kubernetes setup, then delete the note about groceries"
    before, follow_up = "I keep my shopping lists in my notes.", "find the groceries note, then delete it"

    async def body():
        with Upstream([Scripted(text="Done.")]) as up:
            async with proxying(tmp_path, up.url, catalogs=[str(CATALOGS / "notes.json")], confirm_tools="include") as server:
                engine = server.engine
                embedder = engine.pipeline.embedder
                calls: list[list[str]] = []
                embed = embedder.embed

                def counted(texts, *args, **kwargs):
                    calls.append(list(texts))
                    return embed(texts, *args, **kwargs)

                embedder.embed = counted
                ours = lambda texts: [c for c in calls if set(texts) & set(c)]  # noqa: E731

                [j] = engine.judge([Request(turn)])
                assert [len(c) for c in ours([turn, *asks.split(turn)])] == [3], calls  # the turn and its two asks, at once
                alone = [engine.rank(Request(a), 1).results[0].tool for a in asks.split(turn)]
                assert [r.tool for r in j.asks] == alone == ["semantic_search", "delete_note"]

                calls.clear()
                await client(server).chat.completions.create(model="scripted", messages=[
                    {"role": "user", "content": before}, {"role": "assistant", "content": "Noted."},
                    {"role": "user", "content": follow_up}])  # fmt: skip
                mine = ours([follow_up, *asks.split(follow_up)])
                assert len(mine) == 1, calls  # the follow-up, joined to the turn before it, and both one's asks
                assert {follow_up, f"{before}\n{follow_up}", "delete it", before.rstrip(".")} <= set(mine[0]), mine
                assert "delete_note" in up.chats[0].tool_names, up.chats[0].tool_names

    run(body(), timeout=180)
