"""Attacks on a real `sidecar serve` (issue 33), each watched by an idle victim client.

It starts `sidecar serve` on 127.0.0.1 (MiniLM, notes catalog, a fresh store, one model
thread unless --threads), connects a victim that says hello and then only probes: a `ping`
every PING_EVERY_S (its round trip is the event loop's responsiveness) and a user turn every
TURN_EVERY_S, each a new text (no query cache), timed until its `decision` (the model
thread's share). First the victim alone (the baseline), then each attack for --seconds in its
own process (`--attack NAME`, so the attacker's own work does not slow the victim's
process), the victim probing meanwhile. Every attack loop stops by itself at its deadline;
the attacker is killed if it overruns by ATTACKER_GRACE_S.

Reported per attack: the victim's ping and decision p50/p99 (ms) and their ratio to the
baseline's p99 (targets: ping <= 2x, decision <= 3x), decisions that never came (counted at
DECISION_TIMEOUT_S), whether a new client could still connect while it ran (and how long its
hello took), what the attacker saw (frames, errors by code, refusals by status), and the
server's /metrics counters that moved.

Attacks: the issue's (nesting backtrack frame, long permissions list, one token frame of tiny
clauses, hello descriptions that backtrack, foreign origin, silent connections filling the
places), hellos of a megabyte of tiny values, and the earlier ones of tests/test_hardening.py
(frames that closed with 1011, long adversarial turns, oversized frames, huge stored strings,
a connection that floods spans, a client that never reads). First two controls that are no
attack: the attacker's process busy on its core, sending nothing (`cpu_burn`): what sharing the
two cores with any busy process costs the victim, the floor under every other row; and a
client within every limit that keeps the model thread saturated (`model_busy`): what a busy
model costs the victim, whoever keeps it busy.

    .venv/bin/python bench/attacks.py --json > attacks.json
    .venv/bin/python bench/attacks.py --only nesting tiny_clauses --seconds 3
    .venv/bin/python bench/attacks.py --url ws://127.0.0.1:8765 --only foreign_origin

Progress goes to stderr; with --json, stdout holds only the JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import websockets  # noqa: E402
from websockets.exceptions import ConnectionClosed, InvalidStatus  # noqa: E402

from sidecar.core import models  # noqa: E402
from sidecar import protocol as p  # noqa: E402
from sidecar.client import SidecarClient  # noqa: E402

NOTES = ROOT / "fixtures" / "catalogs" / "notes.json"
PING_EVERY_S = 0.02
TURN_EVERY_S = 0.2
DECISION_TIMEOUT_S = 10.0
ATTACKER_GRACE_S = 15.0
QUIET_S, SETTLE_LIMIT_S = 0.5, 60.0  # after an attack: its counters still this long, waited for at most this
FRAME_BYTES = 1_000_000  # under max_frame_bytes (1 MiB)
PING_TARGET, DECISION_TARGET = 2.0, 3.0
REQUEST = "Can you search my notes for the kubernetes setup?"
TOPICS = ["the kubernetes setup", "last week's meeting", "the budget draft", "my reading list", "the trip to Lisbon",
          "the release checklist", "the onboarding plan", "the database migration"]  # fmt: skip
SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}}


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 2)


# The attacks: each runs in its own process until `deadline` (time.monotonic()) --------------


class Tally:
    """What the attacker saw."""

    def __init__(self) -> None:
        self.frames = 0
        self.replies: collections.Counter[str] = collections.Counter()
        self.refused: collections.Counter[str] = collections.Counter()
        self.closed: collections.Counter[str] = collections.Counter()

    def reply(self, raw: str | bytes) -> None:
        msg = json.loads(raw)
        self.replies[msg["type"] if msg["type"] != "error" else f"error:{msg['code']}"] += 1

    def refuse(self, e: BaseException) -> None:
        if isinstance(e, InvalidStatus):
            self.refused[str(e.response.status_code)] += 1
        elif isinstance(e, ConnectionClosed):
            self.closed[str(e.rcvd.code if e.rcvd else "none")] += 1
        else:
            self.refused[type(e).__name__] += 1

    def as_dict(self) -> dict:
        return {"frames": self.frames, "replies": dict(self.replies), "refused": dict(self.refused), "closed": dict(self.closed)}


async def send_by(ws, frame: str, deadline: float) -> bool:
    """Send unless the server's backpressure holds it past the deadline: then the connection
    is dropped (a half-sent frame cannot be closed politely) and False."""
    try:
        await asyncio.wait_for(ws.send(frame), max(0.01, deadline - time.monotonic()))
        return True
    except TimeoutError:
        ws.transport.abort()
        return False


async def _hello(ws, session: str, **fields) -> dict:
    await ws.send(json.dumps({"type": "hello", "session": session, **fields}))
    return json.loads(await ws.recv())


async def _each_connection(url: str, deadline: float, tally: Tally, body, **connect) -> None:
    """`body(ws, i)` on connection after connection until the deadline; a refused or closed
    connection is counted and the next one opened."""
    i = 0
    while time.monotonic() < deadline:
        i += 1
        try:
            async with websockets.connect(url, max_size=None, open_timeout=10, close_timeout=1, **connect) as ws:
                await body(ws, i)
        except (InvalidStatus, ConnectionClosed, OSError, TimeoutError) as e:
            tally.refuse(e)
            await asyncio.sleep(0.01)


async def _frames_in_turn(url: str, deadline: float, tally: Tally, frames: list[str]) -> None:
    """`frames` one after the other, each answer read before the next is sent."""

    async def body(ws, _):
        while time.monotonic() < deadline:
            await ws.send(frames[tally.frames % len(frames)])
            tally.frames += 1
            tally.reply(await ws.recv())

    await _each_connection(url, deadline, tally, body)


async def attack_nesting(url: str, deadline: float, tally: Tally) -> None:
    """Issue 33 #1: '[' x 65 then a run of quotes (bare and escaped), ~1 MB, no hello needed."""
    n = FRAME_BYTES - 100
    await _frames_in_turn(url, deadline, tally, ["[" * 65 + '"' * n, "[" * 65 + '\\"' * (n // 2)])


async def attack_long_permissions(url: str, deadline: float, tally: Tally) -> None:
    """Issue 33 #2: a hello with 75,000 globs (964 KB), then one with the costliest list allowed
    (new globs each time: as many patterns as a hello may hold, the compiled kind, of as many
    characters and wildcards as they may hold in all; names for the rest of its characters)
    and user turns ranked through them."""
    huge = json.dumps({"type": "hello", "session": "perm", "permissions": [f"*x{i}*z" for i in range(75_000)]})  # encoded once: 9 ms of the attacker's core each time

    def most(i: int) -> list[str]:
        part = p.MAX_PATTERN_CHARS // p.MAX_PATTERNS  # 16 characters, a wildcard in the middle
        patterns = [(f"{i}-{k}-" * part)[: part // 2] + "*" + "x" * (part - part // 2 - 1) for k in range(p.MAX_PATTERNS)]
        rest = p.MAX_PERMISSION_CHARS - p.MAX_PATTERN_CHARS
        names = [(f"{i}-{k}-" * p.MAX_GLOB_CHARS)[: p.MAX_GLOB_CHARS] for k in range(rest // p.MAX_GLOB_CHARS)]
        return patterns + names

    async def body(ws, i):
        if i % 2:
            tally.frames += 1
            await ws.send(huge)
            tally.reply(await ws.recv())
            return
        tally.frames += 1
        tally.reply(json.dumps(await _hello(ws, f"perm-{i}", permissions=most(i))))
        for k in range(20):
            if time.monotonic() >= deadline:
                return
            await ws.send(json.dumps({"type": "user", "stream": f"s{k}", "text": f"{REQUEST} number {i}-{k}"}))
            tally.frames += 1
            await asyncio.sleep(0.01)

    await _each_connection(url, deadline, tally, body)


async def attack_tiny_values(url: str, deadline: float, tally: Tally) -> None:
    """Hellos of about 1 MB of tiny values in `tools` (`[[[[[[]]]]]]`, then `{}`), again and
    again on one connection: decoding built every value before any limit was checked."""
    frames = ['{"type":"hello","session":"v","tools":[' + ",".join([v] * (FRAME_BYTES // (len(v) + 1) - 10)) + "]}" for v in ('{"a":[[[[[[]]]]]]}', "{}")]
    await _frames_in_turn(url, deadline, tally, frames)


async def attack_tiny_clauses(url: str, deadline: float, tally: Tally) -> None:
    """Issue 33 #3: one token frame of about 1 MB of "abc\\n" (200,000 clauses: 5 bytes each
    once JSON escapes the newline), again and again."""
    delta = "abc\n" * (FRAME_BYTES // 5 - 20)

    async def body(ws, i):
        await _hello(ws, f"tiny-{i}")
        k = 0
        while time.monotonic() < deadline:
            k += 1
            if not (await send_by(ws, json.dumps({"type": "token", "stream": f"t{k}", "delta": delta}), deadline)
                    and await send_by(ws, json.dumps({"type": "end", "stream": f"t{k}"}), deadline)):  # fmt: skip
                return
            tally.frames += 2

    await _each_connection(url, deadline, tally, body)


async def attack_hello_descriptions(url: str, deadline: float, tally: Tally) -> None:
    """Issue 33 #4: hellos whose tool descriptions made cases.py backtrack
    ("use to" + 60,000 spaces + "x"; 60,000 "("), new names each time (no catalog reuse)."""

    async def body(ws, i):
        tools = [{"name": f"use_{i}", "description": "use to" + " " * 60_000 + "x", "inputSchema": SCHEMA},
                 {"name": f"paren_{i}", "description": "(" * 60_000, "inputSchema": SCHEMA}]  # fmt: skip
        tally.frames += 1
        tally.reply(json.dumps(await _hello(ws, f"desc-{i}", tools=tools)))

    await _each_connection(url, deadline, tally, body)


async def attack_foreign_origin(url: str, deadline: float, tally: Tally) -> None:
    """Issue 33 #5: a web page of another origin opening sockets (and a rebinding Host)."""
    i = 0
    while time.monotonic() < deadline:
        i += 1
        try:
            headers = {"Host": "evil.example"} if i % 2 else None
            async with websockets.connect(url, origin="https://evil.example", additional_headers=headers, open_timeout=10) as ws:
                tally.reply(json.dumps(await _hello(ws, f"evil-{i}")))
        except (InvalidStatus, ConnectionClosed, OSError, TimeoutError) as e:
            tally.refuse(e)
        tally.frames += 1


async def attack_silent(url: str, deadline: float, tally: Tally, addresses: int = 1) -> None:
    """Issue 33 #6: silent connections (no hello) from one address (127.0.0.2), or from
    `addresses` of them in turn, as many as it will take, held, and opened again when the
    server closes them."""
    held: list = []
    i = 0
    while time.monotonic() < deadline:
        held = [ws for ws in held if ws.close_code is None]
        i += 1
        try:
            ws = await websockets.connect(url, open_timeout=10, close_timeout=0.1, local_addr=(f"127.0.0.{2 + i % addresses}", 0))
            held.append(ws)
            tally.frames += 1
        except (InvalidStatus, ConnectionClosed, OSError, TimeoutError) as e:
            tally.refuse(e)
            await asyncio.sleep(0.05)
    tally.replies["held_at_end"] = len(held)
    for ws in held:
        ws.transport.abort()


async def attack_silent_many(url: str, deadline: float, tally: Tally) -> None:
    """Silent connections from 8 loopback addresses: more than max_connections in all (what
    a per-address limit cannot stop: a token, or a proxy's limits, can)."""
    await attack_silent(url, deadline, tally, addresses=8)


async def attack_bad_frames(url: str, deadline: float, tally: Tally) -> None:
    """Issue 13 A/B: frames that used to close the connection with 1011."""
    frames = [b'{"type":"\xff"}', "[" * 1000 + "]" * 1000, '{"a":' * 1000 + "1" + "}" * 1000,
              '{"type":"hello","session":"x","tools":' + "[" * 1000 + "]" * 1000 + "}", "[1,2", '{"type":' + "9" * 4300 + "}",
              '{"type":"user","stream":"s","text":"' + "\\ud800" * 1000 + '"}']  # fmt: skip

    async def body(ws, _):
        while time.monotonic() < deadline:
            await ws.send(frames[tally.frames % len(frames)])
            tally.frames += 1
            tally.reply(await ws.recv())

    await _each_connection(url, deadline, tally, body)


async def attack_long_turns(url: str, deadline: float, tally: Tally) -> None:
    """Issue 13 F: user turns the regex gate used to choke on."""
    turns = ["a-" * 50_000, f"{REQUEST} " + "a " * 30_000 + " Delete operations are slow."]

    async def body(ws, i):
        await _hello(ws, f"long-{i}")
        k = 0
        while time.monotonic() < deadline:
            k += 1
            if not await send_by(ws, json.dumps({"type": "user", "stream": f"u{k}", "text": turns[k % 2] + f" {k}"}), deadline):
                return
            tally.frames += 1
            await asyncio.sleep(0.01)

    await _each_connection(url, deadline, tally, body)


async def attack_oversized(url: str, deadline: float, tally: Tally) -> None:
    """Issue 13: frames over max_frame_bytes (the connection is closed with 1009), again."""
    frame = json.dumps({"type": "user", "stream": "s", "text": "x" * (1 << 20)})

    async def body(ws, i):
        await _hello(ws, f"big-{i}")
        await ws.send(frame)
        tally.frames += 1
        await ws.recv()

    await _each_connection(url, deadline, tally, body)


async def attack_big_records(url: str, deadline: float, tally: Tally) -> None:
    """Issue 13 I: tool_result / feedback with huge strings, each stored (and cut)."""

    async def body(ws, i):
        await _hello(ws, f"rec-{i}", agent="a" * 200_000)
        k = 0
        while time.monotonic() < deadline:
            k += 1
            if k % 2:
                frame = {"type": "tool_result", "tool": "create_note", "ok": False, "latency_ms": 1, "error": "e" * 400_000, "ref": k}
            else:
                frame = {"type": "feedback", "tool": "create_note", "rating": 1, "query": "q" * 400_000, "ref": k}
            await ws.send(json.dumps(frame))
            tally.frames += 1
            tally.reply(await ws.recv())

    await _each_connection(url, deadline, tally, body)


async def attack_span_flood(url: str, deadline: float, tally: Tally) -> None:
    """Issue 13 E: one connection streaming clauses on many streams as fast as it is read."""
    clauses = [f"I will now look into {t} and then write a short summary of it. " for t in TOPICS]

    async def body(ws, i):
        await _hello(ws, f"flood-{i}")
        k = 0
        while time.monotonic() < deadline:
            k += 1
            if not await send_by(ws, json.dumps({"type": "token", "stream": f"f{k % 32}", "delta": clauses[k % len(clauses)] + f"{k}. "}), deadline):
                return
            tally.frames += 1

    await _each_connection(url, deadline, tally, body)


async def attack_slow_reader(url: str, deadline: float, tally: Tally) -> None:
    """Issue 13 C: asks for a decision per span and never reads one."""

    async def body(ws, i):
        await _hello(ws, f"slow-{i}", decisions=True)
        k = 0
        while time.monotonic() < deadline:
            k += 1
            if not await send_by(ws, json.dumps({"type": "user", "stream": f"s{k % 48}", "text": f"{REQUEST} {k}"}), deadline):
                tally.replies["send_blocked"] += 1  # the server stopped reading it: backpressure
                return
            tally.frames += 1

    await _each_connection(url, deadline, tally, body)


async def attack_cpu_burn(url: str, deadline: float, tally: Tally) -> None:
    """A control, not an attack: the attacker's process busy on its core, sending nothing. What
    the victim loses here is what any busy process on the same cores costs it; what an attack
    costs beyond it is what its frames make the server do."""
    while time.monotonic() < deadline:
        spin = time.perf_counter() + 0.005
        while time.perf_counter() < spin:
            pass
        await asyncio.sleep(0)


async def attack_model_busy(url: str, deadline: float, tally: Tally) -> None:
    """A second control, no attack either: a client within every limit that keeps the model
    thread busy, a token frame of 64 new clauses every 250 ms (more spans a second than one
    MiniLM thread judges), every answer read. What the victim loses here is what a saturated
    model thread costs it, whoever saturates it."""

    async def body(ws, i):
        await _hello(ws, f"busy-{i}")

        async def read():
            async for raw in ws:
                tally.reply(raw)

        reader = asyncio.create_task(read())
        k = 0
        try:
            while time.monotonic() < deadline:
                k += 1
                delta = "".join(f"Next I will look into {TOPICS[(k + j) % len(TOPICS)]}, part {k}.{j}.\n" for j in range(64))
                if not (await send_by(ws, json.dumps({"type": "token", "stream": f"b{k}", "delta": delta}), deadline)
                        and await send_by(ws, json.dumps({"type": "end", "stream": f"b{k}"}), deadline)):  # fmt: skip
                    return
                tally.frames += 2
                await asyncio.sleep(0.25)
        finally:
            reader.cancel()

    await _each_connection(url, deadline, tally, body)


ATTACKS = {
    "cpu_burn": attack_cpu_burn,
    "model_busy": attack_model_busy,
    "nesting": attack_nesting,
    "long_permissions": attack_long_permissions,
    "tiny_clauses": attack_tiny_clauses,
    "tiny_values": attack_tiny_values,
    "hello_descriptions": attack_hello_descriptions,
    "foreign_origin": attack_foreign_origin,
    "silent_connections": attack_silent,
    "silent_many_addresses": attack_silent_many,
    "bad_frames": attack_bad_frames,
    "long_turns": attack_long_turns,
    "oversized_frames": attack_oversized,
    "big_records": attack_big_records,
    "span_flood": attack_span_flood,
    "slow_reader": attack_slow_reader,
}


def run_attacker(name: str, url: str, seconds: float) -> None:
    """The attacker process: one attack until its deadline, then its tally on stdout."""
    tally = Tally()

    async def main() -> None:
        deadline = time.monotonic() + seconds
        try:
            await asyncio.wait_for(ATTACKS[name](url, deadline, tally), seconds + 5)
        except TimeoutError:
            tally.replies["overran"] += 1

    print("ready", flush=True)  # imported: the victim starts measuring now, not during the interpreter's start
    asyncio.run(main())
    print(json.dumps(tally.as_dict()), flush=True)


# The victim -------------------------------------------------------------------------------


class Victim:
    """One idle client: pings and user turns, each timed to its answer."""

    def __init__(self, sc: SidecarClient):
        self.sc = sc
        self.pongs: collections.deque[asyncio.Future] = collections.deque()
        self.decisions: dict[str, asyncio.Future] = {}
        self.reader = asyncio.create_task(self._read())
        self.n = 0

    async def _read(self) -> None:
        async for msg in self.sc:
            if isinstance(msg, p.Pong) and self.pongs:
                self.pongs.popleft().set_result(time.perf_counter())
            elif isinstance(msg, p.DecisionReport) and (fut := self.decisions.pop(msg.stream, None)) is not None:
                fut.set_result(time.perf_counter())

    async def _pings(self, until: float, out: list[float]) -> None:
        while time.monotonic() < until:
            fut = asyncio.get_running_loop().create_future()
            self.pongs.append(fut)
            t0 = time.perf_counter()
            await self.sc.ping()
            out.append((await asyncio.wait_for(fut, 60) - t0) * 1000)
            await asyncio.sleep(PING_EVERY_S)

    async def _turns(self, until: float, out: list[float], missed: list[int]) -> None:
        while time.monotonic() < until:
            self.n += 1
            stream = f"v{self.n}"
            fut = self.decisions[stream] = asyncio.get_running_loop().create_future()
            t0 = time.perf_counter()
            await self.sc.user(stream, f"Please find my notes about {TOPICS[self.n % len(TOPICS)]}, take {self.n}.")
            try:
                out.append((await asyncio.wait_for(fut, DECISION_TIMEOUT_S) - t0) * 1000)
            except TimeoutError:
                self.decisions.pop(stream, None)
                missed.append(1)
                out.append(DECISION_TIMEOUT_S * 1000)
            await self.sc.end(stream)
            await asyncio.sleep(TURN_EVERY_S)

    async def measure(self, seconds: float) -> dict:
        pings: list[float] = []
        turns: list[float] = []
        missed: list[int] = []
        until = time.monotonic() + seconds
        await asyncio.gather(self._pings(until, pings), self._turns(until, turns, missed))
        return {"pings": len(pings), "ping_p50_ms": pct(pings, 0.5), "ping_p99_ms": pct(pings, 0.99), "ping_max_ms": pct(pings, 1.0),
                "decisions": len(turns), "decisions_missed": len(missed), "decision_p50_ms": pct(turns, 0.5),
                "decision_p99_ms": pct(turns, 0.99)}  # fmt: skip


async def fresh_client(url: str, at: float) -> dict:
    """A new client connecting `at` seconds into the attack: did it get `ready`, how fast."""
    await asyncio.sleep(at)
    t0 = time.perf_counter()
    try:
        async with await SidecarClient.connect(url, session="newcomer", wait_s=5) as sc:
            assert sc.ready.tools
        return {"fresh_client": "ready", "fresh_client_ms": round((time.perf_counter() - t0) * 1000, 1)}
    except Exception as e:  # noqa: BLE001  (reported: that is the finding)
        return {"fresh_client": f"{type(e).__name__}: {e}"[:160], "fresh_client_ms": None}


def scrape(url: str) -> dict[str, float]:
    http = url.replace("ws://", "http://").rstrip("/")
    with urllib.request.urlopen(f"{http}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and ("_total" in line) and not line.startswith("process_"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def one_attack(name: str, url: str, victim: Victim, args, baseline: dict) -> dict:
    before = scrape(url)
    proc = await asyncio.create_subprocess_exec(sys.executable, __file__, "--attack", name, "--url", url, "--seconds", str(args.seconds),
                                                stdout=asyncio.subprocess.PIPE, cwd=ROOT)  # fmt: skip
    await asyncio.wait_for(proc.stdout.readline(), 60)  # "ready": its interpreter started (0.3 s of a core, more on a busy machine)
    seen, fresh = await asyncio.gather(victim.measure(args.seconds), fresh_client(url, args.seconds / 2))
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), args.seconds + ATTACKER_GRACE_S)
        attacker = json.loads(out.decode().strip().splitlines()[-1])
    except (TimeoutError, IndexError, json.JSONDecodeError):
        proc.kill()
        await proc.wait()
        attacker = {"killed": True}
    after = scrape(url)
    moved = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0) and "frames_total" not in k}
    row = {"attack": name, **seen, **fresh, "attacker": attacker, "metrics": moved}
    row["ping_p99_x"] = round(seen["ping_p99_ms"] / baseline["ping_p99_ms"], 2) if seen["ping_p99_ms"] else None
    row["decision_p99_x"] = round(seen["decision_p99_ms"] / baseline["decision_p99_ms"], 2) if seen["decision_p99_ms"] else None
    row["meets_target"] = bool(row["ping_p99_x"] is not None and row["ping_p99_x"] <= PING_TARGET
                               and row["decision_p99_x"] is not None and row["decision_p99_x"] <= DECISION_TARGET
                               and not seen["decisions_missed"])  # fmt: skip
    return row


async def settle(url: str, minimum: float) -> float:
    """Wait `minimum` seconds, then until the server's counters stand still for QUIET_S (at
    most SETTLE_LIMIT_S): frames an attack left in the socket buffers, read at the read
    budget's pace, and the spans they queue, would otherwise count against the next attack
    (a span flood's went on for about 2 s after its process ended). Returns the seconds waited."""
    t0 = time.perf_counter()
    await asyncio.sleep(minimum)
    last = None
    while time.perf_counter() - t0 < SETTLE_LIMIT_S:
        now = await asyncio.to_thread(scrape, url)
        if now == last:
            break
        last = now
        await asyncio.sleep(QUIET_S)
    return round(time.perf_counter() - t0, 2)


async def serve(args, tmp: pathlib.Path, config: str = "") -> tuple[asyncio.subprocess.Process, str]:
    """`sidecar serve` on 127.0.0.1 (a free port) with `args.model` and `args.threads` model
    threads, the notes catalog, a store in `tmp` and `config` (TOML); its URL once listening."""
    env = {**os.environ, "SIDECAR_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    toml = tmp / "bench.toml"
    toml.write_text(config)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "sidecar", "serve", "--config", str(toml), "--port", "0",
                                                "--model", args.model, "--catalog", str(NOTES), "--store", str(tmp / "bench.db"),
                                                stderr=asyncio.subprocess.PIPE, cwd=ROOT, env=env)  # fmt: skip
    while line := (await proc.stderr.readline()).decode():
        if found := re.search(r"listening on (ws://\S+)", line):
            asyncio.create_task(_drain(proc.stderr))
            return proc, found.group(1)
    raise RuntimeError(f"sidecar serve did not start: {line.strip()}")


def server_table(settings: list[str], **fixed: int) -> str:
    """A [server] table of `fixed` keys and KEY=VALUE settings (TOML values)."""
    lines = [f"{k} = {v}" for k, v in fixed.items()] + [f"{kv.split('=', 1)[0]} = {kv.split('=', 1)[1]}" for kv in settings]
    return "[server]\n" + "".join(line + "\n" for line in lines)


async def _drain(stream) -> None:
    while await stream.readline():
        pass


async def main(args) -> dict:
    proc = None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            if args.url:
                url = args.url
            else:
                proc, url = await serve(args, pathlib.Path(tmp), server_table(args.set) + f"[model]\nidle_cores = {str(args.idle_cores == 'on').lower()}\n")
            log(f"server at {url}")
            async with await SidecarClient.connect(url, session="victim", decisions=True, wait_s=120) as sc:
                victim = Victim(sc)
                await victim.measure(1.0)  # warm up
                baseline = await victim.measure(args.seconds)
                log(f"baseline: ping p99 {baseline['ping_p99_ms']} ms, decision p99 {baseline['decision_p99_ms']} ms")
                rows = []
                for name in args.only or list(ATTACKS):
                    row = await one_attack(name, url, victim, args, baseline)
                    rows.append(row)
                    log(f"{name}: ping p99 {row['ping_p99_ms']} ms ({row['ping_p99_x']}x), decision p99 {row['decision_p99_ms']} ms "
                        f"({row['decision_p99_x']}x), missed {row['decisions_missed']}, new client {row['fresh_client']}"
                        f"{'' if row['meets_target'] else '  <- over target'}")  # fmt: skip
                    row["settled_s"] = await settle(url, args.settle)  # what the attack queued is worked through before the next
                victim.reader.cancel()
            alive = proc is None or proc.returncode is None
            return {"model": args.model, "threads": args.threads, "seconds": args.seconds, "settings": args.set, "idle_cores": args.idle_cores, "baseline": baseline, "attacks": rows,
                    "server_alive": alive, "targets": {"ping_p99_x": PING_TARGET, "decision_p99_x": DECISION_TARGET}}  # fmt: skip
        finally:
            if proc is not None:
                await stop(proc)


async def stop(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM (the server finishes in-flight work), SIGKILL after 30 s."""
    if proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()


MEDIAN_KEYS = ("ping_p50_ms", "ping_p99_ms", "ping_p99_x", "decision_p50_ms", "decision_p99_ms", "decision_p99_x", "fresh_client_ms", "settled_s")


def medians(runs: list[dict]) -> dict:
    """Several whole runs (each its own server and idle baseline) as one: per attack the
    median of each figure, a ratio the median of the runs' ratios to their own baseline; the
    attacker's tallies from the last run; every run kept under `runs`."""
    med = lambda rows, k: round(statistics.median(r[k] for r in rows if r.get(k) is not None), 2)  # noqa: E731
    last = runs[-1]
    attacks = []
    for row in last["attacks"]:
        same = [next(a for a in r["attacks"] if a["attack"] == row["attack"]) for r in runs]
        merged = {**row, **{k: med(same, k) for k in MEDIAN_KEYS if any(a.get(k) is not None for a in same)}}
        merged["meets_target"] = merged["ping_p99_x"] <= PING_TARGET and merged["decision_p99_x"] <= DECISION_TARGET
        attacks.append(merged)
    baseline = {**last["baseline"], **{k: med([r["baseline"] for r in runs], k) for k in MEDIAN_KEYS if k in last["baseline"]}}
    return {**last, "baseline": baseline, "attacks": attacks, "server_alive": all(r["server_alive"] for r in runs), "runs": runs}


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    # 10 s: about 500 pings and 50 turns a window. In 4 s the p99 of 200 pings is their second
    # largest, and a quiet baseline alone put every ping of a run at 2-7x.
    ap.add_argument("--seconds", type=float, default=10.0, help="each attack's (and the baseline's) duration (default 10)")
    ap.add_argument("--settle", type=float, default=1.0,
                    help="pause after each attack (default 1 s), then until the server's counters stand still")
    ap.add_argument("--only", nargs="+", choices=list(ATTACKS), help="these attacks only (default: all)")
    ap.add_argument("--model", default=models.SMALL_MODEL)
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads of the server (default 1)")
    ap.add_argument("--idle-cores", choices=("on", "off"), default="on",
                    help="[model] idle_cores of the server: a judgement takes every core while no other process uses them (default on)")
    ap.add_argument("--url", help="attack a running sidecar on loopback instead (its own config)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="[server] settings of the server it starts, e.g. max_batch_ms=50")
    ap.add_argument("--runs", type=int, default=1, help="whole runs, each with a fresh server; figures are medians (default 1)")
    ap.add_argument("--attack", choices=list(ATTACKS), help=argparse.SUPPRESS)  # the attacker process
    args = ap.parse_args(argv)
    if args.url and not args.url.startswith("ws://127.0.0.1:"):
        ap.error("loopback only: --url must be ws://127.0.0.1:PORT")
    return args


if __name__ == "__main__":
    a = parse()
    if a.attack:
        run_attacker(a.attack, a.url, a.seconds)
    else:
        results = [asyncio.run(main(a)) for _ in range(max(a.runs, 1))]
        result = results[0] if len(results) == 1 else medians(results)
        if a.json:
            print(json.dumps(result, indent=1))
