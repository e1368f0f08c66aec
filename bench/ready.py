"""How soon a `sidecar serve` on a fresh store answers, and how soon it has the whole catalog
(issue 50: ready in seconds).

    python bench/ready.py [--catalog fixtures/catalogs/ALL.json] [--model M] [--runs 3]
    python bench/ready.py --python /other/checkout/.venv/bin/python   # another build, side by side
    python bench/ready.py --warm --runs 5   # restarts on a store that has every vector

Each run starts `sidecar serve` on 127.0.0.1 with a new SQLite store (nothing embedded yet)
and polls /healthz every 0.1 s: "answering" is the first 200 (the websocket serves from then
on), "whole" the first plain "ok" (every tool indexed; before the written cases are added,
which the log says after). With `--probe-every S`, a client sends a user turn every S seconds
from "answering" to "whole" and times each to its `ended` (what a user waits for a decision
while the catalog is indexed beside it). Prints each run and the medians.

`--warm`: one cold run fills a store (to "whole", then the written cases: the log's "written
cases added"), then each run restarts on that store and is timed, polling every 10 ms, to its
first answer. Warm runs start as an installed sidecar does, with Python's bytecode cache
(PYTHONDONTWRITEBYTECODE unset for them: without it every start compiles ~55 modules again,
0.17 s here).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROBES = ["read the file notes-{i}.txt", "what's the weather in city {i} tomorrow", "thanks, that helps with part {i}", "open pull request {i} for my branch"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(port: int) -> tuple[int, str] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            return r.status, r.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


class Prober(threading.Thread):
    """User turns sent every `every` seconds until stopped; `ms` the round trips to `ended`."""

    def __init__(self, port: int, every: float):
        super().__init__(daemon=True)
        self.port, self.every, self.ms, self.stop = port, every, [], threading.Event()

    def run(self) -> None:
        asyncio.run(self._probe())

    async def _probe(self) -> None:
        from sidecar import protocol as p
        from sidecar.client import SidecarClient

        async with await SidecarClient.connect(f"ws://127.0.0.1:{self.port}", session="probe", wait_s=30) as sc:
            i = 0
            while not self.stop.is_set():
                i += 1
                t0 = time.perf_counter()
                await sc.user(f"p{i}", PROBES[i % len(PROBES)].format(i=i))  # new texts: no cached vector
                await sc.end(f"p{i}")
                while not (isinstance(msg := await sc.recv(60), p.Ended) and msg.stream == f"p{i}"):
                    pass
                self.ms.append((time.perf_counter() - t0) * 1000)
                await asyncio.sleep(max(0.0, self.every - (time.perf_counter() - t0)))


def run_once(python: str, catalog: str, model: str | None, limit_s: float, cwd: pathlib.Path,
             probe_every: float | None = None, store: str | None = None, warm: bool = False) -> tuple[float, float | None, list[float]]:  # fmt: skip
    """One start: (seconds to the first answer, to the whole catalog or None, probe times).
    `store`: the store file to start on (default a new one), filled to its written cases;
    `warm`: stop at the first answer."""
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        fill = store is not None and not warm
        cmd = [python, "-m", "sidecar", "serve", *([] if fill else ["-q"]), "--catalog", catalog, "--store", store or os.path.join(tmp, "s.db"), "--port", str(port)]
        if model:
            cmd += ["--model", model]
        env = {k: v for k, v in os.environ.items() if not (warm and k == "PYTHONDONTWRITEBYTECODE")}
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE if fill else subprocess.DEVNULL, env=env)
        answering = whole = prober = None
        try:
            while time.perf_counter() - t0 < limit_s and proc.poll() is None:
                got = _health(port)
                if got is not None and got[0] == 200:
                    answering = answering or time.perf_counter() - t0
                    if warm:
                        break
                    if probe_every and prober is None:
                        prober = Prober(port, probe_every)
                        prober.start()
                    if got[1] == "ok\n":
                        whole = time.perf_counter() - t0
                        break
                time.sleep(0.01 if warm else 0.1)
            for line in proc.stderr if fill and whole is not None else ():  # the written cases too
                if b"written cases added" in line or b"completion" in line:
                    break
        finally:
            if prober is not None:
                prober.stop.set()
                prober.join(70)
            proc.terminate()
            proc.wait(30)
        if answering is None:
            raise SystemExit(f"{' '.join(cmd)}: no answer in {limit_s:.0f} s (exit {proc.returncode})")
        return answering, whole, prober.ms if prober else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--catalog", default=str(ROOT / "fixtures/catalogs/ALL.json"))
    ap.add_argument("--model")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--python", default=sys.executable, help="the interpreter whose sidecar runs (another checkout's venv)")
    ap.add_argument("--cwd", default=str(ROOT), help="where it runs (another checkout, for its fixtures and imports)")
    ap.add_argument("--limit", type=float, default=900.0, help="seconds a run may take")
    ap.add_argument("--probe-every", type=float, metavar="S", help="time a user turn every S seconds while indexing")
    ap.add_argument("--warm", action="store_true", help="fill one store, then time restarts on it to their first answer")
    args = ap.parse_args()
    if args.warm:
        return warm(args)
    answering, whole, probed = [], [], []
    for i in range(args.runs):
        a, w, ms = run_once(args.python, args.catalog, args.model, args.limit, pathlib.Path(args.cwd), args.probe_every)
        answering.append(a)
        if w is not None:
            whole.append(w)
        probed += ms
        print(f"run {i + 1}: answering {a:.1f} s, whole {'–' if w is None else f'{w:.1f} s'}{_probes(ms)}", flush=True)
    tail = f", whole {statistics.median(whole):.1f} s" if whole else ""
    print(f"median: answering {statistics.median(answering):.1f} s{tail}{_probes(probed)}")


def warm(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "warm.db")
        a, w, _ = run_once(args.python, args.catalog, args.model, args.limit, pathlib.Path(args.cwd), store=store)
        print(f"filling the store: answering {a:.1f} s, whole {'–' if w is None else f'{w:.1f} s'}", flush=True)
        starts = []
        for i in range(args.runs):
            a, _, _ = run_once(args.python, args.catalog, args.model, args.limit, pathlib.Path(args.cwd), store=store, warm=True)
            starts.append(a)
            print(f"warm start {i + 1}: answering {a:.2f} s", flush=True)
    print(f"median: warm start answering {statistics.median(starts):.2f} s")


def _probes(ms: list[float]) -> str:
    if len(ms) < 2:
        return ""
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return f"; {len(ms)} turns while indexing: p50 {q[49]:.0f} ms, p90 {q[89]:.0f} ms, max {max(ms):.0f} ms"


if __name__ == "__main__":
    main()
