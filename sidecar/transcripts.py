"""Reading chat transcripts for `replay`, in the shapes chats are really logged in.

Each file's shape is detected, and every shape is read into the same `Conversation`s of
`Message`s (user turns, assistant replies with the tools they called, tool results):

- ours: JSONL, one message a line, `{"conversation", "role", "content", "chunks"?, "tool_calls"?}`;
- OpenAI chat `messages`: a JSON file holding `{"messages": [...]}`, a list of those, or a bare
  list of messages, or JSONL with one `{"messages": [...]}` a line. Assistant `content` may be
  null, "" or a list of text parts; `tool_calls[].function` has `name` and `arguments` (a JSON
  string); `role: "tool"` messages are results; `system`/`developer` messages are left out;
- Anthropic messages, in the same containers: `content` blocks `text`, `tool_use` {name,
  input} and `tool_result`, and an optional top-level `system` (left out).

An assistant turn without text that only calls tools is kept: its calls are the ground truth
for the user turn before it. A bad file is refused with `file:line` (JSONL) or the file and a
JSON path (one JSON document), so the user can find it.
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import orjson

from .core.catalog import Catalog


class TranscriptError(ValueError):
    """A transcript is unusable; the message names file:line, or the file and a JSON path."""


class ToolCall(msgspec.Struct, frozen=True):
    name: str
    arguments: dict[str, Any] = {}


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One message of a conversation, and one line of our own JSONL shape."""

    conversation: str | int
    role: Literal["user", "assistant", "tool"]
    content: str = ""
    chunks: list[str] | None = None
    tool_calls: list[ToolCall] | None = None


Format = Literal["sidecar", "openai", "anthropic"]


class Conversation(msgspec.Struct):
    id: str
    messages: list[Message]
    origin: str  # file, for reports
    format: Format = "sidecar"  # the shape it was read from


# The chat shapes, as decoded. Content parts are tagged by "type"; an unknown type is refused
# with its JSON path. Parts that carry no text for the sidecar (images, audio, files,
# thinking) are accepted and skipped.


