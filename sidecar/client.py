"""A small asyncio client for the sidecar's websocket protocol (docs/protocol.md).

    async with await SidecarClient.connect("ws://127.0.0.1:8765", session="chat-1") as sc:
        await sc.token("reply-1", "Let me search my notes")
        async for msg in sc:            # typed: Inject, Ack, Ended, Error, Pong
            ...

`connect` retries while the sidecar answers 503 (still loading the model), then says hello
and waits for `ready`.

Run as a module, it is the example client: it streams a reply token by token, or sends a
user turn whole (`--user`), and prints the injections as they arrive:

    python -m sidecar.client ws://127.0.0.1:8765 "Let me search my notes for the kubernetes setup. Done."
    python -m sidecar.client ws://127.0.0.1:8765 --user "Where did I put the kubernetes setup?"
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from . import protocol as p


class SidecarError(RuntimeError):
    """The sidecar refused the session or answered with an error."""


class SidecarClient:
    def __init__(self, ws: ClientConnection, ready: p.Ready):
        self.ws = ws
        self.ready = ready

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        session: str,
        token: str | None = None,
        origin: str | None = None,
        tools: Sequence[str | dict[str, Any]] | None = None,
        agent: str | None = None,
        project: str | None = None,
        permissions: Sequence[str] | None = None,
        decisions: bool = False,
        resume: str | None = None,
        wait_s: float = 30.0,
    ) -> SidecarClient:
        """`resume`: an earlier connection's `ready.resume`, so refs resent after a reconnect
        count once."""
        headers = {"Authorization": f"Bearer {token}"} if token else None
        deadline = time.monotonic() + wait_s
        while True:
            try:
                ws = await connect(url, additional_headers=headers, origin=origin, compression=None, max_size=None)
                break
            except InvalidStatus as e:
                if e.response.status_code != 503 or time.monotonic() > deadline:
                    raise SidecarError(f"sidecar refused the connection: HTTP {e.response.status_code} {e.response.body.decode(errors='replace').strip()}") from None
                await asyncio.sleep(0.2)
            except OSError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        hello = p.Hello(session=session, agent=agent, project=project, version=p.VERSION, decisions=decisions, resume=resume,
                        permissions=list(permissions) if permissions else None, tools=list(tools) if tools else None)  # fmt: skip
        await ws.send(p.encode(hello), text=True)
        msg = p.decode_server(await asyncio.wait_for(ws.recv(), max(1.0, deadline - time.monotonic())))
        if isinstance(msg, p.Error):
            await ws.close()
            raise SidecarError(f"hello refused: {msg.code}: {msg.message}")
        if not isinstance(msg, p.Ready):
            await ws.close()
            raise SidecarError(f"expected ready, got {type(msg).__name__}")
        return cls(ws, msg)

    async def _send(self, msg: p.ClientMessage) -> None:
        await self.ws.send(p.encode(msg), text=True)

    async def user(self, stream: str, text: str) -> None:
        await self._send(p.User(stream, text))

    async def token(self, stream: str, delta: str) -> None:
        await self._send(p.Token(stream, delta))

    async def end(self, stream: str) -> None:
        await self._send(p.End(stream))

    async def ping(self) -> None:
        await self._send(p.Ping())

    async def tool_result(self, tool: str, ok: bool, latency_ms: float, error: str | None = None, ref: p.Ref | None = None) -> None:
        await self._send(p.ToolResult(tool=tool, ok=ok, latency_ms=latency_ms, error=error, ref=ref))

    async def feedback(self, tool: str, *, rating: float | None = None, selected: bool | None = None, query: str | None = None, ref: p.Ref | None = None) -> None:
        await self._send(p.Feedback(tool=tool, rating=rating, selected=selected, query=query, ref=ref))

    async def recv(self, timeout: float | None = None) -> p.ServerMessage:
        """The next message; raises TimeoutError after `timeout` seconds, ConnectionClosed at the end."""
        return p.decode_server(await asyncio.wait_for(self.ws.recv(), timeout))

    async def __aiter__(self) -> AsyncIterator[p.ServerMessage]:
        try:
            while True:
                yield await self.recv()
        except ConnectionClosed:
            return

    async def close(self) -> None:
        await self.ws.close()

    async def __aenter__(self) -> SidecarClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# The example: python -m sidecar.client URL TEXT ---------------------------------------


def tokens(text: str) -> list[str]:
    """Split a reply roughly as an LLM streams it: a word and the whitespace after it."""
    return re.findall(r"\s*\S+\s*|\s+", text) if text else []


def describe(msg: p.Inject, length: int | None = None) -> str:
    """One inject as a line: the gate's probability beside the tier, each tool's relevance
    beside its name (two scales, never shown under one name), where the trigger was and when
    the inject was sent, which differ: a short reply's only clause is judged at its `end`.
    `length`: the whole stream's, to say "end of stream"."""
    tools = ", ".join(f"{t.definition['name']} (relevance {t.relevance:.2f})" for t in msg.tools)
    gate = f", probability {msg.probability:.2f}" if msg.probability is not None else ""
    t = msg.trigger
    sent = f"sent at {msg.sent_at}"
    if length is not None:
        sent += " (end of stream)" if msg.sent_at >= length else f" of {length}"
    return f"inject [{msg.tier}{gate}] {tools}; trigger {t.text!r} [{t.start}:{t.end}] via {t.path}, {sent}, in {msg.latency_ms:.1f} ms"


