"""The two chat APIs the proxy speaks, without I/O: OpenAI Chat Completions and Anthropic Messages.
Reading a request, adding tools to it, server-sent events in and out, one reply assembled from
its chunks or events, and what the next upstream call carries after the proxy ran its tools.

Everything here is pure (dicts and bytes in, dicts and bytes out), so the proxy's edge (app.py)
only moves bytes, and its flow is written once against a `Dialect`: `CHAT` or `MESSAGES`.

OpenAI's documented shapes: a request's `tools` are `{"type": "function", "function": {"name",
"description", "parameters"}}`, a streamed reply is `data: {chat.completion.chunk}` events ending
with `data: [DONE]`, and a tool call streams as `delta.tool_calls[{index, id, type, function:
{name, arguments}}]` pieces whose `arguments` concatenate.

Anthropic's: `tools` are `{"name", "description", "input_schema"}`, `tool_choice` an object
(`auto`, `any`, `tool`, `none`), content is a list of blocks (`text`, `tool_use`, `tool_result`,
`thinking` ...), a streamed reply is named events (`message_start`, `content_block_start`,
`content_block_delta`, `content_block_stop`, `message_delta`, `message_stop`, `ping`, `error`)
whose `tool_use` input streams as `input_json_delta` pieces, and an error is
`{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
CHOICES = ("none", "auto", "required")
NAME_OK = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what OpenAI accepts as a function name


class BadRequest(ValueError):
    """A malformed request: 400, naming the field (`param`) as OpenAI does."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


