"""Soak: N concurrent connections for a bounded time at a mixed load against a real
`sidecar serve` on 127.0.0.1, with a probe client timing its injections.

Starts the server (all-minilm-l6-v2, notes.json, a fresh SQLite store in a temp dir,
max_connections raised to fit), opens --connections websocket clients (in waves, retrying a
503), and has each one, for --seconds, every --interval seconds on average (jittered) do one
of: stream an LLM reply word by word, send a user turn (and, when the turn calls for a tool,
the tool_result of the model's call, some failed, as a chat app reports it: learning from
traffic, on by default, learns from these pairs), report the call again, send a feedback,
ping; every client reads everything promptly. Meanwhile a probe client
sends a user turn that calls for a tool every --probe-every seconds on a fresh stream and
times, client side, send to `inject`.

Reports (--json: one object): the probe's p50/p99/max injection latency and misses (no
inject within --probe-timeout; `ended_no_inject`: those the server ended without an inject, of
which `judged_silent` the gate judged and did not fire on (their verdicts in `silent`) and the
rest were shed under load: the probe asks for every verdict, `hello.decisions`), the server's RSS over time (sampled from /proc), messages
and errors by kind, connections lost and their close codes, connect failures, and the
dropped evaluations from /metrics. `memory` breaks RSS down every --sample-every seconds:
anonymous and file-backed parts (/proc/PID/smaps_rollup), threads, and from /metrics what
glibc malloc holds (in use, freed but kept, arenas), SQLite's allocations, Python's
allocated blocks, the stream states sessions remember and the query cache's entries; with
start, +60 s, end and the slope over the last third (MB a minute) of RSS, anonymous memory
and malloc's free bytes, to tell a bound being filled from a leak. --env sets variables in
the server's environment (MALLOC_ARENA_MAX=2), --set config settings (server.closed_streams=8).
It stops by itself: the load ends after --seconds, every client closes, the server gets
SIGTERM (then SIGKILL after a grace period).

    .venv/bin/python bench/soak.py --json                                 # 1,000 connections, 600 s
    .venv/bin/python bench/soak.py --connections 200 --seconds 60 --json  # a quick run
    .venv/bin/python bench/soak.py --connections 200 --seconds 420 --interval 1 --json  # memory: the per-connection bounds fill in ~90 s
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import pathlib
import random
import re
import signal
import statistics
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sidecar.core import models  # noqa: E402
from sidecar import protocol as p  # noqa: E402
from sidecar.client import SidecarClient, tokens  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402

NOTES = ROOT / "fixtures" / "catalogs" / "notes.json"
PROBE = "I should call create_note to save this meeting summary number {i}."
REPLIES = [
    "Sure, I can help with that. I should call semantic_search to find the kubernetes setup. ",
    "The cluster runs three nodes; each one hosts part of the control plane. ",
    "Let me create a note with this meeting summary. That should cover everything you asked for.\n",
    "Nothing to look up here: the answer is forty two, as discussed before. ",
]
TURNS = {  # a user turn, and the tool the model then calls (None: it answers without one)
    "Where did I put the kubernetes setup?": "semantic_search",
    "Please save this as a note for later.": "create_note",
    "What is the capital of France?": None,
    "Thanks, that was helpful.": None,
    "Can you find my notes about the quarterly planning meeting?": "semantic_search",
}
TOOLS = ["create_note", "read_note", "semantic_search"]


class Tally:
    def __init__(self) -> None:
        self.received: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()
        self.closes: collections.Counter[str] = collections.Counter()
        self.sent: collections.Counter[str] = collections.Counter()
        self.connect_failures = 0
        self.connected = 0


async def serve(store: pathlib.Path, config: pathlib.Path, env: dict[str, str] | None = None) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sidecar", "serve", "--config", str(config), "--catalog", str(NOTES), "--store", str(store),
        stderr=asyncio.subprocess.PIPE, cwd=ROOT, env={**os.environ, "SIDECAR_MODEL": models.SMALL_MODEL, **(env or {})},
    )  # fmt: skip
    deadline = time.monotonic() + 600
    said = ""
    while time.monotonic() < deadline:
        line = (await asyncio.wait_for(proc.stderr.readline(), 600)).decode()
        if found := re.search(r"listening on (ws://\S+)", line):
            asyncio.create_task(_drain(proc.stderr))
            return proc, found.group(1)
        if not line:
            break
        said = line.strip() or said
    if proc.returncode is None:
        proc.kill()
    raise RuntimeError(f"sidecar serve did not start: {said}")


async def _drain(stream) -> None:
    while await stream.readline():
        pass


def rss_mb(pid: int) -> float | None:
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def memory(pid: int, url: str | None) -> dict[str, float]:
    """One memory sample of the server, MB: RSS and its anonymous / file parts
    (/proc/PID/smaps_rollup), threads, and what /metrics says glibc malloc and SQLite hold."""
    out: dict[str, float] = {}
    try:
        for line in pathlib.Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("Rss", "Anonymous", "Pss_File"):
                out[{"Rss": "rss", "Anonymous": "anon", "Pss_File": "file"}[key]] = round(int(rest.split()[0]) / 1024, 1)
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
    except OSError:
        return out
    if url is not None:
        try:
            m = scrape(url)
        except OSError:
            return out
        for name, key in (("sidecar_malloc_heap_bytes", "malloc_heap"), ("sidecar_malloc_in_use_bytes", "malloc_used"),
                          ("sidecar_malloc_free_bytes", "malloc_free"), ("sidecar_sqlite_memory_bytes", "sqlite")):  # fmt: skip
            if name in m:
                out[key] = round(m[name] / 2**20, 2)
        for name, key in (("sidecar_malloc_arenas", "arenas"), ("sidecar_query_cache_entries", "query_cache"),
                          ("sidecar_session_streams", "streams"), ("sidecar_python_allocated_blocks", "py_blocks"),
                          ("sidecar_records_waiting", "records_waiting")):  # fmt: skip
            if name in m:
                out[key] = int(m[name])
    return out


def trend(samples: list[tuple[float, dict]], key: str = "rss") -> dict:
    """start, +60 s, end and the slope over the last third (MB a minute, least squares) of
    one sampled series: whether memory levels off."""
    pts = [(t, m[key]) for t, m in samples if key in m]
    if len(pts) < 3:
        return {}
    at_60 = min(pts, key=lambda p: abs(p[0] - 60))[1]
    tail = [p for p in pts if p[0] >= pts[-1][0] * 2 / 3] or pts[-2:]
    slope = statistics.linear_regression([t for t, _ in tail], [v for _, v in tail]).slope * 60 if len(tail) >= 2 else None
    return {"start": pts[0][1], "at_60s": at_60, "end": pts[-1][1], "max": max(v for _, v in pts),
            "last_third_mb_per_min": round(slope, 3) if slope is not None else None}


def scrape(url: str) -> dict[str, float]:
    http = url.replace("ws://", "http://") + "/metrics"
    out = {}
    with urllib.request.urlopen(http, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
    return out


async def reader(sc: SidecarClient, tally: Tally) -> None:
    try:
        async for msg in sc:
            kind = type(msg).__struct_config__.tag
            tally.received[kind] += 1
            if isinstance(msg, p.Error):
                tally.errors[msg.code] += 1
    except Exception as e:  # noqa: BLE001 (counted: the soak reports it)
        tally.closes[type(e).__name__] += 1
        return
    code = sc.ws.close_code
    if code is not None and code != 1000:
        tally.closes[str(code)] += 1


async def result(sc, tool: str, rnd: random.Random, ref: str, tally: Tally) -> None:
    ok = rnd.random() > 0.2
    await sc.tool_result(tool, ok, rnd.uniform(5, 500), None if ok else "timeout", ref=ref)
    tally.sent["tool_result"] += 1


async def worker(i: int, url: str, stop: float, args, tally: Tally, rnd: random.Random) -> None:
    sc = None
    for attempt in range(20):
        try:
            sc = await SidecarClient.connect(url, session=f"soak-{i}", agent=f"agent-{i % 10}", wait_s=30)
            break
        except Exception:  # noqa: BLE001 (503 at the limit, a refused connect: retried)
            await asyncio.sleep(0.2 * (attempt + 1))
    if sc is None:
        tally.connect_failures += 1
        return
    tally.connected += 1
    reading = asyncio.create_task(reader(sc, tally))
    n = 0
    called: str | None = None  # the tool the model called after this client's last user turn
    try:
        while time.monotonic() < stop and not reading.done():
            await asyncio.sleep(rnd.uniform(0.5, 1.5) * args.interval)
            if time.monotonic() >= stop:
                break
            n += 1
            roll = rnd.random()
            if roll < 0.35:  # an LLM reply, word by word
                stream = f"r{n}"
                for tok in tokens(rnd.choice(REPLIES)):
                    await sc.token(stream, tok)
                    await asyncio.sleep(0.02)
                await sc.end(stream)
                tally.sent["reply"] += 1
            elif roll < 0.65:  # a user turn, and the call the model makes for it, as a chat app reports them
                text = rnd.choice(list(TURNS))
                await sc.user(f"u{n}", text)
                tally.sent["user"] += 1
                called = TURNS[text]
                if called is not None:
                    await result(sc, called, rnd, f"t{n}", tally)
            elif roll < 0.8 and called is not None:  # the model calls the turn's tool again
                await result(sc, called, rnd, f"t{n}", tally)
            elif roll < 0.9:
                await sc.feedback(rnd.choice(TOOLS), rating=float(rnd.randint(0, 5)), selected=True, query="notes", ref=f"f{n}")
                tally.sent["feedback"] += 1
            else:
                await sc.ping()
                tally.sent["ping"] += 1
    except Exception as e:  # noqa: BLE001
        tally.closes[f"send:{type(e).__name__}"] += 1
    finally:
        await asyncio.sleep(1.0)  # let the last answers arrive
        await sc.close()
        reading.cancel()


async def probe(url: str, stop: float, args) -> dict:
    latencies: list[float] = []
    server_ms: list[float] = []
    misses = 0
    ended_no_inject = 0  # of the misses: ended with no inject (judged silent, or shed), not timed out
    silent: list[dict] = []  # the verdicts on the probes judged and not fired on
    lost = None  # how the probe's connection closed, if the server closed it
    async with await SidecarClient.connect(url, session="probe", wait_s=60, decisions=True) as sc:
        i = 0
        while time.monotonic() < stop:
            i += 1
            t0 = time.perf_counter()
            await sc.user(f"p{i}", PROBE.format(i=i))
            await sc.end(f"p{i}")
            got, verdicts = None, []
            try:
                deadline = t0 + args.probe_timeout
                while True:
                    msg = await sc.recv(max(0.01, deadline - time.perf_counter()))
                    if isinstance(msg, p.Inject) and msg.stream == f"p{i}" and got is None:
                        got = time.perf_counter() - t0
                        server_ms.append(msg.latency_ms)
                    if isinstance(msg, p.DecisionReport) and msg.stream == f"p{i}":
                        verdicts.append({"probe": i, "fired": msg.fired, "probability": msg.probability, "tool": msg.tool, "path": msg.path})
                    if isinstance(msg, p.Ended) and msg.stream == f"p{i}":
                        ended_no_inject += got is None
                        if got is None and verdicts:
                            silent.extend(verdicts)
                        break
            except TimeoutError:
                pass
            except ConnectionClosed as e:  # counted, not raised: the report says what the probe saw
                lost = f"{e.rcvd.code if e.rcvd else 'no close frame'} at probe {i}"
                misses += 1
                break
            if got is None:
                misses += 1
            else:
                latencies.append(got * 1000)
            await asyncio.sleep(max(0.0, args.probe_every - (time.perf_counter() - t0)))

    def q(xs, f):
        return round(statistics.quantiles(xs, n=100, method="inclusive")[f - 1], 1) if len(xs) >= 2 else (round(xs[0], 1) if xs else None)

    return {"probes": i, "injects": len(latencies), "misses": misses, "ended_no_inject": ended_no_inject,
            "judged_silent": len({v["probe"] for v in silent}), "silent": silent[:20], "connection_lost": lost, "p50_ms": q(latencies, 50), "p99_ms": q(latencies, 99),
            "max_ms": round(max(latencies), 1) if latencies else None, "server_p50_ms": q(server_ms, 50),
            "server_p99_ms": q(server_ms, 99)}  # fmt: skip


async def main(args) -> dict:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="sidecar-soak-"))
    config = tmp / "soak.toml"
    config.write_text(toml(args.connections, args.set))
    t_start = time.monotonic()
    proc, url = await serve(tmp / "soak.db", config, dict(kv.split("=", 1) for kv in args.env))
    tally = Tally()
    rss: list[tuple[float, float]] = []
    mem: list[tuple[float, dict]] = []
    result: dict = {}
    try:
        rss.append((0.0, rss_mb(proc.pid)))
        mem.append((0.0, memory(proc.pid, url)))
        stop = time.monotonic() + args.seconds
        rnd = random.Random(args.seed)
        workers = []
        for i in range(args.connections):  # in waves, so the handshakes do not all land at once
            workers.append(asyncio.create_task(worker(i, url, stop, args, tally, random.Random(rnd.random()))))
            if i % 50 == 49:
                await asyncio.sleep(0.2)
        probing = asyncio.create_task(probe(url, stop, args))
        t0 = time.monotonic()
        while time.monotonic() < stop:
            await asyncio.sleep(min(args.sample_every, max(0.0, stop - time.monotonic())))
            rss.append((round(time.monotonic() - t0, 1), rss_mb(proc.pid)))
            mem.append((rss[-1][0], await asyncio.to_thread(memory, proc.pid, url)))
        result["probe"] = await asyncio.wait_for(probing, args.probe_timeout + 30)
        await asyncio.wait_for(asyncio.gather(*workers, return_exceptions=True), 60)
        m = scrape(url)
        result["server"] = {
            "dropped": {r: m.get(f'sidecar_dropped_evaluations_total{{reason="{r}"}}', 0) for r in ("superseded", "shed", "overflow", "stale")},
            "errors": {k.split('"')[1]: v for k, v in m.items() if k.startswith("sidecar_errors_total")},
            "injections": sum(v for k, v in m.items() if k.startswith("sidecar_injections_total")),
            "batches": m.get("sidecar_batch_size_count"),
            "cpu_s": m.get("process_cpu_seconds_total"),
            "refits": {r: m.get(f'sidecar_refits_total{{outcome="{r}"}}', 0) for r in ("swapped", "kept")},
            "traffic_examples": {r: m.get(f'sidecar_traffic_examples_total{{kind="{r}"}}', 0) for r in ("called", "silent")},
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()
    values = [r for _, r in rss if r is not None]
    result.update({
        "connections": args.connections, "connected": tally.connected, "connect_failures": tally.connect_failures,
        "seconds": args.seconds, "interval_s": args.interval,
        "sent": dict(tally.sent), "received": dict(tally.received), "client_errors": dict(tally.errors),
        "closed_abnormally": dict(tally.closes),
        "rss_mb": {"start": round(values[0], 1) if values else None, "max": round(max(values), 1) if values else None,
                   "end": round(values[-1], 1) if values else None,
                   "samples": [[t, round(r, 1)] for t, r in rss if r is not None]},
        "memory": {"rss": trend(mem), "anon": trend(mem, "anon"), "malloc_free": trend(mem, "malloc_free"),
                   "records_waiting": trend(mem, "records_waiting"),
                   "samples": [{"t": t, **m} for t, m in mem]},
        "env": args.env, "set": args.set,
        "server_exit": proc.returncode, "wall_s": round(time.monotonic() - t_start, 1),
    })  # fmt: skip
    return result


def toml(connections: int, settings: list[str]) -> str:
    """The server's config: port 0, max_connections raised to fit (per address too: every
    client is on 127.0.0.1), and each SECTION.KEY=VALUE."""
    tables: dict[str, list[str]] = {"server": ["port = 0", f"max_connections = {connections + 16}",
                                               f"max_connections_per_address = {connections + 16}"]}
    for item in settings:
        key, _, value = item.partition("=")
        section, _, name = key.partition(".")
        tables.setdefault(section, []).append(f"{name} = {value}")
    return "".join(f"[{t}]\n" + "\n".join(lines) + "\n" for t, lines in tables.items())


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connections", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=600.0, help="how long the load runs (default 10 minutes)")
    ap.add_argument("--interval", type=float, default=10.0, help="mean seconds between one client's actions")
    ap.add_argument("--probe-every", type=float, default=1.0)
    ap.add_argument("--probe-timeout", type=float, default=10.0)
    ap.add_argument("--sample-every", type=float, default=5.0, help="RSS sampling period, seconds")
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="set in the server's environment (repeat), e.g. MALLOC_ARENA_MAX=2")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a config setting (repeat), e.g. server.closed_streams=8 or index.query_cache=64")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.connections < 1 or args.seconds <= 0 or args.interval <= 0:
        ap.error("--connections, --seconds and --interval must be positive")
    return args


def cli(argv=None) -> int:
    args = parse(argv)
    result = asyncio.run(asyncio.wait_for(main(args), args.seconds + 900))
    if args.json:
        print(json.dumps(result))
    else:
        pr = result["probe"]
        print(f"{result['connected']}/{args.connections} connected for {args.seconds:g} s; probe: {pr['injects']}/{pr['probes']} injected, "
              f"p50 {pr['p50_ms']} ms, p99 {pr['p99_ms']} ms, misses {pr['misses']} ({pr['judged_silent']} judged silent); RSS {result['rss_mb']['start']} -> "
              f"{result['rss_mb']['max']} MB max ({result['memory']['rss']}); errors {result['client_errors']}; abnormal closes {result['closed_abnormally']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(cli())