async def stream_reply(url: str, text: str, *, rate: float = 20.0, token: str | None = None, out=print) -> list[p.Inject]:
    """Stream `text` as one LLM reply at `rate` tokens/s, print each inject as it arrives,
    and return them once the sidecar has judged the reply's last span."""
    return await converse(url, reply=text, rate=rate, token=token, out=out)


async def converse(url: str, *, user: str | None = None, reply: str | None = None, rate: float = 20.0, token: str | None = None,
                   out=print) -> list[p.Inject]:  # fmt: skip
    """Send `user` as a whole user turn (stream "turn"), then stream `reply` as the LLM's at
    `rate` tokens/s (stream "reply"), each judged to its `ended`; print each inject as it
    arrives and return them all."""
    injects: list[p.Inject] = []
    async with await SidecarClient.connect(url, session="example", token=token) as sc:
        out(f"connected: model {sc.ready.model}, {len(sc.ready.tools)} tools")
        if user is not None:
            injects += await _exchange(sc, "turn", len(user), lambda: sc.user("turn", user), out)
        if reply is not None:

            async def stream() -> None:
                for piece in tokens(reply):
                    await sc.token("reply", piece)
                    await asyncio.sleep(1 / rate)

            injects += await _exchange(sc, "reply", len(reply), stream, out)
    return injects


async def _exchange(sc: SidecarClient, stream: str, length: int, send: Callable[[], Awaitable[None]], out) -> list[p.Inject]:
    """Send a stream's frames (`send`) and its `end`, reading meanwhile: print each inject (and
    error) until the stream's `ended`, once every span of it is judged."""
    injects: list[p.Inject] = []

    async def read() -> None:
        async for msg in sc:
            if isinstance(msg, p.Inject):
                injects.append(msg)
                out(describe(msg, length))
            elif isinstance(msg, p.Error):
                out(f"error {msg.code}: {msg.message}")
            elif isinstance(msg, p.Ended) and msg.stream == stream:
                return

    reader = asyncio.create_task(read())
    await send()
    await sc.end(stream)
    await reader
    return injects


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sidecar.client",
                                 description="Send a user turn and/or stream a reply to a sidecar, and print the injections.")  # fmt: skip
    ap.add_argument("url", help="ws://HOST:PORT of a running `sidecar serve`")
    ap.add_argument("text", nargs="*", help="the reply to stream token by token (default: stdin, unless --user is given)")
    ap.add_argument("--user", metavar="TEXT", help="send TEXT as a user turn, whole (before the reply, if one is given too)")
    ap.add_argument("--rate", type=float, default=20.0, help="reply tokens per second (default 20)")
    ap.add_argument("--token", help="shared token, if the sidecar wants one")
    args = ap.parse_intermixed_args(argv)  # the reply may come after --user TEXT
    if args.user is not None and not args.user.strip():
        ap.error("--user needs some text")
    if args.rate <= 0:
        ap.error(f"--rate must be positive, not {args.rate}")
    reply = " ".join(args.text) if args.text else (None if args.user is not None else sys.stdin.read())
    try:
        injects = asyncio.run(converse(args.url, user=args.user, reply=reply, rate=args.rate, token=args.token))
    except (SidecarError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{len(injects)} inject(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
