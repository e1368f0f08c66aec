"""Load on the streaming server: N concurrent streams at R tokens/s over loopback.

For each model, starts `sidecar serve` on 127.0.0.1 (or uses --url), opens N connections
that each stream LLM replies word by word at R tokens/s for a bounded duration, and
reports per N:

- decision latency after a clause boundary, client side: from sending the token that
  completed the clause (the whitespace after its terminator) to receiving the `decision`
  message (hello.decisions opts in, so silent decisions are timed too); and the server's own
  `latency_ms` from the frame's arrival to the message;
- CPU use of the server process (process_cpu_seconds_total from /metrics, all threads;
  100% = one core);
- evaluations dropped under load (sidecar_dropped_evaluations_total from /metrics);
- how far the load generator itself fell behind its schedule (if it did, the client side
  numbers include its own delays).

Then it searches (doubling, then bisecting) for the largest N whose median p99 over
--repeat runs stays under --target-ms at --rate tokens/s.

    .venv/bin/python bench/stream_load.py                       # both models, search
    .venv/bin/python bench/stream_load.py --models all-minilm-l6-v2 --streams 1 8 32
    .venv/bin/python bench/stream_load.py --url ws://127.0.0.1:8765 --streams 16
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import os
import pathlib
import random
import re
import statistics
import sys
import tempfile
import time
import urllib.request

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sidecar import models  # noqa: E402
from sidecar import protocol as p  # noqa: E402
from sidecar.client import SidecarClient, tokens  # noqa: E402

NOTES = ROOT / "fixtures" / "catalogs" / "notes.json"
REPLY = (
    "Sure, I can help with that. I should call semantic_search to find the kubernetes setup. "
    "The cluster runs three nodes; each one hosts part of the control plane. "
    "Let me create a note with this meeting summary. That should cover everything you asked for.\n"
)


class Run:
    """What one load run measured."""

    def __init__(self) -> None:
        self.client_ms: list[float] = []  # boundary-completing token sent -> decision received
        self.server_ms: list[float] = []  # the decision's own latency_ms
        self.lag_ms: list[float] = []  # how late each token was sent against the schedule
        self.decisions = 0
        self.injects = 0
        self.tokens = 0
        self.cpu = 0.0
        self.dropped = 0.0
        self.seconds = 0.0


def boundary_char(text: str, end: int) -> int:
    """Index of the character whose arrival made the segmenter emit a span ending at `end`:
    the first whitespace at or after it (terminators and closers sit in between)."""
    i = end
    while i < len(text) and not text[i].isspace():
        i += 1
    return i


async def one_stream(url: str, idx: int, rate: float, t0: float, duration: float, run: Run, token: str | None) -> None:
    sc = await SidecarClient.connect(url, session=f"bench-{idx}", token=token, decisions=True)
    pieces = tokens(REPLY)
    starts = list(np.cumsum([0] + [len(t) for t in pieces[:-1]]))
    sent: dict[str, list[float]] = {}  # stream id -> send time per token
    done = asyncio.Event()

    async def read() -> None:
        async for msg in sc:
            now = time.perf_counter()
            if isinstance(msg, p.Inject):
                run.injects += 1
            elif isinstance(msg, p.DecisionReport):
                run.decisions += 1
                times = sent.get(msg.stream)
                if msg.reason == "boundary" and times is not None:
                    k = bisect.bisect_right(starts, boundary_char(REPLY, msg.end)) - 1
                    run.client_ms.append((now - times[k]) * 1000)
                    run.server_ms.append(msg.latency_ms)
            if done.is_set() and isinstance(msg, p.Pong):
                return

    reader = asyncio.create_task(read())
    step = 1.0 / rate
    due = t0 + random.random() * step  # streams out of phase, as real ones are
    n = 0
    while due < t0 + duration:
        sid = f"s{idx}-{n}"
        times = sent[sid] = []
        for piece in pieces:
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.perf_counter()
            run.lag_ms.append(max(0.0, now - due) * 1000)
            await sc.token(sid, piece)
            times.append(now)
            run.tokens += 1
            due += step
        await sc.end(sid)
        n += 1
    done.set()
    await sc.ping()
    try:
        await asyncio.wait_for(reader, 10)
    except TimeoutError:
        pass
    await sc.close()


def scrape(http: str, token: str | None) -> dict[str, float]:
    req = urllib.request.Request(http + "/metrics", headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def dropped(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("sidecar_dropped_evaluations_total"))


async def load(url: str, n: int, rate: float, duration: float, token: str | None) -> Run:
    http = "http" + url[2:]
    run = Run()
    before = await asyncio.to_thread(scrape, http, token)
    t0 = time.perf_counter() + 0.5 + n * 0.005  # connections open before the clock starts
    await asyncio.gather(*(one_stream(url, i, rate, t0, duration, run, token) for i in range(n)))
    run.seconds = time.perf_counter() - t0
    after = await asyncio.to_thread(scrape, http, token)
    run.cpu = (after["process_cpu_seconds_total"] - before["process_cpu_seconds_total"]) / run.seconds
    run.dropped = dropped(after) - dropped(before)
    return run


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


class Summary:
    """Medians over repeated runs at one N."""

    def __init__(self, n: int, runs: list[Run]):
        med = statistics.median
        self.n = n
        self.p50 = med(pct(r.client_ms, 50) for r in runs)
        self.p99 = med(pct(r.client_ms, 99) for r in runs)
        self.srv_p50 = med(pct(r.server_ms, 50) for r in runs)
        self.srv_p99 = med(pct(r.server_ms, 99) for r in runs)
        self.cpu = med(r.cpu for r in runs)
        self.dropped = med(r.dropped for r in runs)
        self.decisions = med(r.decisions for r in runs)
        self.lag_p99 = med(pct(r.lag_ms, 99) for r in runs)
        self.p99s = [pct(r.client_ms, 99) for r in runs]

    def row(self) -> str:
        p99s = "/".join(f"{x:.0f}" for x in self.p99s)
        return (f"{self.n:>5} {self.p50:>8.1f} {self.p99:>8.1f} {self.srv_p50:>8.1f} {self.srv_p99:>8.1f} "
                f"{self.cpu * 100:>6.0f}% {self.dropped:>7.0f} {self.decisions:>9.0f} {self.lag_p99:>8.1f}   {p99s}")  # fmt: skip


HEADER = f"{'N':>5} {'p50 ms':>8} {'p99 ms':>8} {'srv p50':>8} {'srv p99':>8} {'cpu':>7} {'dropped':>7} {'decisions':>9} {'lag p99':>8}   p99 per run"


async def measure(url: str, n: int, args, token: str | None) -> Summary:
    runs = [await load(url, n, args.rate, args.duration, token) for _ in range(args.repeat)]
    s = Summary(n, runs)
    print(s.row(), flush=True)
    return s


async def search(url: str, args, token: str | None) -> tuple[int, list[Summary]]:
    """Largest N with median p99 < target: double until it fails, then bisect."""
    rows: list[Summary] = []
    ok, bad, n = 0, None, 1
    while n <= args.max_streams:
        s = await measure(url, n, args, token)
        rows.append(s)
        if s.p99 < args.target_ms:
            ok, n = n, n * 2
        else:
            bad = n
            break
    while bad is not None and bad - ok > max(1, ok // 8):
        mid = (ok + bad) // 2
        s = await measure(url, mid, args, token)
        rows.append(s)
        ok, bad = (mid, bad) if s.p99 < args.target_ms else (ok, mid)
    return ok, rows


async def serve(model: str, store: pathlib.Path, threads: int | None) -> tuple[asyncio.subprocess.Process, str]:
    env = {**os.environ, **({"SIDECAR_THREADS": str(threads)} if threads else {})}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sidecar", "serve", "--port", "0", "--model", model, "--catalog", str(NOTES), "--store", str(store),
        stderr=asyncio.subprocess.PIPE, cwd=ROOT, env=env,
    )  # fmt: skip
    for _ in range(100):
        line = (await proc.stderr.readline()).decode()
        if found := re.search(r"listening on (ws://\S+)", line):
            asyncio.create_task(_drain(proc.stderr))
            return proc, found.group(1)
        if not line:
            break
    raise RuntimeError(f"sidecar serve did not start for {model}")


async def _drain(stream) -> None:
    while await stream.readline():
        pass


async def bench_model(model: str | None, args) -> None:
    proc = None
    url = args.url
    if url is None:
        proc, url = await serve(model, pathlib.Path(args.tmp) / f"{model}.db", args.threads)
    try:
        probe = await SidecarClient.connect(url, session="probe", token=args.token, wait_s=300)
        name = probe.ready.model
        await probe.close()
        threads = args.threads or "default"
        print(f"\n== {name} (model threads: {threads}): {args.rate:g} tokens/s per stream, {args.duration:g} s per run, {args.repeat} runs per N (medians) ==")
        print(HEADER)
        if args.streams:
            for n in args.streams:
                await measure(url, n, args, args.token)
        else:
            best, _ = await search(url, args, args.token)
            print(f"largest N with p99 < {args.target_ms:g} ms at {args.rate:g} tokens/s: {best}")
    finally:
        if proc is not None:
            proc.terminate()
            await proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running sidecar (default: start one per model on 127.0.0.1)")
    ap.add_argument("--models", nargs="+", default=[models.SMALL_MODEL, models.DEFAULT_MODEL])
    ap.add_argument("--streams", type=int, nargs="+", help="fixed N values (default: search for the largest passing N)")
    ap.add_argument("--rate", type=float, default=50.0, help="tokens/s per stream (default 50)")
    ap.add_argument("--duration", type=float, default=6.0, help="seconds per run (default 6)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per N; medians are reported (default 3)")
    ap.add_argument("--target-ms", type=float, default=50.0)
    ap.add_argument("--max-streams", type=int, default=512)
    ap.add_argument("--token", help="the server's shared token, with --url")
    ap.add_argument("--threads", type=int, help="llama.cpp threads of the server it starts (SIDECAR_THREADS; default: the config's)")
    args = ap.parse_args()
    if args.url and args.url.split(":")[1].strip("/") not in ("127.0.0.1", "localhost", "[::1]"):
        ap.error("loopback only: --url must be ws://127.0.0.1:PORT")
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        for model in [None] if args.url else args.models:
            asyncio.run(bench_model(model, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
