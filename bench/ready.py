"""How soon a `sidecar serve` on a fresh store answers, and how soon it has the whole catalog
(issue 50: ready in seconds).

    python bench/ready.py [--catalog fixtures/catalogs/ALL.json] [--model M] [--runs 3]
    python bench/ready.py --python /other/checkout/.venv/bin/python   # another build, side by side

Each run starts `sidecar serve` on 127.0.0.1 with a new SQLite store (nothing embedded yet)
and polls /healthz every 0.1 s: "answering" is the first 200 (the websocket serves from then
on), "whole" the first plain "ok" (every tool indexed; before the written cases are added,
which the log says after). Prints each run and the medians.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]


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


def run_once(python: str, catalog: str, model: str | None, limit_s: float, cwd: pathlib.Path) -> tuple[float, float | None]:
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [python, "-m", "sidecar", "serve", "-q", "--catalog", catalog, "--store", os.path.join(tmp, "s.db"), "--port", str(port)]
        if model:
            cmd += ["--model", model]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        answering = whole = None
        try:
            while time.perf_counter() - t0 < limit_s and proc.poll() is None:
                got = _health(port)
                if got is not None and got[0] == 200:
                    answering = answering or time.perf_counter() - t0
                    if got[1] == "ok\n":
                        whole = time.perf_counter() - t0
                        break
                time.sleep(0.1)
        finally:
            proc.terminate()
            proc.wait(30)
        if answering is None:
            raise SystemExit(f"{' '.join(cmd)}: no answer in {limit_s:.0f} s (exit {proc.returncode})")
        return answering, whole


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--catalog", default=str(ROOT / "fixtures/catalogs/ALL.json"))
    ap.add_argument("--model")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--python", default=sys.executable, help="the interpreter whose sidecar runs (another checkout's venv)")
    ap.add_argument("--cwd", default=str(ROOT), help="where it runs (another checkout, for its fixtures and imports)")
    ap.add_argument("--limit", type=float, default=900.0, help="seconds a run may take")
    args = ap.parse_args()
    answering, whole = [], []
    for i in range(args.runs):
        a, w = run_once(args.python, args.catalog, args.model, args.limit, pathlib.Path(args.cwd))
        answering.append(a)
        if w is not None:
            whole.append(w)
        print(f"run {i + 1}: answering {a:.1f} s, whole {'–' if w is None else f'{w:.1f} s'}", flush=True)
    tail = f", whole {statistics.median(whole):.1f} s" if whole else ""
    print(f"median: answering {statistics.median(answering):.1f} s{tail}")


if __name__ == "__main__":
    main()
