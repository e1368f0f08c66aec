"""`find_tools` in `sidecar proxy`: the search tool the proxy offers beside the injected ones and
answers itself, so a turn whose inject missed has a way back.

The clients are the official `openai` and `anthropic` SDKs against a real proxy on 127.0.0.1, in
front of the scripted upstream of tests/test_proxy.py and tests/test_proxy_messages.py (their
fixtures and helpers), over real catalogs, the small real model and a real SQLite store. The
assertions are on what reached the upstream (find_tools offered or not, its call answered with
the found tools, the found tools' definitions in the re-asked request), what the SDKs saw (never
the proxy's search), the metrics and what learning from traffic kept.
"""

from __future__ import annotations

import json

from sidecar.proxy import search
from tests.conftest import CATALOGS
from tests.mcp_support import run
from tests.openai_upstream import Scripted, Upstream
from tests.test_proxy import CHAT, OWN_TOOL, TOKYO, client, proxying, tool_messages
from tests.test_proxy_messages import OWN_TOOL as OWN_MESSAGE_TOOL
from tests.test_proxy_messages import client as anthropic_client
from tests.test_proxy_messages import results_of, user

CATALOG = [str(CATALOGS / f"{name}.json") for name in ("google-maps", "weather", "notes", "time")]
QUERY = "server: maps; tool: search for places like parking garages near a landmark"
PLACES = "google-maps__maps_search_places"
FIND = search.FIND_TOOLS
SEARCHES = [Scripted(text="Let me look for a tool.", calls=[(FIND, {"query": QUERY})]),
            Scripted(calls=[(PLACES, {"query": "parking near the Louvre"})])]  # fmt: skip


def found_names(content: str) -> list[str]:
    return [t["name"] for t in json.loads(content)["tools"]]


def test_a_chat_search_is_answered_by_the_proxy_and_the_found_tool_reaches_the_model(tmp_path):
    """Streamed: the model searches, the proxy answers with the found tools' names and one-line
    descriptions and re-asks with their definitions; the client sees the reply and the found
    tool's call, never the search. The turn is learned with the tool the model then called."""
    asked = [{"role": "user", "content": "Where can I park near the Louvre tonight?"}]

    async def body():
        with Upstream(SEARCHES) as up:
            async with proxying(tmp_path, up.url, catalogs=CATALOG, find_tools="always") as server:
                stream = await client(server).chat.completions.create(model="scripted", messages=asked, tools=[OWN_TOOL], stream=True)
                chunks = [c async for c in stream]
                calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
                assert [c.function.name for c in calls if c.function.name] == [PLACES], "the search is the proxy's, not the client's"
                assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Let me look for a tool."
                first, second = up.chats
                assert FIND in first.tool_names and PLACES not in first.tool_names, first.tool_names
                [answer] = tool_messages(second.body)
                assert PLACES in found_names(answer["content"]), answer["content"]
                described = json.loads(answer["content"])["tools"]
                assert all("\n" not in t["description"] and len(t["description"]) <= search.DESCRIPTION_CHARS for t in described)
                assert second.body["messages"][-2]["tool_calls"][0]["function"]["name"] == FIND
                assert PLACES in second.tool_names and "lookup_order" in second.tool_names, second.tool_names
                full = next(t["function"] for t in second.body["tools"] if t["function"]["name"] == PLACES)
                assert full["parameters"]["properties"], "the found tool's full definition"
                assert server.app.metrics.value("sidecar_find_tools_total", outcome="found") == 1
                await server.app.learner.drain()
                return [(e.text, e.tool) for e in server.app.learner.log.examples()]

    assert run(body(), timeout=180) == [(asked[0]["content"], PLACES)]


def test_a_whole_chat_reply_after_a_search_shows_only_the_answer(tmp_path):
    replies = [Scripted(calls=[(FIND, {"query": QUERY})]), Scripted(text="There is a garage on Rue de Rivoli.")]

    async def body():
        with Upstream(replies) as up:
            async with proxying(tmp_path, up.url, catalogs=CATALOG, find_tools="always") as server:
                done = await client(server).chat.completions.create(model="scripted", messages=[{"role": "user", "content": CHAT}])
                assert done.choices[0].message.content == "There is a garage on Rue de Rivoli."
                assert done.choices[0].message.tool_calls is None and done.choices[0].finish_reason == "stop"
                assert PLACES in up.chats[1].tool_names

    run(body(), timeout=180)


