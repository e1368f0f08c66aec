"""OpenAI Chat Completions shapes, without I/O: reading a request, adding tools to it, server-sent
events in and out, and one reply assembled from its chunks.

Everything here is pure (dicts and bytes in, dicts and bytes out), so the proxy's edge (app.py)
only moves bytes. The shapes are OpenAI's documented ones: a request's `tools` are
`{"type": "function", "function": {"name", "description", "parameters"}}`, a streamed reply is
`data: {chat.completion.chunk}` events ending with `data: [DONE]`, and a tool call streams as
`delta.tool_calls[{index, id, type, function: {name, arguments}}]` pieces whose `arguments`
concatenate.
"""

from __future__ import annotations

import re
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


def parse_request(raw: bytes) -> dict[str, Any]:
    """The request body as a dict, checked as far as the proxy relies on it; raises BadRequest
    naming the first field that is wrong. Fields it does not read pass through unchecked."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(None, f"the request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(None, "the request body must be a JSON object")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise BadRequest("model", "'model' is required: a model name (string)")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "'messages' is required: a non-empty array of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}]", f"messages[{i}] must be an object")
        if m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}].role", f"messages[{i}].role must be one of {', '.join(ROLES)}, not {m.get('role')!r}")
    if "stream" in body and body["stream"] is not None and not isinstance(body["stream"], bool):
        raise BadRequest("stream", "'stream' must be a boolean")
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


def user_turns(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The text of each user message with any, in order."""
    return [t for m in messages if m.get("role") == "user" and (t := text_of(m.get("content")).strip())]


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


def client_tool_names(body: Mapping[str, Any]) -> set[str]:
    return {t["function"]["name"] for t in body.get("tools") or ()}


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


def with_tools(body: Mapping[str, Any], added: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """`body` with `added` function tools after the client's own (which are kept, in their
    order); a tool whose name the client already uses is not added again."""
    own = list(body.get("tools") or ())
    taken = {t["function"]["name"] for t in own}
    extra = [t for t in added if t["function"]["name"] not in taken]
    return {**body, "tools": own + extra} if extra else dict(body)


# ---- server-sent events -----------------------------------------------------------------------


@dataclass
class Event:
    data: str | None = None  # the data lines joined with "\n" (None: a comment or an empty event)
    comment: str | None = None


class SSEReader:
    """Server-sent events from bytes as they arrive, in any pieces (CRLF, LF or CR line ends)."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []

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
                    out.append(Event(data="\n".join(self._data)))
                    self._data = []
            elif line.startswith(":"):
                out.append(Event(comment=line[1:].lstrip()))
            else:
                name, _, value = line.partition(":")
                if name == "data":
                    self._data.append(value[1:] if value.startswith(" ") else value)

    def end(self) -> list[Event]:
        """What a stream cut without a last blank line still held."""
        out = self.feed(b"\n\n") if self._buf or self._data else []
        return out


def sse(obj: Any) -> bytes:
    """One `data:` event: a JSON object, or "[DONE]"."""
    return b"data: " + (obj.encode() if isinstance(obj, str) else orjson.dumps(obj)) + b"\n\n"


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
class Reply:
    """One upstream reply (choice 0), streamed or whole: its text, its tool calls, and which of
    them are the proxy's to run (`ours(name)`). `feed` takes each streamed chunk and returns what
    the client gets of it: the chunk without the deltas of the proxy's own calls (the client
    could not run them), its own calls renumbered from 0, and without the finish chunk or the
    usage chunk, which the caller sends once it knows this was the last round."""

    ours: Callable[[str], bool]
    calls: dict[int, Call] = field(default_factory=dict)
    content: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    finish_chunk: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    _client_index: dict[int, int] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return "".join(self.content)

    @property
    def our_calls(self) -> list[Call]:
        return [c for c in self.calls.values() if c.ours]

    @property
    def client_calls(self) -> list[Call]:
        return [c for c in self.calls.values() if not c.ours]

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

    def assistant_message(self) -> dict[str, Any]:
        """The assistant's turn as the next upstream call must carry it: its text and every call."""
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in self.calls.values()]
        msg: dict[str, Any] = {"role": "assistant", "content": self.text or None}
        if calls:
            msg["tool_calls"] = calls
        return msg

    def client_finish(self) -> str | None:
        """The finish reason the client is told: "tool_calls" only when a call of its own is in
        the reply (the proxy's calls are not shown), else "stop" for a reply that ended in calls."""
        if self.finish_reason == "tool_calls" and not self.client_calls:
            return "stop"
        return self.finish_reason


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
