"""Overload (issue 33): decision latency and shed spans at 1x, 4x and 16x the streams the
model can judge, against a real `sidecar serve` on 127.0.0.1 (MiniLM, one model thread unless
--threads, notes catalog).

First the model's capacity: FLOOD_CONNECTIONS connections stream a clause every FLOOD_EVERY_S
for --seconds (far more than it can judge), and the spans judged per second (sidecar_detections_total) are what the
model can judge, S. A bench stream sends one clause (a new text: no query cache) every
--period seconds, one stream per connection, so the model can judge S x period streams: the
1x load. Then each load in --loads runs for --seconds: every stream's clauses are timed from
the frame to their `decision`, and what never got one is counted by the server's reason
(/metrics: superseded, shed, overflow, stale).

Reported per load: streams, clauses sent, decided, p50/p99/max decision latency (ms) of the
decided ones, the dropped counts by reason, and the share of streams that got at least one
decision (shedding whole streams keeps the rest answered in time).

    .venv/bin/python bench/overload.py --json > overload.json
    .venv/bin/python bench/overload.py --loads 4 --seconds 5 --set shed_ms=500

Progress goes to stderr; with --json, stdout holds only the JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import sys
import tempfile
import time

import websockets

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from attacks import TOPICS, log, pct, scrape, serve, server_table, stop  # noqa: E402

from sidecar.core import models  # noqa: E402

FLOOD_CONNECTIONS = 8
FLOOD_EVERY_S = 0.005
CONNECT_WAVE = 32  # connections opened at once


class Stream:
    """One connection with one stream: a clause every `period` s, each timed to its decision."""

    def __init__(self, idx: int):
        self.idx = idx
        self.sent: dict[str, float] = {}
        self.latencies: list[float] = []
        self.n = 0

    async def open(self, url: str):
        self.ws = await websockets.connect(url, max_size=None, compression=None, open_timeout=60)
        await self.ws.send(json.dumps({"type": "hello", "session": f"load-{self.idx}", "decisions": True}))
        assert json.loads(await self.ws.recv())["type"] == "ready"
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                msg = json.loads(raw)
                if msg["type"] == "decision" and (t0 := self.sent.pop(msg["text"], None)) is not None:
                    self.latencies.append((time.perf_counter() - t0) * 1000)
        except websockets.ConnectionClosed:
            pass

    def clause(self) -> str:
        self.n += 1
        return f"Next I look at {TOPICS[(self.idx + self.n) % len(TOPICS)]} for case {self.idx} {self.n}"

    async def run(self, until: float, period: float, phase: float) -> None:
        await asyncio.sleep(phase)
        while time.monotonic() < until:
            text = self.clause()
            self.sent[text] = time.perf_counter()
            await self.ws.send(json.dumps({"type": "token", "stream": "r", "delta": text + ". "}))
            await asyncio.sleep(period)

    async def flood(self, until: float) -> None:
        """A clause every FLOOD_EVERY_S on 16 streams: far more than the model judges, at little
        cost to this process (a loop without pauses would take the CPU the server needs)."""
        while time.monotonic() < until:
            await self.ws.send(json.dumps({"type": "token", "stream": f"r{self.n % 16}", "delta": self.clause() + ". "}))
            await asyncio.sleep(FLOOD_EVERY_S)

    async def close(self) -> None:
        self.reader.cancel()
        await self.ws.close()


async def open_streams(url: str, n: int, start: int = 0) -> list[Stream]:
    streams = [Stream(start + i) for i in range(n)]
    for i in range(0, n, CONNECT_WAVE):
        await asyncio.gather(*(s.open(url) for s in streams[i:i + CONNECT_WAVE]))
    return streams


def judged(metrics: dict[str, float]) -> float:
    return sum(v for k, v in metrics.items() if k.startswith("sidecar_detections_total"))


def dropped(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    out = {}
    for k, v in after.items():
        if k.startswith("sidecar_dropped_evaluations_total"):
            out[k.split('"')[1]] = int(v - before.get(k, 0.0))
    return out


async def capacity(url: str, seconds: float) -> float:
    """Spans judged per second with the model kept busy."""
    streams = await open_streams(url, FLOOD_CONNECTIONS, start=100_000)
    await asyncio.gather(*(s.flood(time.monotonic() + 1.0) for s in streams))  # warm up
    before, t0 = scrape(url), time.monotonic()
    await asyncio.gather(*(s.flood(t0 + seconds) for s in streams))
    rate = (judged(scrape(url)) - judged(before)) / (time.monotonic() - t0)
    for s in streams:
        await s.close()
    return rate


async def load(url: str, n: int, args) -> dict:
    streams = await open_streams(url, n)
    before = scrape(url)
    until = time.monotonic() + args.seconds
    await asyncio.gather(*(s.run(until, args.period, args.period * i / n) for i, s in enumerate(streams)))
    await asyncio.sleep(min(5.0, args.period * 4))  # the last clauses' decisions
    after = scrape(url)
    lat = [x for s in streams for x in s.latencies]
    sent = sum(s.n for s in streams)
    row = {"streams": n, "sent": sent, "decided": len(lat), "decision_p50_ms": pct(lat, 0.5), "decision_p99_ms": pct(lat, 0.99),
           "decision_max_ms": pct(lat, 1.0), "dropped": dropped(before, after),
           "streams_answered": round(sum(bool(s.latencies) for s in streams) / n, 3)}  # fmt: skip
    for s in streams:
        await s.close()
    return row


async def main(args) -> dict:
    config = server_table(args.set, max_connections=4096, max_connections_per_address=4096)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = await serve(args, pathlib.Path(tmp), config)
        try:
            log(f"server at {url}; measuring the model's capacity ...")
            rate = await capacity(url, args.seconds)
            base = max(1, round(rate * args.period))
            log(f"{rate:.1f} spans/s judged: {base} streams of a clause every {args.period:g} s")
            rows = []
            for x in args.loads:
                await asyncio.sleep(args.settle)
                row = {"load": x, **await load(url, int(base * x), args)}
                rows.append(row)
                log(f"{x}x: {row['streams']} streams, {row['decided']}/{row['sent']} decided, p50 {row['decision_p50_ms']} ms, "
                    f"p99 {row['decision_p99_ms']} ms, dropped {row['dropped']}, streams answered {row['streams_answered']:.0%}")  # fmt: skip
            return {"model": args.model, "threads": args.threads, "period_s": args.period, "seconds": args.seconds,
                    "settings": args.set, "capacity_spans_per_s": round(rate, 1), "capacity_streams": base, "loads": rows}  # fmt: skip
        finally:
            await stop(proc)


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--loads", type=float, nargs="+", default=[1, 4, 16], help="multiples of the capacity (default 1 4 16)")
    ap.add_argument("--seconds", type=float, default=8.0, help="each load's duration, and the capacity run's (default 8)")
    ap.add_argument("--period", type=float, default=0.5, help="seconds between a stream's clauses (default 0.5)")
    ap.add_argument("--settle", type=float, default=3.0, help="pause before each load (default 3 s)")
    ap.add_argument("--model", default=models.SMALL_MODEL)
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads of the server (default 1)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="[server] settings, e.g. shed_ms=500")
    return ap.parse_args(argv)


if __name__ == "__main__":
    a = parse()
    result = asyncio.run(main(a))
    if a.json:
        print(json.dumps(result, indent=1))