def test_a_messages_search_is_answered_streamed_and_whole(tmp_path):
    """Anthropic's dialect: the search's tool_use is answered with a tool_result block, the found
    tool joins the re-asked request in Anthropic's shape, and the client gets one message."""

    async def body():
        with Upstream(SEARCHES + SEARCHES) as up:
            async with proxying(tmp_path, up.url, catalogs=CATALOG, find_tools="always") as server:
                sdk = anthropic_client(server)
                async with sdk.messages.stream(model="scripted", max_tokens=256, messages=user(CHAT), tools=[OWN_MESSAGE_TOOL]) as stream:
                    final = await stream.get_final_message()
                whole = await sdk.messages.create(model="scripted", max_tokens=256, messages=user(CHAT), tools=[OWN_MESSAGE_TOOL])
                for message in (final, whole):
                    assert [(b.type, getattr(b, "name", None)) for b in message.content] == [("text", None), ("tool_use", PLACES)], message.content
                    assert message.stop_reason == "tool_use"
                for first, second in (up.messages[0:2], up.messages[2:4]):
                    assert FIND in first.tool_names and PLACES not in first.tool_names
                    [answer] = results_of(second.body)
                    assert PLACES in found_names(answer["content"]) and not answer.get("is_error")
                    assert PLACES in second.tool_names
                    full = next(t for t in second.body["tools"] if t["name"] == PLACES)
                    assert full["input_schema"]["properties"]
                assert server.app.metrics.value("sidecar_find_tools_total", outcome="found") == 2

    run(body(), timeout=180)


def test_find_tools_is_offered_by_the_policy(tmp_path):
    """"never" offers none; "when_none" only to a request the inject added nothing to; a client
    tool of the same name is the client's."""
    own_find = {"type": "function", "function": {"name": FIND, "parameters": {"type": "object", "properties": {}}}}

    async def body():
        with Upstream([Scripted(text="ok")]) as up:
            async with proxying(tmp_path, up.url, catalogs=CATALOG, find_tools="never") as server:
                for text in (TOKYO, CHAT):
                    await client(server).chat.completions.create(model="scripted", messages=[{"role": "user", "content": text}])
                assert all(FIND not in r.tool_names for r in up.chats), [r.tool_names for r in up.chats]
            async with proxying(tmp_path, up.url, catalogs=CATALOG, find_tools="when_none") as server:
                for text in (TOKYO, CHAT):
                    await client(server).chat.completions.create(model="scripted", messages=[{"role": "user", "content": text}])
                tokyo, chat = up.chats[2:]
                assert "time__get_current_time" in tokyo.tool_names and FIND not in tokyo.tool_names, tokyo.tool_names
                assert chat.tool_names == [FIND], chat.tool_names
                await client(server).chat.completions.create(model="scripted", messages=[{"role": "user", "content": CHAT}], tools=[own_find])
                assert up.chats[-1].body["tools"] == [own_find]

    run(body(), timeout=180)


def test_searches_are_bounded_and_never_loop(tmp_path):
    """A model that never stops searching: `max_searches` are answered, then find_tools leaves
    the request and a further call is refused; the rounds end at `max_tool_rounds`."""

    async def body():
        with Upstream([Scripted(calls=[(FIND, {"query": QUERY})])]) as up:
            async with proxying(tmp_path, up.url, catalogs=CATALOG, find_tools="always", max_searches=2, max_tool_rounds=3) as server:
                done = await client(server).chat.completions.create(model="scripted", messages=[{"role": "user", "content": CHAT}])
                assert done.choices[0].finish_reason == "stop" and done.choices[0].message.tool_calls is None
                assert len(up.chats) == 4, "the first call and three rounds"
                assert [FIND in r.tool_names for r in up.chats] == [True, True, False, False]
                answers = [m["content"] for m in tool_messages(up.chats[-1].body)]
                assert PLACES in found_names(answers[0]) and PLACES in found_names(answers[1])
                assert "no more searches" in json.loads(answers[2])["error"]
                metrics = server.app.metrics
                assert metrics.value("sidecar_find_tools_total", outcome="found") == 2
                assert metrics.value("sidecar_find_tools_total", outcome="limit") == 1

    run(body(), timeout=180)


def test_the_query_is_ranked_without_its_labels_and_tools_are_described_in_one_line():
    assert search.query_text("server: maps; tool: find parking near a landmark") == "maps. find parking near a landmark"
    assert search.query_text("Server:github;Tool: open a pull request;") == "github. open a pull request"
    assert search.query_text(" ; ") == ""
    assert search.one_line("Get current weather.\n   It extracts the current conditions.") == "Get current weather."
    long = search.one_line("word " * 100)
    assert len(long) == search.DESCRIPTION_CHARS and long.endswith("…")
