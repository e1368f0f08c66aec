"""`sidecar proxy` speaking Anthropic's Messages API (`/v1/messages`) beside OpenAI's.

The client is the official `anthropic` SDK (streamed, through its `messages.stream` helper that
checks the order of events and builds the final message, and whole); the upstream is
tests/openai_upstream.py playing scripted replies in Anthropic's event shapes and recording what
reached it; behind the proxy run the real `mcp-server-time` over stdio, the small real model and a
real SQLite store, as in tests/test_proxy.py. The assertions are on what reached the upstream
(tools added in Anthropic's shape, `tool_result` blocks appended, headers forwarded), what the
SDK saw, what the store recorded and what learning from traffic kept.
"""

from __future__ import annotations

import contextlib
import json
import logging

import anthropic
import httpx2
import pytest

from sidecar.proxy import shapes
from tests.conftest import CATALOGS
from tests.mcp_support import TIME, free_port, run
from tests.openai_upstream import MESSAGE_USAGE, Scripted, Upstream
from tests.test_proxy import CHAT, GET_TIME, NARRATES, TOKYO, calls_of, proxying

SECRET = "sk-ant-never-in-a-log-7d2e"
OWN_TOOL = {"name": "lookup_order", "description": "Look up a shop order by its number.",
            "input_schema": {"type": "object", "properties": {"number": {"type": "string"}}}}  # fmt: skip


def client(server) -> anthropic.AsyncAnthropic:
    """The SDK pointed at the proxy: its base URL is the proxy's root (the SDK adds /v1/messages).
    This version of the SDK sends the key as `Authorization: Bearer`; `x-api-key`, what the API
    documents and other clients send, goes along too."""
    return anthropic.AsyncAnthropic(base_url=server.url.removesuffix("/v1"), api_key=SECRET, max_retries=0, timeout=60,
                                    default_headers={"x-api-key": SECRET, "anthropic-version": "2023-06-01"})  # fmt: skip


