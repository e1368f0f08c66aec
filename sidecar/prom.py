"""Prometheus text exposition for the server's counters, gauges and histograms.

A few dozen lines instead of a client library: the server updates these from its event
loop thread only, so no locking is needed, and `render()` writes format 0.0.4.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence


def _labels(names: Sequence[str], values: Sequence[str]) -> str:
    parts = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values)]
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return str(int(v)) if float(v).is_integer() else repr(float(v))


class Counter:
    kind = "counter"

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()):
        self.name, self.help, self.labels = name, help, tuple(labels)
        self.values: dict[tuple[str, ...], float] = {} if labels else {(): 0.0}

    def inc(self, *labels: str, by: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + by

    def get(self, *labels: str) -> float:
        return self.values.get(labels, 0.0)

    def lines(self) -> list[str]:
        return [f"{self.name}{_labels(self.labels, k)} {_num(v)}" for k, v in sorted(self.values.items())]


class Gauge(Counter):
    kind = "gauge"

    def __init__(self, name: str, help: str, labels: Sequence[str] = (), read: Callable[[], float] | None = None):
        super().__init__(name, help, labels)
        self.read = read  # when given, the value is read at scrape time

    def set(self, value: float, *labels: str) -> None:
        self.values[labels] = float(value)

    def lines(self) -> list[str]:
        if self.read is not None:
            self.values[()] = float(self.read())
        return super().lines()


class Histogram:
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Sequence[float]):
        self.name, self.help = name, help
        self.buckets = sorted(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self) -> list[str]:
        out, acc = [], 0
        for bound, n in zip([*self.buckets, math.inf], self.counts):
            acc += n
            out.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {acc}')
        out.append(f"{self.name}_sum {_num(self.sum)}")
        out.append(f"{self.name}_count {self.count}")
        return out


def render(families: Sequence[Counter | Gauge | Histogram]) -> str:
    out: list[str] = []
    for f in families:
        out.append(f"# HELP {f.name} {f.help}")
        out.append(f"# TYPE {f.name} {f.kind}")
        out.extend(f.lines())
    return "\n".join(out) + "\n"
