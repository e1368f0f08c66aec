"""A small chat server for the proxy's tests, speaking OpenAI's Chat Completions and Anthropic's
Messages: it plays scripted replies in the shapes each documents and records every request it
received.

No chat model can run on these machines, so the upstream's words are scripted; everything
else is real HTTP on 127.0.0.1: `POST /v1/chat/completions` streamed (`data: {chunk}` events:
a role chunk, text deltas, `tool_calls` deltas whose `arguments` come in pieces, a finish
chunk, a usage chunk when `stream_options.include_usage`, `data: [DONE]`) or whole (one
`chat.completion`), and `GET /v1/models`. `POST /v1/messages` streamed (named events:
`message_start`, a `ping`, a text block's `text_delta`s, each tool use as a `tool_use` block
whose input comes in `input_json_delta` pieces, `message_delta` with the stop reason and usage,
`message_stop`) or whole (one `message`); `POST /v1/messages/count_tokens` answers
`{"input_tokens": N}` with N the request body's length in bytes over 4. Each request takes the
next scripted reply (the last one repeats). A stream the client breaks off is recorded in `cut`.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

USAGE = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}


@dataclass
class Scripted:
    """One upstream reply: text (streamed a word at a time), then tool calls (name, arguments)."""

    text: str = ""
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    status: int = 200  # not 200: `error` is answered instead
    error: dict[str, Any] | None = None
    delay_s: float = 0.0  # before the first byte
    pause_s: float = 0.0  # between chunks
    cut_after: int | None = None  # a stream closed after this many chunks, without its finish or [DONE]
    usage: dict[str, Any] = field(default_factory=lambda: dict(USAGE))


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, Any] | None
    at: float = 0.0  # time.perf_counter() once the request was read (bench/proxy_latency.py)

    @property
    def tool_names(self) -> list[str]:
        """The names of the tools the request carried, in OpenAI's shape or Anthropic's."""
        return [t["function"]["name"] if "function" in t else t["name"] for t in (self.body or {}).get("tools") or ()]


def _pieces(text: str) -> list[str]:
    words = text.split(" ")
    return [w + (" " if i < len(words) - 1 else "") for i, w in enumerate(words) if w or i < len(words) - 1]


class Upstream:
    """`with Upstream([Scripted(...), ...]) as up:` serves on 127.0.0.1 (a free port); `up.url`
    is the base URL (…/v1), `up.requests` what it received, `up.cut` the streams broken off."""

    def __init__(self, replies: list[Scripted]):
        self.replies = list(replies)
        self.requests: list[Received] = []
        self.cut: list[int] = []  # indexes into `requests`
        self.done: list[int] = []
        self._lock = threading.Lock()
        self._served = 0
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                upstream._record(self, None)
                if self.path.rstrip("/") == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": "scripted", "object": "model", "created": 0, "owned_by": "tests"}]})
                else:
                    self._json(404, {"error": {"message": f"no {self.path}", "type": "invalid_request_error", "param": None, "code": None}})

            def do_POST(self) -> None:
                size = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(size) or b"null")
                n = upstream._record(self, body)
                anthropic = self.path.split("?")[0].rstrip("/").endswith(("/messages", "/messages/count_tokens"))
                if self.path.split("?")[0].rstrip("/").endswith("/count_tokens"):
                    self._json(200, {"input_tokens": size // 4})
                    return
                reply = upstream._next()
                time.sleep(reply.delay_s)
                if reply.status != 200:
                    self._json(reply.status, reply.error or (
                        {"type": "error", "error": {"type": "api_error", "message": "scripted failure"}} if anthropic else
                        {"error": {"message": "scripted failure", "type": "server_error", "param": None, "code": None}}))  # fmt: skip
                    return
                if body.get("stream"):
                    self._stream(n, body, reply, anthropic)
                else:
                    self._json(200, whole_message(body, reply) if anthropic else whole(body, reply))
                    upstream.done.append(n)

            def _json(self, status: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, n: int, body: dict[str, Any], reply: Scripted, anthropic: bool) -> None:
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("connection", "close")
                self.end_headers()
                self.close_connection = True
                try:
                    for k, chunk in enumerate(message_events(body, reply) if anthropic else chunks(body, reply)):
                        if k == reply.cut_after:
                            return
                        named = b"event: " + chunk["type"].encode() + b"\n" if anthropic else b""
                        self.wfile.write(named + b"data: " + json.dumps(chunk).encode() + b"\n\n")
                        self.wfile.flush()
                        time.sleep(reply.pause_s)
                    if not anthropic:
                        self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                    upstream.done.append(n)
                except OSError:  # the client broke the stream off
                    upstream.cut.append(n)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def _record(self, handler: BaseHTTPRequestHandler, body: Any) -> int:
        with self._lock:
            self.requests.append(Received(handler.path, {k.lower(): v for k, v in handler.headers.items()}, body, time.perf_counter()))
            return len(self.requests) - 1

    def _next(self) -> Scripted:
        with self._lock:
            reply = self.replies[min(self._served, len(self.replies) - 1)]
            self._served += 1
            return reply

    @property
    def chats(self) -> list[Received]:
        return [r for r in self.requests if r.path.endswith("/chat/completions")]

    @property
    def messages(self) -> list[Received]:
        return [r for r in self.requests if r.path.split("?")[0].endswith("/messages")]

    def __enter__(self) -> Upstream:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


def _base(body: dict[str, Any], n: int) -> dict[str, Any]:
    return {"id": f"chatcmpl-scripted{n}", "object": "chat.completion.chunk", "created": 1_700_000_000, "model": body.get("model"),
            "system_fingerprint": None}  # fmt: skip


def chunks(body: dict[str, Any], reply: Scripted) -> list[dict[str, Any]]:
    """The reply as OpenAI streams it."""
    base = _base(body, id(reply) % 10_000)

    def choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    out = [choice({"role": "assistant", "content": "", "refusal": None})]
    out += [choice({"content": piece}) for piece in _pieces(reply.text)] if reply.text else []
    for i, (name, args) in enumerate(reply.calls):
        out.append(choice({"tool_calls": [{"index": i, "id": f"call_{i}_{name[:20]}", "type": "function", "function": {"name": name, "arguments": ""}}]}))
        text = json.dumps(args)
        step = max(1, len(text) // 3)
        out += [choice({"tool_calls": [{"index": i, "function": {"arguments": text[k : k + step]}}]}) for k in range(0, len(text), step)]
    out.append(choice({}, "tool_calls" if reply.calls else "stop"))
    if (body.get("stream_options") or {}).get("include_usage"):
        out.append({**base, "choices": [], "usage": reply.usage})
    return out


def whole(body: dict[str, Any], reply: Scripted) -> dict[str, Any]:
    """The reply as one chat.completion."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.text or None, "refusal": None}
    if reply.calls:
        message["tool_calls"] = [{"id": f"call_{i}_{name[:20]}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
                                 for i, (name, args) in enumerate(reply.calls)]  # fmt: skip
    return {"id": "chatcmpl-scripted", "object": "chat.completion", "created": 1_700_000_000, "model": body.get("model"),
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "tool_calls" if reply.calls else "stop"}],
            "usage": reply.usage, "system_fingerprint": None}  # fmt: skip


