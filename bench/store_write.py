"""Store writes through real servers: acknowledged tool_results per second and the ack
latency (send to `ack`, client side; p50/p99), for SQLite and PostgreSQL, 1 and 2 replicas.

Each run starts a fresh store (a new SQLite file in a temp dir; a new database on a throwaway
PostgreSQL server started here, tests/pg_cluster.py, fsync on as a real one), `--replicas`
real `sidecar serve` processes on it (all-minilm-l6-v2, notes.json, 127.0.0.1), then
`--clients` websocket clients per replica, each sending `--results` successful tool_results
with at most `--window` of them unacknowledged. A result counts once its `ack` came (the
store committed it); a `store_busy` or `store_failed` error is counted apart. Afterwards the
store is read back: every acknowledged call must be there. Bounded: each run has a fixed
number of results and an overall timeout.

    .venv/bin/python bench/store_write.py --json
    .venv/bin/python bench/store_write.py --backends postgresql --replicas 2 --results 100 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import shutil
import signal
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from soak import serve  # noqa: E402  (bench/soak.py: one `sidecar serve` on 127.0.0.1, port 0)

from sidecar import protocol as p  # noqa: E402
from sidecar.client import SidecarClient  # noqa: E402
from sidecar.store import open_store  # noqa: E402
from tests.pg_cluster import Cluster  # noqa: E402

TOOLS = ["create_note", "read_note", "semantic_search"]
RUN_TIMEOUT_S = 900


async def client(url: str, name: str, n: int, window: int, latencies: list[float], errors: dict[str, int]) -> int:
    """Send `n` tool_results keeping at most `window` unacknowledged; returns the acks."""
    acked = 0
    sent_at: dict[str, float] = {}
    async with await SidecarClient.connect(url, session=name, agent=name, wait_s=60) as sc:
        sent = 0
        while sent < n or sent_at:
            while sent < n and len(sent_at) < window:
                ref = f"{name}-{sent}"
                sent_at[ref] = time.perf_counter()
                await sc.tool_result(TOOLS[sent % len(TOOLS)], True, 5.0 + sent % 50, ref=ref)
                sent += 1
            msg = await sc.recv(60)
            if isinstance(msg, p.Ack):
                latencies.append((time.perf_counter() - sent_at.pop(msg.ref)) * 1000)
                acked += 1
            elif isinstance(msg, p.Error) and msg.ref in sent_at:
                sent_at.pop(msg.ref)
                errors[msg.code] = errors.get(msg.code, 0) + 1
    return acked


def q(xs: list[float], pct: int) -> float | None:
    if len(xs) < 2:
        return round(xs[0], 2) if xs else None
    return round(statistics.quantiles(xs, n=100, method="inclusive")[pct - 1], 2)


async def one_run(backend: str, location: str, replicas: int, args, tmp: pathlib.Path) -> dict:
    config = tmp / f"{backend}-{replicas}.toml"
    config.write_text("[server]\nport = 0\n")
    procs = []
    try:
        for _ in range(replicas):  # one after the other: two model loads at once on 2 cores only slow both
            procs.append(await serve(location, config))
        # warm-up: a few results through each replica (first statements, prepared plans), not counted
        await asyncio.gather(*(client(url, f"warm{i}", 20, args.window, [], {}) for i, (_, url) in enumerate(procs)))
        latencies: list[float] = []
        errors: dict[str, int] = {}
        t0 = time.perf_counter()
        acks = await asyncio.gather(*(client(url, f"r{i}c{c}", args.results, args.window, latencies, errors)
                                      for i, (_, url) in enumerate(procs) for c in range(args.clients)))  # fmt: skip
        elapsed = time.perf_counter() - t0
    finally:
        for proc, _ in procs:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in procs:
            try:
                await asyncio.wait_for(proc.wait(), 60)
            except TimeoutError:
                proc.kill()
                await proc.wait()
    store = open_store(location)
    try:
        stored = store.query("SELECT count(*) FROM tool_calls WHERE agent LIKE 'r%'")[0][0]
    finally:
        store.close()
    acked = sum(acks)
    return {
        "backend": backend, "replicas": replicas, "clients": replicas * args.clients, "window": args.window,
        "sent": replicas * args.clients * args.results, "acked": acked, "errors": errors, "stored": int(stored),
        "seconds": round(elapsed, 2), "acks_per_s": round(acked / elapsed, 1),
        "ack_p50_ms": q(latencies, 50), "ack_p99_ms": q(latencies, 99), "ack_max_ms": round(max(latencies), 2) if latencies else None,
    }  # fmt: skip


async def main(args) -> dict:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="sidecar-store-write-"))
    cluster = Cluster() if "postgresql" in args.backends else None
    runs = []
    try:
        for backend in args.backends:
            for n in args.replicas:
                location = cluster.new_database() if backend == "postgresql" else str(tmp / f"bench-{n}.db")
                if backend == "postgresql" and args.synchronous_commit == "off":
                    location += "?options=-c%20synchronous_commit%3Doff"  # libpq's per-session setting
                run = await asyncio.wait_for(one_run(backend, location, n, args, tmp), RUN_TIMEOUT_S)
                if backend == "postgresql":
                    run["synchronous_commit"] = args.synchronous_commit
                runs.append(run)
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"cores": os.cpu_count(), "results_per_client": args.results, "clients_per_replica": args.clients, "runs": runs}


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", type=lambda s: s.split(","), default=["sqlite", "postgresql"], help="comma-separated: sqlite,postgresql")
    ap.add_argument("--replicas", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2], help="comma-separated counts (default 1,2)")
    ap.add_argument("--clients", type=int, default=4, help="websocket clients per replica")
    ap.add_argument("--results", type=int, default=500, help="tool_results per client")
    ap.add_argument("--window", type=int, default=8, help="unacknowledged results per client at most")
    ap.add_argument("--synchronous-commit", choices=("on", "off"), default="on",
                    help="PostgreSQL: off acks before the WAL reaches the disk (what a server crash, not a sidecar's, may lose)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not set(args.backends) <= {"sqlite", "postgresql"}:
        ap.error("--backends takes sqlite and/or postgresql")
    if min(args.replicas) < 1 or args.clients < 1 or args.results < 1 or args.window < 1:
        ap.error("--replicas, --clients, --results and --window must be positive")
    return args


def cli(argv=None) -> int:
    args = parse(argv)
    result = asyncio.run(main(args))
    if args.json:
        print(json.dumps(result))
    else:
        for r in result["runs"]:
            print(f"{r['backend']:10} x{r['replicas']}: {r['acks_per_s']:8.1f} acks/s, p50 {r['ack_p50_ms']} ms, p99 {r['ack_p99_ms']} ms "
                  f"({r['acked']}/{r['sent']} acked, {r['stored']} stored, errors {r['errors']})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(cli())