class _Text(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class _Refusal(msgspec.Struct, tag_field="type", tag="refusal"):  # OpenAI: the assistant's text
    refusal: str


class _ToolUse(msgspec.Struct, tag_field="type", tag="tool_use"):  # Anthropic
    name: str
    input: dict[str, Any] = {}


def _skipped(kind: str) -> type:
    return msgspec.defstruct(f"_{kind}", [], tag_field="type", tag=kind)


_OpenAISkipped = tuple(map(_skipped, ("image_url", "input_audio", "file")))
_Image, _Document, _Thinking, _RedactedThinking = map(_skipped, ("image", "document", "thinking", "redacted_thinking"))


class _ToolResult(msgspec.Struct, tag_field="type", tag="tool_result"):  # Anthropic
    content: str | list[_Text | _Image | _Document] | None = None


_Part = (_Text | _Refusal | _OpenAISkipped[0] | _OpenAISkipped[1] | _OpenAISkipped[2]
         | _ToolUse | _ToolResult | _Image | _Document | _Thinking | _RedactedThinking)  # fmt: skip


class _Function(msgspec.Struct):
    name: str
    arguments: str | dict[str, Any] = ""


class _OpenAICall(msgspec.Struct):
    function: _Function


class _ChatMessage(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[_Part] | None = None
    tool_calls: list[_OpenAICall] | None = None
    function_call: _Function | None = None  # OpenAI's older single call


class _ChatDoc(msgspec.Struct):
    messages: list[_ChatMessage]
    id: str | int | None = None
    system: str | list[_Text] | None = None  # Anthropic's system prompt, left out


@dataclass(frozen=True)
class _At:
    """Where a value sits: `file:line` and/or a JSON path within that line or document."""

    prefix: str
    path: str = "$"

    def sub(self, suffix: str) -> _At:
        return _At(self.prefix, self.path + suffix)

    def error(self, msg: str) -> TranscriptError:
        return TranscriptError(f"{self.prefix}: {self.path}: {msg}" if self.path != "$" else f"{self.prefix}: {msg}")

    def invalid(self, e: msgspec.ValidationError) -> TranscriptError:
        """msgspec's "X - at `$.a[0]`" as "file: <our path>.a[0]: X"."""
        m = re.fullmatch(r"(.*) - at `\$(.*)`", str(e), re.S)
        return self.sub(m.group(2)).error(m.group(1)) if m else self.error(str(e))


@dataclass(frozen=True)
class _Chat:
    """One OpenAI/Anthropic conversation of a file, with where it and its messages sit."""

    doc: _ChatDoc
    at: _At
    messages_at: _At  # `messages_at.path + [j]` is message j
    ordinal: int  # 1-based, within the file
    alone: bool  # the file's only conversation (a single JSON document)


@dataclass(frozen=True)
class _Line:
    """One line of our JSONL shape."""

    message: Message
    at: _At


def read_transcripts(paths: Sequence[str | pathlib.Path], catalog: Catalog | None = None) -> list[Conversation]:
    """Conversations in file order, each file's shape detected. Our JSONL's messages of one
    conversation may span files; other shapes name their conversations by their `id`, else
    by file (`name`, or `name#N` for the Nth of several). With `catalog`, every tool call
    must name one of its tools."""
    convs: dict[str, Conversation] = {}
    for path in map(pathlib.Path, paths):
        for item in _items(path):
            if isinstance(item, _Line):
                _check(item.at, item.message, catalog)
                cid = str(item.message.conversation)
                conv = convs.setdefault(cid, Conversation(cid, [], str(path)))
                if conv.format != "sidecar":
                    raise item.at.error(f"conversation {cid!r} is already an {conv.format} conversation of {conv.origin}")
                conv.messages.append(item.message)
                continue
            cid = _conversation_id(item, path, convs)
            fmt = _format(item)
            messages: list[Message] = []
            for j, m in enumerate(item.doc.messages):
                at = item.messages_at.sub(f"[{j}]")
                for msg in _from_chat(m, cid, at):
                    _check(at, msg, catalog)
                    messages.append(msg)
            if not messages:
                raise item.at.error("no user or assistant messages")
            convs[cid] = Conversation(cid, messages, str(path), fmt)
    if not convs:
        raise TranscriptError(f"{', '.join(map(str, paths))}: no messages")
    return list(convs.values())


def _items(path: pathlib.Path) -> Iterator[_Chat | _Line]:
    """A file's conversations (one JSON document) or lines (JSONL), decoded."""
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise TranscriptError(f"{path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise TranscriptError(f"{path}: not UTF-8 (byte {e.start})") from None
    lines = text.splitlines()
    first = next((no for no, line in enumerate(lines, 1) if line.strip()), None)
    if first is None:
        raise TranscriptError(f"{path}: empty file")
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError as e:
        try:
            orjson.loads(lines[first - 1])
        except orjson.JSONDecodeError:  # not JSONL either: report where the document broke
            raise TranscriptError(f"{path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg})") from None
    else:
        if not (isinstance(doc, dict) and "conversation" in doc):  # a one-line file of ours is JSONL
            one_line = sum(bool(line.strip()) for line in lines) == 1
            yield from _document(_At(f"{path}:{first}" if one_line else str(path)), doc)
            return
    ordinal = 0
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        at = _At(f"{path}:{no}")
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            raise at.error(f"not valid JSON ({e.msg})") from None
        if isinstance(obj, dict) and "messages" in obj:
            ordinal += 1
            yield _Chat(_decode(obj, _ChatDoc, at), at, at.sub(".messages"), ordinal, alone=False)
        elif isinstance(obj, dict) and "conversation" in obj:
            msg = _decode(obj, Message, at)
            if msg.chunks is not None and "".join(msg.chunks) != msg.content:
                raise at.error("chunks do not join to content")
            yield _Line(msg, at)
        elif isinstance(obj, dict) and "role" in obj:
            raise at.error('a message without "conversation": a line holds one of our messages '
                           '{"conversation", "role", ...} or one whole conversation {"messages": [...]}')  # fmt: skip
        else:
            raise at.error('not a transcript line: expected {"messages": [...]} or {"conversation", "role", "content", ...}')


def _document(at: _At, doc: Any) -> Iterator[_Chat]:
    if isinstance(doc, dict) and "messages" in doc:
        yield _Chat(_decode(doc, _ChatDoc, at), at, at.sub(".messages"), 1, alone=True)
    elif isinstance(doc, list) and doc and all(isinstance(c, dict) and "messages" in c for c in doc):
        for i, c in enumerate(doc):
            yield _Chat(_decode(c, _ChatDoc, at.sub(f"[{i}]")), at.sub(f"[{i}]"), at.sub(f"[{i}].messages"), i + 1, alone=len(doc) == 1)
    elif isinstance(doc, list) and doc and all(isinstance(m, dict) and "role" in m for m in doc):
        yield _Chat(_ChatDoc(_decode(doc, list[_ChatMessage], at)), at, at, 1, alone=True)
    else:
        raise at.error('not a transcript: expected {"messages": [...]}, a list of those, a list of messages, '
                       'or JSONL lines')  # fmt: skip


def _decode(obj: Any, typ: Any, at: _At) -> Any:
    try:
        return msgspec.convert(obj, typ)
    except msgspec.ValidationError as e:
        raise at.invalid(e) from None


def _conversation_id(chat: _Chat, path: pathlib.Path, taken: dict[str, Conversation]) -> str:
    """The conversation's own `id`, else one made from the file name (made unique)."""
    if chat.doc.id is not None:
        cid = str(chat.doc.id)
        if cid in taken:
            raise chat.at.sub(".id").error(f"conversation id {cid!r} is already used in {taken[cid].origin}")
        return cid
    base = path.stem if chat.alone else f"{path.stem}#{chat.ordinal}"
    cid, n = base, 1
    while cid in taken:
        n += 1
        cid = f"{base}~{n}"
    return cid


def _parts(m: _ChatMessage) -> list[Any]:
    return [] if m.content is None else [_Text(m.content)] if isinstance(m.content, str) else m.content


def _format(chat: _Chat) -> Literal["openai", "anthropic"]:
    """Which shape the conversation is in; one that mixes both is refused. Plain text
    messages read alike in both and count as OpenAI."""
    openai: tuple[_At, str] | None = None
    anthropic: tuple[_At, str] | None = (chat.at.sub(".system"), 'a top-level "system"') if chat.doc.system is not None else None
    for j, m in enumerate(chat.doc.messages):
        at = chat.messages_at.sub(f"[{j}]")
        if openai is None and m.role in ("system", "developer", "tool", "function"):
            openai = (at, f'role "{m.role}"')
        if openai is None and (m.tool_calls or m.function_call):
            openai = (at, "tool_calls")
        for k, p in enumerate(_parts(m)):
            kind = type(p).__struct_config__.tag
            if openai is None and isinstance(p, (_Refusal, *_OpenAISkipped)):
                openai = (at.sub(f".content[{k}]"), f'a "{kind}" part')
            if anthropic is None and not isinstance(p, (_Text, _Refusal, *_OpenAISkipped)):
                anthropic = (at.sub(f".content[{k}]"), f'a "{kind}" block')
    if openai and anthropic:
        raise anthropic[0].error(f"{anthropic[1]} (Anthropic) in a conversation with {openai[1]} (OpenAI) at {openai[0].path}")
    return "anthropic" if anthropic else "openai"


def _from_chat(m: _ChatMessage, cid: str, at: _At) -> list[Message]:
    """Our messages for one chat message: system prompts dropped, Anthropic tool results
    (inside a user message) as tool messages, tool calls of both shapes as `ToolCall`s."""
    parts = _parts(m)
    text = _join(_Text(p.refusal) if isinstance(p, _Refusal) else p for p in parts)
    for k, p in enumerate(parts):
        if isinstance(p, _ToolUse) and m.role != "assistant":
            raise at.sub(f".content[{k}]").error(f'a "tool_use" block in a {m.role} message (only the assistant calls tools)')
        if isinstance(p, _ToolResult) and m.role != "user":
            raise at.sub(f".content[{k}]").error(f'a "tool_result" block in a {m.role} message (results come back in a user message)')
    if (m.tool_calls or m.function_call) and m.role != "assistant":
        raise at.error(f"tool_calls in a {m.role} message (only the assistant calls tools)")
    if m.role in ("system", "developer"):
        return []
    if m.role in ("tool", "function"):
        return [Message(cid, "tool", text)]
    if m.role == "user":
        out = [Message(cid, "tool", _result_text(p.content)) for p in parts if isinstance(p, _ToolResult)]
        if text or not out:
            out.append(Message(cid, "user", text))
        return out
    calls = [ToolCall(p.name, p.input) for p in parts if isinstance(p, _ToolUse)]
    calls += [_call(c.function, at.sub(f".tool_calls[{k}].function")) for k, c in enumerate(m.tool_calls or ())]
    if m.function_call is not None:
        calls.append(_call(m.function_call, at.sub(".function_call")))
    return [Message(cid, "assistant", text, tool_calls=calls or None)]


def _join(parts: Any) -> str:
    return "\n".join(p.text for p in parts if isinstance(p, _Text) and p.text)


def _result_text(content: str | list[Any] | None) -> str:
    return content if isinstance(content, str) else _join(content or ())


def _call(f: _Function, at: _At) -> ToolCall:
    """OpenAI sends `arguments` as a JSON string (some logs keep the object)."""
    if isinstance(f.arguments, dict):
        return ToolCall(f.name, f.arguments)
    try:
        args = orjson.loads(f.arguments) if f.arguments.strip() else {}
    except orjson.JSONDecodeError as e:
        raise at.sub(".arguments").error(f"not valid JSON ({e.msg})") from None
    if not isinstance(args, dict):
        raise at.sub(".arguments").error(f"must encode a JSON object, got {type(args).__name__}")
    return ToolCall(f.name, args)


def _check(at: _At, msg: Message, catalog: Catalog | None) -> None:
    if catalog is not None:
        unknown = [c.name for c in msg.tool_calls or () if catalog.get(c.name) is None]
        if unknown:
            raise at.error(f"tool_calls name tools not in the catalog: {', '.join(unknown)}")