MESSAGE_USAGE = {"input_tokens": 11, "output_tokens": 7}


def _tool_id(i: int, name: str) -> str:
    return f"toolu_{i}_{name[:20]}"


def message_events(body: dict[str, Any], reply: Scripted) -> list[dict[str, Any]]:
    """The reply as Anthropic streams it (each event's `type` is also its SSE event name)."""
    message = {"id": f"msg_scripted{id(reply) % 10_000}", "type": "message", "role": "assistant", "content": [], "model": body.get("model"),
               "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": MESSAGE_USAGE["input_tokens"], "output_tokens": 1}}  # fmt: skip
    out: list[dict[str, Any]] = [{"type": "message_start", "message": message}, {"type": "ping"}]
    index = 0
    if reply.text:
        out.append({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
        out += [{"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}} for piece in _pieces(reply.text)]
        out.append({"type": "content_block_stop", "index": 0})
        index = 1
    for i, (name, args) in enumerate(reply.calls, start=index):
        out.append({"type": "content_block_start", "index": i, "content_block": {"type": "tool_use", "id": _tool_id(i, name), "name": name, "input": {}}})
        text = json.dumps(args)
        step = max(1, len(text) // 3)
        out += [{"type": "content_block_delta", "index": i, "delta": {"type": "input_json_delta", "partial_json": text[k : k + step]}}
                for k in range(0, len(text), step)]  # fmt: skip
        out.append({"type": "content_block_stop", "index": i})
    out.append({"type": "message_delta", "delta": {"stop_reason": "tool_use" if reply.calls else "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": MESSAGE_USAGE["output_tokens"]}})  # fmt: skip
    out.append({"type": "message_stop"})
    return out


def whole_message(body: dict[str, Any], reply: Scripted) -> dict[str, Any]:
    """The reply as one Anthropic message."""
    content: list[dict[str, Any]] = [{"type": "text", "text": reply.text}] if reply.text else []
    content += [{"type": "tool_use", "id": _tool_id(i, name), "name": name, "input": args} for i, (name, args) in enumerate(reply.calls, start=len(content))]
    return {"id": "msg_scripted", "type": "message", "role": "assistant", "content": content, "model": body.get("model"),
            "stop_reason": "tool_use" if reply.calls else "end_turn", "stop_sequence": None, "usage": dict(MESSAGE_USAGE)}  # fmt: skip
