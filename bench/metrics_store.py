"""The metrics store's part of serving, in-process on a real SQLite file: committing a batch of
records, and the reads every ranking makes (`Recommender._facts`: recent calls per tool, who
reported failures, one agent's recent calls), idle and beside a thread that keeps the GIL busy.

A server's store thread commits beside its event loop; when the loop runs flat out (a
1,000-connection soak), every GIL hand-back the thread makes (SQLite gives it back at each step
of each statement) waits up to the 5 ms switch interval. The spinning thread here is that loop.

    .venv/bin/python bench/metrics_store.py [--window-calls 8000] [--log-calls 100000] [--batch 256] [--runs 7] [--json]

Store: --log-calls successful and failed calls (20% failed) of 20 tools by 10 agents and 1,000
reporters, spread over the retention (7 days), --window-calls of them in the last five minutes
(the default availability window). Figures: medians of --runs, ms.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sidecar.store import open_store  # noqa: E402
from sidecar.store.metrics import DAY_S, MetricsStore  # noqa: E402

WINDOW_S = 300.0


class Spinner:
    """A thread running Python flat out, as a saturated event loop does."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        x = 0
        while not self._stop.is_set():
            for i in range(1000):
                x += i

    def __enter__(self) -> Spinner:
        self._thread.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def record(ms: MetricsStore, rnd: random.Random, n: int, ts: float, ref: str | None = None):
    ok = rnd.random() > 0.2
    args = ("srv", f"t{rnd.randrange(20)}", ok, rnd.uniform(5, 500), None if ok else "timeout")
    kw = dict(agent=f"agent-{rnd.randrange(10)}", call_id=ref, reporter=f"conn-{rnd.randrange(1000)}",
              digest=None if ref is None else f"d{n}", ts=ts)  # fmt: skip
    make = getattr(ms, "call_record", None) or ms.call_write  # a build from before call_record
    return make(*args, **kw)


def median_ms(fn, runs: int) -> float:
    took = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        took.append(time.perf_counter() - t)
    return round(statistics.median(took) * 1000, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window-calls", type=int, default=8000)
    ap.add_argument("--log-calls", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rnd = random.Random(1)
    now = time.time()
    out: dict = {"window_calls": args.window_calls, "log_calls": args.log_calls, "batch": args.batch}
    with tempfile.TemporaryDirectory() as tmp:
        ms = MetricsStore(open_store(pathlib.Path(tmp) / "metrics.db"))
        older = args.log_calls - args.window_calls
        stamps = [now - rnd.uniform(WINDOW_S, 7 * DAY_S) for _ in range(older)] + [now - rnd.uniform(0, WINDOW_S) for _ in range(args.window_calls)]
        stamps.sort()
        for at in range(0, len(stamps), 1000):
            ms.write_many([record(ms, rnd, at + i, ts) for i, ts in enumerate(stamps[at : at + 1000])])
        n = len(stamps)
        reads = {"recent": lambda: ms.recent(WINDOW_S), "failure_reporters": lambda: ms.failure_reporters(WINDOW_S),
                 "recent_agent": lambda: ms.recent(WINDOW_S, agent="agent-3")}  # fmt: skip

        def batch() -> None:
            nonlocal n
            ms.write_many([record(ms, rnd, n + i, time.time(), ref=f"key\x1f{n + i}") for i in range(args.batch)])
            n += args.batch

        for label, spinning in (("idle", False), ("beside_busy_thread", True)):
            with Spinner() if spinning else _nothing():
                row = {name: median_ms(fn, args.runs) for name, fn in reads.items()}
                row["facts_per_ranking"] = round(sum(row.values()), 3)
                row["batch_commit"] = median_ms(batch, args.runs)
            out[label] = row
    if args.json:
        print(json.dumps(out))
        return
    for label in ("idle", "beside_busy_thread"):
        r = out[label]
        print(f"{label:>18}: batch of {args.batch} committed in {r['batch_commit']} ms; reads per ranking {r['facts_per_ranking']} ms "
              f"(recent {r['recent']}, failure_reporters {r['failure_reporters']}, recent_agent {r['recent_agent']})")  # fmt: skip


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


if __name__ == "__main__":
    main()