@contextlib.asynccontextmanager
async def behind(tmp_path, replies: list[Scripted], servers: dict | None = None, **proxy):
    """The scripted upstream playing `replies`, and a proxy in front of it with the live `servers`
    (the time server unless told), or only the notes catalog with `servers={}`."""
    with Upstream(replies) as up:
        catalogs = None if servers != {} else [str(CATALOGS / "notes.json")]
        async with proxying(tmp_path, up.url, {"time": TIME} if servers is None else servers or None, catalogs=catalogs, **proxy) as server:
            yield up, server


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def results_of(body: dict) -> list[dict]:
    """The tool_result blocks of a request's last message."""
    content = body["messages"][-1]["content"]
    return [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"] if isinstance(content, list) else []


def test_a_stream_gets_the_injected_tool_and_its_call_is_run_within_the_request(tmp_path, caplog):
    replies = [Scripted(text="Let me check.", calls=[(GET_TIME, {"timezone": "Asia/Tokyo"})]), Scripted(text="It is noon in Tokyo.")]
    caplog.set_level(logging.DEBUG)

    async def body():
        async with behind(tmp_path, replies) as (up, server):
            async with client(server).messages.stream(model="scripted", max_tokens=256, messages=user(TOKYO), tools=[OWN_TOOL]) as stream:
                kinds = [event.type async for event in stream]
                final = await stream.get_final_message()
            assert kinds.count("message_start") == 1 and kinds[-1] == "message_stop", kinds
            assert [b.type for b in final.content] == ["text", "text"], "the proxy's tool use is not the client's"
            assert "".join(b.text for b in final.content) == "Let me check.It is noon in Tokyo."
            assert final.stop_reason == "end_turn"
            assert (final.usage.input_tokens, final.usage.output_tokens) == (2 * MESSAGE_USAGE["input_tokens"], 2 * MESSAGE_USAGE["output_tokens"])
            first, second = up.messages
            assert first.tool_names[0] == "lookup_order" and GET_TIME in first.tool_names, first.tool_names
            added = next(t for t in first.body["tools"] if t["name"] == GET_TIME)
            assert set(added) == {"name", "description", "input_schema"} and added["input_schema"]["type"] == "object"
            assert first.headers["x-api-key"] == SECRET and first.headers["authorization"] == f"Bearer {SECRET}"
            assert first.headers["anthropic-version"] == "2023-06-01"
            assistant = second.body["messages"][-2]
            assert assistant["role"] == "assistant" and [b["type"] for b in assistant["content"]] == ["text", "tool_use"]
            assert assistant["content"][1]["input"] == {"timezone": "Asia/Tokyo"}
            [result] = results_of(second.body)
            assert result["tool_use_id"] == assistant["content"][1]["id"] and "is_error" not in result
            assert json.loads(result["content"])["timezone"] == "Asia/Tokyo"  # the real time server's answer
            assert "lookup_order" in second.tool_names
            assert calls_of(server)[GET_TIME].success_count == 1
            metrics = server.app.metrics
            assert metrics.value("sidecar_proxy_requests_total", api="messages", mode="stream", status="200") == 1
            assert metrics.value("sidecar_proxy_mcp_calls_total", outcome="ok") == 1

    run(body(), timeout=180)
    assert caplog.records and SECRET not in caplog.text, "the key is never logged, not even at DEBUG"


def test_a_whole_message_runs_the_tool_and_answers_in_one_message(tmp_path):
    replies = [Scripted(text="Let me check.", calls=[(GET_TIME, {"timezone": "Asia/Tokyo"})]), Scripted(text="It is noon in Tokyo.")]

    async def body():
        async with behind(tmp_path, replies) as (up, server):
            done = await client(server).messages.create(model="scripted", max_tokens=256, messages=user(TOKYO), metadata={"user_id": "agent-7"})
            assert [(b.type, b.text) for b in done.content] == [("text", "Let me check."), ("text", "It is noon in Tokyo.")]
            assert done.stop_reason == "end_turn" and done.usage.output_tokens == 2 * MESSAGE_USAGE["output_tokens"]
            first, second = up.messages
            assert GET_TIME in first.tool_names
            [result] = results_of(second.body)
            assert json.loads(result["content"])["timezone"] == "Asia/Tokyo"
            assert calls_of(server)[GET_TIME].success_count == 1

    run(body(), timeout=180)


def test_chit_chat_gets_no_tools_tool_choice_is_respected_and_count_tokens_passes(tmp_path):
    async def body():
        async with behind(tmp_path, [Scripted(text="Fine.")]) as (up, server):
            c = client(server)
            await c.messages.create(model="scripted", max_tokens=64, messages=user(CHAT))
            for choice in ({"type": "none"}, {"type": "tool", "name": "lookup_order"}, {"type": "any"}, {"type": "auto"}):
                await c.messages.create(model="scripted", max_tokens=64, messages=user(TOKYO), tools=[OWN_TOOL], tool_choice=choice)
            chat, none, named, any_, auto = up.messages
            assert "tools" not in chat.body, "a chit-chat turn gets no tools"
            assert none.tool_names == ["lookup_order"] and none.body["tool_choice"] == {"type": "none"}
            assert named.tool_names == ["lookup_order"]
            assert GET_TIME in any_.tool_names and GET_TIME in auto.tool_names
            counted = await c.messages.count_tokens(model="scripted", messages=user(TOKYO), tools=[OWN_TOOL])
            sent = up.requests[-1]
            assert sent.path == "/v1/messages/count_tokens" and sent.body["tools"] == [OWN_TOOL], "passed through as it is"
            assert counted.input_tokens == int(sent.headers["content-length"]) // 4
            assert sent.headers["x-api-key"] == SECRET

    run(body(), timeout=180)


def test_errors_come_in_anthropic_shape(tmp_path):
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}

    async def body():
        replies = [Scripted(text="late", delay_s=3.0), Scripted(status=529, error=overloaded), Scripted(text="one two three four five six", cut_after=5)]
        async with behind(tmp_path, replies, servers={}, read_timeout_s=1.0) as (up, server):
            c = client(server)
            with pytest.raises(anthropic.APIStatusError) as slow:
                await c.messages.create(model="scripted", max_tokens=64, messages=user(CHAT))
            assert slow.value.status_code == 504 and slow.value.body["type"] == "error"
            assert slow.value.body["error"]["type"] == "timeout_error" and set(slow.value.body["error"]) == {"type", "message"}
            with pytest.raises(anthropic.APIStatusError) as busy:  # the upstream's own error passes as it is
                await c.messages.create(model="scripted", max_tokens=64, messages=user(CHAT), stream=True)
            assert busy.value.status_code == 529 and busy.value.body == overloaded
            seen = []
            with pytest.raises(anthropic.APIStatusError) as cut:  # cut mid-stream: an `error` event
                async with c.messages.stream(model="scripted", max_tokens=64, messages=user(CHAT)) as stream:
                    async for text in stream.text_stream:
                        seen.append(text)
            assert "".join(seen) == "one two " and cut.value.body["error"]["type"] == "api_error"
            assert "ended before its reply" in cut.value.body["error"]["message"]
            with pytest.raises(anthropic.BadRequestError) as bad:
                await c.messages.create(model="scripted", max_tokens=64, messages=[{"role": "system", "content": "x"}])  # type: ignore[list-item]
            assert bad.value.body["error"] == {"type": "invalid_request_error", "message": bad.value.body["error"]["message"]}
            assert "messages.0.role" in bad.value.body["error"]["message"]
            async with httpx2.AsyncClient() as http:
                root = server.url.removesuffix("/v1")
                for payload, field in [({"model": "m", "messages": user("x"), "tool_choice": "auto"}, "tool_choice"),
                                       ({"model": "m", "messages": user("x"), "tools": [{"description": "no name"}]}, "tools.0.name"),
                                       ({"model": "m", "messages": [{"role": "user", "content": [{"text": "untyped"}]}]}, "messages.0.content")]:  # fmt: skip
                    resp = await http.post(root + "/v1/messages", json=payload)
                    assert resp.status_code == 400 and resp.json()["type"] == "error" and field in resp.json()["error"]["message"], resp.text
                resp = await http.post(root + "/v1/messages", content=b"{not json")
                assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
                resp = await http.get(root + "/v1/messages")
                assert resp.status_code == 405 and resp.json()["type"] == "error"
            assert server.app.metrics.value("sidecar_proxy_upstream_errors_total", kind="cut") == 1
        async with proxying(tmp_path, f"http://127.0.0.1:{free_port()}/v1", catalogs=[str(CATALOGS / "notes.json")]) as server:
            with pytest.raises(anthropic.APIStatusError) as down:
                await client(server).messages.create(model="m", max_tokens=64, messages=user(CHAT), stream=True)
            assert down.value.status_code == 502 and down.value.body["error"]["type"] == "api_error"
            assert "cannot be reached" in down.value.body["error"]["message"]

    run(body(), timeout=180)