def error_body(message: str, kind: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---- requests ---------------------------------------------------------------------------------


def _object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(None, f"the request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(None, "the request body must be a JSON object")
    return body


def _conversation(raw: bytes, roles: Sequence[str], at: Callable[[int], str]) -> dict[str, Any]:
    """What both APIs' requests must be: an object with a `model`, a non-empty `messages` array
    of messages (`at(i)` names one) whose roles are `roles`, and `stream` a boolean if given."""
    body = _object(raw)
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise BadRequest("model", "'model' is required: a model name (string)")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "'messages' is required: a non-empty array of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(at(i), f"{at(i)} must be an object")
        if m.get("role") not in roles:
            raise BadRequest(f"{at(i)}.role", f"{at(i)}.role must be one of {', '.join(roles)}, not {m.get('role')!r}")
    if "stream" in body and body["stream"] is not None and not isinstance(body["stream"], bool):
        raise BadRequest("stream", "'stream' must be a boolean")
    return body


def parse_request(raw: bytes) -> dict[str, Any]:
    """The request body as a dict, checked as far as the proxy relies on it; raises BadRequest
    naming the first field that is wrong. Fields it does not read pass through unchecked."""
    body = _conversation(raw, ROLES, lambda i: f"messages[{i}]")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequest("tools", "'tools' must be an array")
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
                raise BadRequest(f"tools[{i}]", f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise BadRequest(f"tools[{i}].function.name", f"tools[{i}].function.name is required")
    choice = body.get("tool_choice")
    if choice is not None and choice not in CHOICES:
        fn = choice.get("function") if isinstance(choice, dict) else None
        if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(fn, dict) and isinstance(fn.get("name"), str)):
            raise BadRequest("tool_choice", 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
    return body


def text_of(content: Any) -> str:
    """A message's text: a string, or the text parts of an array of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str))
    return ""


def _user_texts(messages: Sequence[Mapping[str, Any]]) -> list[tuple[int, str]]:
    return [(i, t) for i, m in enumerate(messages) if m.get("role") == "user" and (t := text_of(m.get("content")).strip())]


def user_turns(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The text of each user message with any, in order."""
    return [t for _, t in _user_texts(messages)]


def last_user_index(messages: Sequence[Mapping[str, Any]]) -> int:
    """Where the last user message with text is in `messages` (0 when there is none)."""
    return max((i for i, _ in _user_texts(messages)), default=0)


def called_names(messages: Iterable[Mapping[str, Any]]) -> list[str]:
    """Function names the assistant called earlier in the conversation, first call first."""
    names: dict[str, None] = {}
    for m in messages:
        if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            for c in m["tool_calls"]:
                name = (c.get("function") or {}).get("name") if isinstance(c, dict) else None
                if isinstance(name, str):
                    names.setdefault(name, None)
    return list(names)


def adds_tools(body: Mapping[str, Any]) -> bool:
    """Whether `tool_choice` lets the proxy add tools: not "none" (no tool may be called) and
    not one named function (the model must call that one: more tools only cost tokens)."""
    choice = body.get("tool_choice")
    return choice is None or choice in ("auto", "required")


def function_name(name: str) -> str:
    """A catalog name as an OpenAI function name ([A-Za-z0-9_-], at most 64 characters)."""
    return name if NAME_OK.match(name) else (re.sub(r"[^A-Za-z0-9_-]", "_", name)[:64] or "tool")


def function_tool(definition: Mapping[str, Any], name: str | None = None) -> dict[str, Any]:
    """An MCP tool definition (name, description, inputSchema) in OpenAI's function shape."""
    fn: dict[str, Any] = {"name": name or function_name(definition["name"])}
    if definition.get("description"):
        fn["description"] = definition["description"]
    fn["parameters"] = definition.get("inputSchema") or {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}


# ---- server-sent events -----------------------------------------------------------------------


@dataclass
class Event:
    data: str | None = None  # the data lines joined with "\n" (None: a comment or an empty event)
    comment: str | None = None
    event: str | None = None  # the event's name (`event:` line), when it has one


class SSEReader:
    """Server-sent events from bytes as they arrive, in any pieces (CRLF, LF or CR line ends)."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []
        self._event: str | None = None

    def feed(self, data: bytes) -> list[Event]:
        self._buf += data
        out: list[Event] = []
        while True:
            m = re.search(rb"\r\n|\r|\n", self._buf)
            if m is None or (m.group() == b"\r" and m.end() == len(self._buf)):  # a CR may be half of CRLF
                return out
            line, self._buf = self._buf[: m.start()].decode("utf-8", "replace"), self._buf[m.end() :]
            if not line:
                if self._data:
                    out.append(Event(data="\n".join(self._data), event=self._event))
                    self._data = []
                self._event = None
            elif line.startswith(":"):
                out.append(Event(comment=line[1:].lstrip()))
            else:
                name, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if name == "data":
                    self._data.append(value)
                elif name == "event":
                    self._event = value

    def end(self) -> list[Event]:
        """What a stream cut without a last blank line still held."""
        out = self.feed(b"\n\n") if self._buf or self._data else []
        return out


def sse(obj: Any, event: str | None = None) -> bytes:
    """One `data:` event: a JSON object, or "[DONE]"; named `event` when given (Anthropic's)."""
    name = b"event: " + event.encode() + b"\n" if event else b""
    return name + b"data: " + (obj.encode() if isinstance(obj, str) else orjson.dumps(obj)) + b"\n\n"


def sse_comment(text: str) -> bytes:
    return b": " + text.replace("\n", " ").encode() + b"\n\n"


# ---- replies ----------------------------------------------------------------------------------


@dataclass
class Call:
    id: str = ""
    name: str = ""
    arguments: str = ""
    ours: bool = False  # a tool the proxy added and runs itself


def add_usage(total: dict[str, Any] | None, usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Token counts of several upstream calls, added up (nested details too)."""
    if not usage:
        return total
    out = dict(total or {})
    for k, v in usage.items():
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, (int, float)):
            out[k] = out.get(k, 0) + v
        elif isinstance(v, Mapping):
            out[k] = add_usage(out.get(k) if isinstance(out.get(k), dict) else None, v)
    return out


@dataclass
class Answer:
    """What both APIs' replies have: text, tool calls (which of them are the proxy's to run:
    `ours(name)`), why it ended, usage; `ended` once the stream's last event came."""

    ours: Callable[[str], bool]
    calls: dict[int, Call] = field(default_factory=dict)
    content: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    ended: bool = False

    CALLED = "tool_calls"  # the finish reason of a reply that ends in tool calls
    STOP = "stop"  # what the client is told instead when none of those calls is its own

    @property
    def text(self) -> str:
        return "".join(self.content)

    @property
    def our_calls(self) -> list[Call]:
        return [c for c in self.calls.values() if c.ours]

    @property
    def client_calls(self) -> list[Call]:
        return [c for c in self.calls.values() if not c.ours]

    def client_finish(self) -> str | None:
        """The finish reason the client is told: that of calls only when a call of its own is in
        the reply (the proxy's calls are not shown), else that of a reply that stopped."""
        if self.finish_reason == self.CALLED and not self.client_calls:
            return self.STOP
        return self.finish_reason


@dataclass
class Reply(Answer):
    """One upstream reply (choice 0), streamed or whole: its text, its tool calls, and which of
    them are the proxy's to run (`ours(name)`). `feed` takes each streamed chunk and returns what
    the client gets of it: the chunk without the deltas of the proxy's own calls (the client
    could not run them), its own calls renumbered from 0, and without the finish chunk or the
    usage chunk, which the caller sends once it knows this was the last round."""

    finish_chunk: dict[str, Any] | None = None
    shown: dict[str, Any] | None = None  # a whole reply's message as the client gets it
    _client_index: dict[int, int] = field(default_factory=dict)

    def feed(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        if chunk.get("usage"):
            self.usage = add_usage(None, chunk["usage"])
            chunk = {**chunk, "usage": None}
        choices = chunk.get("choices") or []
        if not choices:
            return None if "usage" in chunk else chunk
        out_choices = []
        for choice in choices:
            if choice.get("index", 0) != 0:  # n > 1: other choices pass as they are
                out_choices.append(choice)
                continue
            delta = dict(choice.get("delta") or {})
            if isinstance(delta.get("content"), str):
                self.content.append(delta["content"])
            if isinstance(delta.get("tool_calls"), list):
                kept = [c for c in (self._tool_delta(d) for d in delta["tool_calls"]) if c is not None]
                if kept:
                    delta["tool_calls"] = kept
                else:
                    del delta["tool_calls"]
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.finish_chunk = {**chunk, "choices": [{**choice, "delta": delta}]}
                continue
            if not delta and choice.get("delta"):  # it held only the proxy's calls
                continue
            out_choices.append({**choice, "delta": delta})
        return {**chunk, "choices": out_choices} if out_choices else None

    def _tool_delta(self, d: Mapping[str, Any]) -> dict[str, Any] | None:
        i = d.get("index", 0)
        fn = d.get("function") or {}
        call = self.calls.get(i)
        if call is None:
            name = fn.get("name") or ""
            call = self.calls[i] = Call(ours=self.ours(name))
            if not call.ours:
                self._client_index[i] = len(self._client_index)
        call.id = call.id or d.get("id") or ""
        call.name = call.name or fn.get("name") or ""  # named in its first piece (some servers repeat it)
        call.arguments += fn.get("arguments") or ""
        if call.ours:
            return None
        return {**d, "index": self._client_index[i]}

    def take_message(self, message: Mapping[str, Any], finish_reason: str | None, usage: Mapping[str, Any] | None) -> dict[str, Any]:
        """A whole (non-streamed) reply's message: recorded like a stream's, and returned as the
        client gets it, without the proxy's own calls."""
        self.usage = add_usage(None, usage)
        self.finish_reason = finish_reason
        if isinstance(message.get("content"), str):
            self.content.append(message["content"])
        kept = []
        for i, c in enumerate(message.get("tool_calls") or ()):
            fn = c.get("function") or {}
            call = self.calls[i] = Call(c.get("id") or "", fn.get("name") or "", fn.get("arguments") or "", self.ours(fn.get("name") or ""))
            if not call.ours:
                kept.append(c)
        out = {k: v for k, v in message.items() if k != "tool_calls"}
        if kept:
            out["tool_calls"] = kept
        return out

    def take_whole(self, out: Mapping[str, Any]) -> None:
        choice = out["choices"][0]
        self.shown = self.take_message(choice.get("message") or {}, choice.get("finish_reason"), out.get("usage"))

    def assistant_message(self) -> dict[str, Any]:
        """The assistant's turn as the next upstream call must carry it: its text and every call."""
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in self.calls.values()]
        msg: dict[str, Any] = {"role": "assistant", "content": self.text or None}
        if calls:
            msg["tool_calls"] = calls
        return msg


def arguments_of(call: Call) -> dict[str, Any]:
    """A call's arguments as an object; raises ValueError naming what is wrong."""
    if not call.arguments.strip():
        return {}
    try:
        args = orjson.loads(call.arguments)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"the arguments of {call.name} are not JSON: {e}") from None
    if not isinstance(args, dict):
        raise ValueError(f"the arguments of {call.name} must be a JSON object")
    return args


def tool_message(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


class NotAnEvent(ValueError):
    """A streamed event that is not what the API sends (not JSON, not an object): skipped, counted."""


def _json_event(ev: Event) -> dict[str, Any]:
    try:
        obj = orjson.loads(ev.data or "")
    except orjson.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict):
        raise NotAnEvent(ev.data)
    return obj


class ChatStream:
    """The client's OpenAI event stream over one or more upstream calls: every chunk under the
    first call's completion id; the finish chunk, the usage chunk (when asked for) and `[DONE]`
    once, after the last call, with the usage of every call added up."""

    def __init__(self, body: Mapping[str, Any]):
        self.body = body
        self.first_id: str | None = None
        self.usage: dict[str, Any] | None = None
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

    def reply(self, ours: Callable[[str], bool]) -> Reply:
        return Reply(ours)

    def feed(self, reply: Reply, ev: Event) -> tuple[list[bytes], bool]:
        """What the client gets of one upstream event, and whether the upstream failed (its error
        event is then the last thing sent). Raises NotAnEvent."""
        if ev.data is None or reply.ended:
            return [], False
        if ev.data.strip() == "[DONE]":
            reply.ended = True
            return [], False
        chunk = _json_event(ev)
        if "error" in chunk:  # the upstream failed mid-stream: the client is told so
            return [sse(chunk)], True
        self.first_id = self.first_id or chunk.get("id")
        out = reply.feed(chunk)
        return ([sse({**out, "id": self.first_id})] if out is not None else []), False

    def narrated(self, notes: list[dict[str, Any]]) -> list[bytes]:
        """Narrated tools: an SSE comment and a chunk with no choice whose `sidecar.narration`
        names them (a client that wants to decide reads it)."""
        out = []
        for note in notes:
            out.append(sse_comment(f"sidecar narration: {', '.join(t['function']['name'] for t in note['tools'])}"))
            out.append(sse({"id": self.first_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.body.get("model"),
                            "choices": [], "sidecar": {"narration": note}}))  # fmt: skip
        return out

    def between(self, reply: Reply) -> list[bytes]:
        """What closes a reply that another call continues: nothing, chunks carry no structure."""
        return []

    def finish(self, reply: Reply) -> list[bytes]:
        finish = reply.finish_chunk or {"id": self.first_id, "object": "chat.completion.chunk", "created": int(time.time()),
                                        "model": self.body.get("model"), "choices": [{"index": 0, "delta": {}, "finish_reason": None}]}  # fmt: skip
        choices = [{**c, "finish_reason": reply.client_finish() or "stop"} if c.get("index", 0) == 0 else c for c in finish["choices"]]
        out = [sse({**finish, "id": self.first_id, "choices": choices})]
        if self.include_usage and self.usage is not None:
            out.append(sse({"id": self.first_id, "object": "chat.completion.chunk", "created": finish.get("created"),
                            "model": finish.get("model"), "choices": [], "usage": self.usage}))  # fmt: skip
        return [*out, sse("[DONE]")]

    def error(self, body: Mapping[str, Any]) -> bytes:
        return sse(body)


# ---- Anthropic Messages -----------------------------------------------------------------------

MESSAGE_ROLES = ("user", "assistant")
MESSAGE_CHOICES = ("auto", "any", "tool", "none")
# The proxy's own error kinds in Anthropic's names (https status codes as Anthropic documents them)
MESSAGE_ERRORS = {"upstream_timeout": "timeout_error", "request_too_large": "request_too_large"}


def message_error_body(message: str, kind: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """An error in Anthropic's shape: {"type": "error", "error": {"type", "message"}}; the
    proxy's own upstream failures are `api_error` (502) or `timeout_error` (504)."""
    kind = MESSAGE_ERRORS.get(code or "", "api_error" if kind == "upstream_error" else kind)
    return {"type": "error", "error": {"type": kind, "message": message}}


def parse_messages_request(raw: bytes) -> dict[str, Any]:
    """A Messages request body as a dict, checked as far as the proxy relies on it; raises
    BadRequest naming the first field that is wrong. What it does not read (`max_tokens`,
    `system`, ...) is the upstream's to check. Fields are named as Anthropic names them (`messages.2.role`)."""
    body = _conversation(raw, MESSAGE_ROLES, lambda i: f"messages.{i}")
    for i, m in enumerate(body["messages"]):
        content = m.get("content")
        if not isinstance(content, (str, list)) or isinstance(content, list) and not all(isinstance(b, dict) and isinstance(b.get("type"), str) for b in content):
            raise BadRequest(f"messages.{i}.content", f"messages.{i}.content must be a string or an array of content blocks, each with a type")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequest("tools", "'tools' must be an array")
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
                raise BadRequest(f"tools.{i}.name", f"tools.{i}.name is required")
    choice = body.get("tool_choice")
    if choice is not None and not (isinstance(choice, dict) and choice.get("type") in MESSAGE_CHOICES
                                   and (choice["type"] != "tool" or isinstance(choice.get("name"), str))):  # fmt: skip
        raise BadRequest("tool_choice", 'tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or {"type": "tool", "name": ...}')
    return body


def message_tool(definition: Mapping[str, Any], name: str | None = None) -> dict[str, Any]:
    """An MCP tool definition (name, description, inputSchema) in Anthropic's shape."""
    tool: dict[str, Any] = {"name": name or function_name(definition["name"])}
    if definition.get("description"):
        tool["description"] = definition["description"]
    tool["input_schema"] = definition.get("inputSchema") or {"type": "object", "properties": {}}
    return tool


def _blocks(message: Mapping[str, Any], kind: str) -> list[dict[str, Any]]:
    content = message.get("content")
    return [b for b in content if isinstance(b, dict) and b.get("type") == kind] if isinstance(content, list) else []


@dataclass
class MessageReply(Answer):
    """One upstream Messages reply, streamed or whole: its blocks as built from the events (so
    the next call can carry the assistant's turn: thinking with its signature, text, tool uses),
    its text, its tool uses. `feed` records one event and says whether the client may see it:
    not the blocks of the proxy's own calls, not the message's envelope (start, delta, stop),
    which the stream sends once for all calls."""

    CALLED = "tool_use"
    STOP = "end_turn"

    blocks: dict[int, dict[str, Any]] = field(default_factory=dict)
    message: dict[str, Any] | None = None  # message_start's message (or the whole reply)
    stop_sequence: str | None = None
    shown: list[dict[str, Any]] = field(default_factory=list)  # a whole reply's blocks as the client gets them

    def _ours(self, index: Any) -> bool:
        call = self.calls.get(index)
        return call is not None and call.ours

    def feed(self, event: Mapping[str, Any]) -> bool:
        kind, i = event.get("type"), event.get("index", 0)
        if kind == "message_start":
            self.message = dict(event.get("message") or {})
            self.usage = add_usage(None, self.message.get("usage"))
            return False
        if kind == "content_block_start":
            block = self.blocks[i] = dict(event.get("content_block") or {})
            if block.get("type") == "tool_use":
                name = block.get("name") or ""
                self.calls[i] = Call(block.get("id") or "", name, orjson.dumps(block["input"]).decode() if block.get("input") else "", self.ours(name))
            return not self._ours(i)
        if kind == "content_block_delta":
            self._delta(self.blocks.setdefault(i, {}), i, event.get("delta") or {})
            return not self._ours(i)
        if kind == "content_block_stop":
            return not self._ours(i)
        if kind == "message_delta":
            delta = event.get("delta") or {}
            self.finish_reason, self.stop_sequence = delta.get("stop_reason"), delta.get("stop_sequence")
            counts = {k: v for k, v in (event.get("usage") or {}).items() if v is not None}
            self.usage = {**(self.usage or {}), **counts}  # output_tokens counts the message so far: the latest stands
            return False
        if kind == "message_stop":
            self.ended = True
            return False
        return True  # ping, and what a later version of the API adds

    def _delta(self, block: dict[str, Any], i: Any, delta: Mapping[str, Any]) -> None:
        kind = delta.get("type")
        if kind == "text_delta" and isinstance(delta.get("text"), str):
            self.content.append(delta["text"])
            block["text"] = block.get("text", "") + delta["text"]
        elif kind == "input_json_delta" and i in self.calls:
            self.calls[i].arguments += delta.get("partial_json") or ""
        elif kind == "thinking_delta":
            block["thinking"] = block.get("thinking", "") + (delta.get("thinking") or "")
        elif kind == "signature_delta":
            block["signature"] = delta.get("signature")
        elif kind == "citations_delta" and delta.get("citation") is not None:
            block.setdefault("citations", []).append(delta["citation"])

    def take_whole(self, out: Mapping[str, Any]) -> None:
        """A whole reply: recorded like a stream's; `shown` is its content as the client gets it."""
        self.message = dict(out)
        self.usage = add_usage(None, out.get("usage"))
        self.finish_reason, self.stop_sequence = out.get("stop_reason"), out.get("stop_sequence")
        for i, block in enumerate(out.get("content") or ()):
            self.blocks[i] = dict(block)
            if block.get("type") == "text" and isinstance(block.get("text"), str):
                self.content.append(block["text"])
            if block.get("type") == "tool_use":
                name = block.get("name") or ""
                self.calls[i] = Call(block.get("id") or "", name, orjson.dumps(block.get("input") or {}).decode(), self.ours(name))
            if not self._ours(i):
                self.shown.append(block)

    def assistant_message(self) -> dict[str, Any]:
        """The assistant's turn as the next upstream call must carry it: every block in order
        (a text block only when it has text), each tool use with its input as an object."""
        content = []
        for i, block in sorted(self.blocks.items()):
            if block.get("type") == "tool_use" and i in self.calls:
                try:
                    block = {**block, "input": arguments_of(self.calls[i])}
                except ValueError:
                    block = {**block, "input": {}}
            elif block.get("type") == "text" and not block.get("text"):
                continue
            content.append(block)
        return {"role": "assistant", "content": content}


class MessageStream:
    """The client's Anthropic event stream over one or more upstream calls: one message (the
    first call's `message_start`), the content blocks of every call numbered on from one call to
    the next, the proxy's own tool uses left out, and one `message_delta` (stop reason, usage of
    every call added up) and `message_stop` after the last call."""

    def __init__(self, body: Mapping[str, Any]):
        self.body = body
        self.started = False
        self.usage: dict[str, Any] | None = None
        self.next = 0  # the client's next block index
        self.index: dict[Any, int] = {}  # this call's block index -> the client's
        self.open: set[int] = set()  # the client's blocks started and not stopped

    def reply(self, ours: Callable[[str], bool]) -> MessageReply:
        self.index = {}
        return MessageReply(ours)

    def feed(self, reply: MessageReply, ev: Event) -> tuple[list[bytes], bool]:
        if ev.data is None or reply.ended:
            return [], False
        event = _json_event(ev)
        kind = event.get("type") or ev.event
        if kind == "error":  # the upstream failed mid-stream: its error event, as it is, ends the stream
            return [self.error(event)], True
        shown = reply.feed(event)
        if kind == "message_start" and not self.started:
            self.started = True
            return [sse(event, "message_start")], False
        if not shown:
            return [], False
        if "index" in event:
            if event["index"] not in self.index:
                self.index[event["index"]] = self.next
                self.next += 1
            i = self.index[event["index"]]
            (self.open.discard if kind == "content_block_stop" else self.open.add)(i)
            event = {**event, "index": i}
        return [sse(event, kind)], False

    def narrated(self, notes: list[dict[str, Any]]) -> list[bytes]:
        """Narrated tools: an SSE comment and a `sidecar` event whose `narration` names them
        (SDKs pass an event type they do not know, or skip it)."""
        out = []
        for note in notes:
            out.append(sse_comment(f"sidecar narration: {', '.join(t['name'] for t in note['tools'])}"))
            out.append(sse({"type": "sidecar", "narration": note}, "sidecar"))
        return out

    def between(self, reply: MessageReply) -> list[bytes]:
        """The client's blocks a stopped call left open, closed before the next call's begin."""
        out = [sse({"type": "content_block_stop", "index": i}, "content_block_stop") for i in sorted(self.open)]
        self.open.clear()
        return out

    def finish(self, reply: MessageReply) -> list[bytes]:
        usage = {"output_tokens": 0, **(self.usage or {})}
        delta = {"type": "message_delta", "delta": {"stop_reason": reply.client_finish() or MessageReply.STOP, "stop_sequence": reply.stop_sequence},
                 "usage": usage}  # fmt: skip
        return [*self.between(reply), sse(delta, "message_delta"), sse({"type": "message_stop"}, "message_stop")]

    def error(self, body: Mapping[str, Any]) -> bytes:
        return sse(body, "error")


# ---- the two dialects -------------------------------------------------------------------------


class Dialect:
    """What the proxy's flow needs to know of one API; `CHAT` and `MESSAGES` are the two."""

    name = ""
    path = ""  # the upstream's endpoint, after its base URL
    Stream: Callable[[Mapping[str, Any]], Any]

    def tool_name(self, tool: Mapping[str, Any]) -> str:
        raise NotImplementedError

    def client_tool_names(self, body: Mapping[str, Any]) -> set[str]:
        return {self.tool_name(t) for t in body.get("tools") or ()}

    def with_tools(self, body: Mapping[str, Any], added: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """`body` with `added` tools after the client's own (which are kept, in their order); a
        tool whose name the client already uses is not added again."""
        own = list(body.get("tools") or ())
        taken = {self.tool_name(t) for t in own}
        extra = [t for t in added if self.tool_name(t) not in taken]
        return {**body, "tools": own + extra} if extra else dict(body)

    def user_turns(self, messages: Sequence[Mapping[str, Any]]) -> list[str]:
        return user_turns(messages)

    def partial(self, text: str) -> list[dict[str, Any]]:
        """The reply so far as the restarted call carries it (an assistant message)."""
        return [{"role": "assistant", "content": text}] if text else []


class ChatCompletions(Dialect):
    """OpenAI Chat Completions: /v1/chat/completions."""

    name, path, Stream, Reply = "chat", "/chat/completions", ChatStream, Reply
    parse, error, tool = staticmethod(parse_request), staticmethod(error_body), staticmethod(function_tool)
    adds_tools, called_names = staticmethod(adds_tools), staticmethod(called_names)

    def tool_name(self, tool: Mapping[str, Any]) -> str:
        return tool["function"]["name"]

    def agent(self, body: Mapping[str, Any]) -> str | None:
        return body["user"] if isinstance(body.get("user"), str) else None

    def fresh_turn(self, messages: Sequence[Mapping[str, Any]]) -> bool:
        return bool(messages) and messages[-1].get("role") == "user"

    def results(self, reply: Reply, results: Sequence[tuple[Call, str, bool]]) -> list[dict[str, Any]]:
        """The messages after a reply whose calls the proxy ran: the assistant's calls, a tool message each."""
        return [reply.assistant_message(), *(tool_message(call.id, content) for call, content, _ in results)]

    def whole_error(self, out: Any) -> str | None:
        ok = isinstance(out, dict) and isinstance(out.get("choices"), list) and out["choices"]
        return None if ok else "the upstream's answer has no choices"

    def answer(self, out: dict[str, Any], reply: Reply, earlier: Sequence[Reply], usage: dict[str, Any] | None) -> dict[str, Any]:
        """The whole reply the client gets: the last call's message without the proxy's calls."""
        choice = out["choices"][0]
        out["choices"] = [{**choice, "message": reply.shown, "finish_reason": reply.client_finish()}, *out["choices"][1:]]
        if usage is not None:
            out["usage"] = usage
        return out

    def refused(self, status: int, content: bytes) -> dict[str, Any]:
        """An upstream's error answer as an error event (after a stream began)."""
        body = _loads(content)
        return body if isinstance(body, dict) and "error" in body else error_body(f"the upstream answered {status}", "upstream_error", code=str(status))


class Messages(Dialect):
    """Anthropic Messages: /v1/messages."""

    name, path, Stream, Reply = "messages", "/messages", MessageStream, MessageReply
    parse, error, tool = staticmethod(parse_messages_request), staticmethod(message_error_body), staticmethod(message_tool)

    def tool_name(self, tool: Mapping[str, Any]) -> str:
        return tool["name"]

    def agent(self, body: Mapping[str, Any]) -> str | None:
        user = (body.get("metadata") or {}).get("user_id") if isinstance(body.get("metadata"), dict) else None
        return user if isinstance(user, str) else None

    def adds_tools(self, body: Mapping[str, Any]) -> bool:
        """Not with tool_choice "none" (no tool may be called) nor "tool" (the model must call that one)."""
        choice = body.get("tool_choice")
        return choice is None or choice.get("type") in ("auto", "any")

    def called_names(self, messages: Iterable[Mapping[str, Any]]) -> list[str]:
        names = [b.get("name") for m in messages if m.get("role") == "assistant" for b in _blocks(m, "tool_use")]
        return list(dict.fromkeys(n for n in names if isinstance(n, str)))

    def fresh_turn(self, messages: Sequence[Mapping[str, Any]]) -> bool:
        """Ends with the user's own words, not with the results of tool uses."""
        return bool(messages) and messages[-1].get("role") == "user" and not _blocks(messages[-1], "tool_result")

    def partial(self, text: str) -> list[dict[str, Any]]:
        text = text.rstrip()  # a final assistant turn may not end in white space
        return [{"role": "assistant", "content": text}] if text else []

    def results(self, reply: MessageReply, results: Sequence[tuple[Call, str, bool]]) -> list[dict[str, Any]]:
        """The assistant's turn, then a user turn of one `tool_result` block per tool use run."""
        blocks = [{"type": "tool_result", "tool_use_id": call.id, "content": content, **({"is_error": True} if failed else {})}
                  for call, content, failed in results]  # fmt: skip
        return [reply.assistant_message(), {"role": "user", "content": blocks}]

    def whole_error(self, out: Any) -> str | None:
        return None if isinstance(out, dict) and isinstance(out.get("content"), list) else "the upstream's answer is not a message with content"

    def answer(self, out: dict[str, Any], reply: MessageReply, earlier: Sequence[MessageReply], usage: dict[str, Any] | None) -> dict[str, Any]:
        """The whole reply the client gets: one message with the blocks of every call (the
        proxy's tool uses left out), the last call's stop reason, usage added up."""
        out["content"] = [b for r in (*earlier, reply) for b in r.shown]
        out["stop_reason"] = reply.client_finish()
        if usage is not None:
            out["usage"] = {**(out.get("usage") or {}), **usage}
        return out

    def refused(self, status: int, content: bytes) -> dict[str, Any]:
        body = _loads(content)
        return body if isinstance(body, dict) and body.get("type") == "error" else message_error_body(f"the upstream answered {status}", "upstream_error")


CHAT, MESSAGES = ChatCompletions(), Messages()


def _loads(content: bytes) -> Any:
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        return None


with_tools, client_tool_names = CHAT.with_tools, CHAT.client_tool_names  # OpenAI's, as bench/ and tests/ call them
