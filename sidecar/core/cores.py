"""Whether the machine's cores are free of other processes' work, so that one judgement may
take them all.

llama.cpp's threads wait for each other by spinning: a second thread beside another busy
process stalls the step it is part of on the slowest thread (docs/protocol.md,
"Performance"), so the model thread judges on `threads` (all cores but one). On a quiet
machine that leaves a core idle while a client waits. `CoreWatch` samples what every process
used (/proc/stat) less what this one did (os.times) ten times a second on a thread of its own,
and says the cores are spare while the others used almost none over the last 0.3 s, with a band
between its two thresholds so a process that comes and goes does not flip it every sample.
"""

from __future__ import annotations

import os
import threading
import time

FREE_BELOW = 0.15  # cores the other processes used, on average: below this the cores are spare ...
BUSY_ABOVE = 0.35  # ... and stay so until they use more than this
EVERY_S = 0.1  # between samples (/proc/stat counts in 10 ms ticks)
WINDOW_S = 0.3  # the span a judgement on the cores is made over: a process that starts costs
# the judgements of at most this long on every core beside it


def busy_seconds(stat: str) -> float | None:
    """CPU-seconds every process has used since boot, from /proc/stat's first line (all but
    idle and iowait)."""
    first = stat.split("\n", 1)[0].split()
    if len(first) < 5 or first[0] != "cpu":
        return None
    ticks = [int(x) for x in first[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)) / os.sysconf("SC_CLK_TCK")


def others_cores(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """Cores the other processes kept busy on average between two samples of (wall seconds,
    every process's CPU-seconds, this process's CPU-seconds)."""
    wall = after[0] - before[0]
    if wall <= 0:
        return 0.0
    return max(0.0, ((after[1] - before[1]) - (after[2] - before[2])) / wall)


class CoreWatch:
    """`spare`: True while the other processes used less than `FREE_BELOW` of a core over the
    last `WINDOW_S` (and until they use more than `BUSY_ABOVE`); always False where /proc/stat
    cannot be read or before the first full window."""

    def __init__(self, path: str = "/proc/stat", every: float = EVERY_S, window: float = WINDOW_S):
        self.path, self.every, self.window = path, every, window
        self.others: float | None = None  # cores the other processes used over the last window
        self.spare = False
        self._samples: list[tuple[float, float, float]] = []
        if self._sample() is not None:
            threading.Thread(target=self._run, name="core-watch", daemon=True).start()

    def _sample(self) -> tuple[float, float, float] | None:
        try:
            with open(self.path) as f:
                busy = busy_seconds(f.read(512))
        except (OSError, ValueError):
            return None
        if busy is None:
            return None
        own = os.times()
        return time.monotonic(), busy, own.user + own.system

    def _run(self) -> None:
        while (now := self._sample()) is not None:
            self.observe(now)
            time.sleep(self.every)

    def observe(self, now: tuple[float, float, float]) -> None:
        """Take a sample: the judgement is made over the oldest one within the window."""
        self._samples = [s for s in self._samples if now[0] - s[0] <= self.window + self.every / 2] + [now]
        first = self._samples[0]
        if now[0] - first[0] >= self.window * 0.9:
            self.others = others_cores(first, now)
            self.spare = self.others < (BUSY_ABOVE if self.spare else FREE_BELOW)


_watch: CoreWatch | None = None
_starting = threading.Lock()


def watch() -> CoreWatch:
    """The process's one watch, started on first use."""
    global _watch
    with _starting:
        if _watch is None:
            _watch = CoreWatch()
        return _watch
