"""The pure parts of live connections: per-server state and circuit breaker, the backoff
schedule, and tool-list diffing. No I/O and no clock of their own (`now` is passed in), so
they are tested directly.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from typing import Any

import msgspec
import orjson


class State(enum.StrEnum):
    CONFIGURED = "configured"  # in the config, never tried
    CONNECTING = "connecting"  # attempts (and the waits between them) in progress
    CONNECTED = "connected"
    FAILED = "failed"  # attempts ran out, or a live connection was lost


def backoff_delays(retries: int, base: float = 1.0, cap: float = 16.0) -> list[float]:
    """The waits before each retry: base, 2 base, 4 base, ... capped (1, 2, 4, 8, 16 s)."""
    return [min(base * 2**i, cap) for i in range(retries)]


class Breaker:
    """One server's connection state and circuit breaker.

    A connect cycle is one attempt plus up to `retries` retries (`backoff_delays`). When a
    cycle fails, the circuit opens: `allow` says no (callers fail fast, nothing is spawned)
    for `reset_after` seconds, doubling with each cycle that fails in a row (at most 16x).
    After that one trial attempt is allowed (half-open, no retries); success closes the
    circuit. A connection lost after it was up leaves the circuit closed: the next demand
    reconnects with a full cycle.
    """

    def __init__(self, retries: int = 3, base: float = 1.0, cap: float = 16.0, reset_after: float = 60.0):
        self.retries, self.base, self.cap, self.reset_after = retries, base, cap, reset_after
        self.state = State.CONFIGURED
        self.last_error: str | None = None
        self.tripped = 0  # connect cycles failed in a row
        self.open_until: float | None = None  # monotonic time the circuit stays open until

    def allow(self, now: float) -> bool:
        """May a connect cycle start now? False while the circuit is open."""
        return self.open_until is None or now >= self.open_until

    def plan(self, now: float) -> list[float]:
        """Start a cycle: the retry delays it may use (none for a half-open trial)."""
        if not self.allow(now):
            raise RuntimeError("circuit is open")
        self.state = State.CONNECTING
        return [] if self.open_until is not None else backoff_delays(self.retries, self.base, self.cap)

    def succeeded(self) -> None:
        self.state = State.CONNECTED
        self.tripped = 0
        self.open_until = None
        self.last_error = None

    def failed(self, now: float, error: str) -> float:
        """The cycle ran out of attempts: open the circuit; returns how long it stays open."""
        self.state = State.FAILED
        self.last_error = error
        self.tripped += 1
        wait = self.reset_after * min(2 ** (self.tripped - 1), 16)
        self.open_until = now + wait
        return wait

    def lost(self, error: str) -> None:
        """A live connection went away (the server exited, the stream broke)."""
        self.state = State.FAILED
        self.last_error = error

    def aborted(self, error: str | None = None) -> None:
        """A cycle was cancelled before it finished (shutdown): back to where it was idle."""
        self.state = State.FAILED if error else State.CONFIGURED
        if error:
            self.last_error = error


def schema_hash(tool: Mapping[str, Any]) -> str:
    """SHA-256 of a tool's name + description + inputSchema (keys sorted): what makes a
    tool "changed" for the live catalog."""
    payload = orjson.dumps([tool.get("name"), tool.get("description"), tool.get("inputSchema")], option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(payload).hexdigest()


class ToolDiff(msgspec.Struct, frozen=True):
    added: list[str] = []
    updated: list[str] = []
    removed: list[str] = []
    unchanged: list[str] = []

    @property
    def changed(self) -> bool:
        return bool(self.added or self.updated or self.removed)

    def counts(self) -> str:
        return f"{len(self.added)} added, {len(self.updated)} updated, {len(self.removed)} removed, {len(self.unchanged)} unchanged"


def diff(old: Mapping[str, str], new: Mapping[str, str]) -> ToolDiff:
    """Compare two {tool name: schema_hash} maps (new order kept, removed in old order)."""
    added, updated, unchanged = [], [], []
    for name, h in new.items():
        if name not in old:
            added.append(name)
        elif old[name] != h:
            updated.append(name)
        else:
            unchanged.append(name)
    return ToolDiff(added, updated, [n for n in old if n not in new], unchanged)