def test_narration_is_annotated_or_restarts_the_call_with_the_tool(tmp_path):
    async def body():
        async with behind(tmp_path, [Scripted(text=NARRATES)]) as (up, server):
            async with client(server).messages.stream(model="scripted", max_tokens=64, messages=user(CHAT)) as stream:
                events = [e async for e in stream]
                final = await stream.get_final_message()
            assert final.content[0].text == NARRATES and len(up.messages) == 1 and "tools" not in up.messages[0].body
            [note] = [e.narration for e in events if e.type == "sidecar"]  # an event type the SDK passes on
            assert note["action"] == "annotate" and note["tools"][0]["name"] == GET_TIME and "input_schema" in note["tools"][0]
            async with httpx2.AsyncClient() as http:  # the raw stream: an SSE comment names the tool too
                raw = (await http.post(server.url + "/messages", timeout=60, json={
                    "model": "m", "max_tokens": 64, "stream": True, "messages": user(CHAT)})).text  # fmt: skip
            assert f": sidecar narration: {GET_TIME}" in raw and "event: sidecar\n" in raw
            assert raw.rstrip().endswith('event: message_stop\ndata: {"type":"message_stop"}')
        replies = [Scripted(text=NARRATES), Scripted(calls=[(GET_TIME, {"timezone": "Asia/Tokyo"})]), Scripted(text="It is noon there.")]
        async with behind(tmp_path, replies * 2, on_narration="restart") as (up, server):
            c = client(server)
            async with c.messages.stream(model="scripted", max_tokens=64, messages=user(CHAT)) as stream:
                final = await stream.get_final_message()
            text = "".join(b.text for b in final.content)
            assert text.startswith(NARRATES[:10]) and text.endswith("It is noon there.")  # one message, blocks closed and numbered on
            first, second, third = up.messages
            assert "tools" not in first.body and GET_TIME in second.tool_names
            said = second.body["messages"][-1]
            assert said["role"] == "assistant" and NARRATES.startswith(said["content"]) and said["content"] == said["content"].rstrip()
            assert json.loads(results_of(third.body)[0]["content"])["timezone"] == "Asia/Tokyo"
            done = await c.messages.create(model="scripted", max_tokens=64, messages=user(CHAT))
            assert [b.text for b in done.content] == ["It is noon there."], "the client saw nothing of the first reply"
            [note] = done.model_extra["sidecar"]["narration"]
            assert note["action"] == "restart" and note["tools"][0]["name"] == GET_TIME
            assert server.app.metrics.value("sidecar_proxy_restarts_total") == 2

    run(body(), timeout=180)


def test_the_clients_own_tool_use_goes_back_to_it_and_learning_sees_each_fresh_turn(tmp_path):
    replies = [Scripted(calls=[(GET_TIME, {"timezone": "Asia/Tokyo"})]), Scripted(text="It is noon in Tokyo."), Scripted(text="Lovely!"),
               Scripted(text="Checking.", calls=[("lookup_order", {"number": "A-17"})]), Scripted(text="It has shipped.")]  # fmt: skip
    order = "where is my order A-17?"

    async def body():
        async with behind(tmp_path, replies) as (up, server):
            c = client(server)
            await c.messages.create(model="scripted", max_tokens=64, messages=user(TOKYO), tools=[OWN_TOOL])
            await c.messages.create(model="scripted", max_tokens=64, messages=user(CHAT), tools=[OWN_TOOL])
            async with c.messages.stream(model="scripted", max_tokens=64, messages=user(order), tools=[OWN_TOOL]) as stream:
                asked = await stream.get_final_message()
            assert asked.stop_reason == "tool_use" and [b.type for b in asked.content] == ["text", "tool_use"]
            use = asked.content[1]
            assert use.name == "lookup_order" and use.input == {"number": "A-17"}
            assert len(up.messages) == 4, "nothing is run for the client's own tool"
            done = await c.messages.create(model="scripted", max_tokens=64, tools=[OWN_TOOL], messages=[
                *user(order), {"role": "assistant", "content": [b.model_dump() for b in asked.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "shipped"}]}])  # fmt: skip
            assert done.content[0].text == "It has shipped."
            await server.app.learner.drain()
            return [(e.text, e.tool, e.session[:6]) for e in server.app.learner.log.examples()]

    examples = run(body(), timeout=180)
    assert examples == [(TOKYO, GET_TIME, "proxy:"), (CHAT, None, "proxy:"), ("where is my order A-17?", "lookup_order", "proxy:")], examples


# ---- the pure core ----------------------------------------------------------------------------


def test_a_message_stream_numbers_blocks_on_across_calls_and_holds_back_the_proxys_tool_uses():
    def events(*evs):
        return [shapes.Event(data=json.dumps(e), event=e["type"]) for e in evs]

    ours = lambda name: name.startswith("time__")  # noqa: E731
    stream = shapes.MessageStream({"model": "m"})
    first = stream.reply(ours)
    sent = []
    for ev in events({"type": "message_start", "message": {"id": "msg_1", "usage": {"input_tokens": 5, "output_tokens": 1}}},
                     {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}},
                     {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "hm"}},
                     {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "sig"}},
                     {"type": "content_block_stop", "index": 0},
                     {"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "t1", "name": "time__now", "input": {}}},
                     {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '{"tz": '}},
                     {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '"UTC"}'}},
                     {"type": "content_block_stop", "index": 1},
                     {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 9}},
                     {"type": "message_stop"}):  # fmt: skip
        sent += stream.feed(first, ev)[0]
    assert [s.split(b"\n")[0] for s in sent] == [b"event: message_start", b"event: content_block_start", b"event: content_block_delta",
                                                 b"event: content_block_delta", b"event: content_block_stop"]  # fmt: skip
    assert first.ended and first.usage == {"input_tokens": 5, "output_tokens": 9} and first.client_finish() == "end_turn"
    assert first.assistant_message()["content"] == [{"type": "thinking", "thinking": "hm", "signature": "sig"},
                                                    {"type": "tool_use", "id": "t1", "name": "time__now", "input": {"tz": "UTC"}}]  # fmt: skip
    stream.usage = shapes.add_usage(stream.usage, first.usage)
    second = stream.reply(ours)
    sent = []
    for ev in events({"type": "message_start", "message": {"id": "msg_2", "usage": {"input_tokens": 7, "output_tokens": 1}}},
                     {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                     {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "UTC noon"}}):  # fmt: skip
        sent += stream.feed(second, ev)[0]
    assert [json.loads(s.split(b"data: ")[1])["index"] for s in sent] == [1, 1], "the second call's block is the client's second"
    assert [json.loads(s.split(b"data: ")[1])["index"] for s in stream.between(second)] == [1], "a block left open is closed"
    with pytest.raises(shapes.NotAnEvent):
        stream.feed(second, shapes.Event(data="[1, 2]"))
    body = {"model": "m", "messages": user("x"), "tools": [OWN_TOOL]}
    mine = shapes.message_tool({"name": "lookup_order", "description": "other", "inputSchema": {"type": "object"}})
    added = shapes.message_tool({"name": "fs.read/file", "description": "Read", "inputSchema": {"type": "object", "properties": {}}})
    out = shapes.MESSAGES.with_tools(body, [mine, added])
    assert [t["name"] for t in out["tools"]] == ["lookup_order", "fs_read_file"] and out["tools"][0] is OWN_TOOL
    assert shapes.MESSAGES.called_names([{"role": "assistant", "content": [{"type": "tool_use", "name": "a"}, {"type": "text", "text": "b"}]}]) == ["a"]
    assert not shapes.MESSAGES.fresh_turn([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}])
    assert shapes.MESSAGES.user_turns([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]}]) == ["a"]
