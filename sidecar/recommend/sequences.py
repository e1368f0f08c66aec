"""Which tools go together, learned from the order tools were called in (issue 31): "called
before move_file in 41 of 50 sessions". Pure: call sequences in, rules out.

A session is one user turn's calls in the order made (a chat log's or a live connection's, from
the traffic log), or, for a connection that reports calls but no user turns, its calls in time
order (the metrics store's `tool_calls`, by the connection that reported them). Turns are the
sharper unit: a connection's whole log also pairs each turn's tools with the next turn's (on
BFCL's multi-turn logs, rules from whole conversations injected 40-60% more tools than they
found, bench/multi_turn.py). Tool `b` *follows* `a` in a session when it is called within
`window` calls after `a`; each ordered pair counts once per session. A rule says that when `a`
is injected, `b` should be too, before it (a prerequisite: b usually precedes a) or after it
(a usual next step), and holds only with evidence: `min_together` sessions, `min_confidence`
of the sessions that called `a`, and `lift` (how much likelier `b` is beside `a` than in any
session) of at least `min_lift`. Cold start: no sessions, no rules.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from typing import Literal

import msgspec


class Rule(msgspec.Struct, frozen=True):
    tool: str  # the tool that goes with the anchor
    anchor: str  # the injected tool
    relation: Literal["before", "after"]  # where `tool` usually comes: before the anchor, or after it
    together: int  # sessions that called both in that order
    sessions: int  # sessions that called the anchor
    lift: float
    unit: str = "sessions"  # what `together` and `sessions` count: sessions, or user turns

    @property
    def why(self) -> str:
        return f"called {self.relation} {self.anchor} in {self.together} of {self.sessions} {self.unit}"


class Sequences:
    """The rules, by anchor, strongest first."""

    def __init__(self, rules: Iterable[Rule] = (), sessions: int = 0):
        self.sessions = sessions
        self.rules: dict[str, list[Rule]] = collections.defaultdict(list)
        for r in rules:
            self.rules[r.anchor].append(r)
        for rs in self.rules.values():
            rs.sort(key=lambda r: (-r.together / r.sessions, -r.lift, r.tool))

    def __len__(self) -> int:
        return sum(len(rs) for rs in self.rules.values())

    def update(self, other: Sequences) -> None:
        """Take `other`'s rules in place: every engine sharing this object sees them at once."""
        self.rules, self.sessions = other.rules, other.sessions

    def around(self, tool: str, most: int = 2) -> list[Rule]:
        """At most `most` rules of `tool`: its strongest, prerequisites and next steps alike."""
        return self.rules.get(tool, [])[:most]


class SequenceFit(msgspec.Struct, frozen=True):
    """Hyper-parameters of the sequence rules, in one place."""

    window: int = 3
    min_together: int = 5
    min_confidence: float = 0.5
    min_lift: float = 2.0

    def fit(self, sessions: Iterable[Sequence[str]], unit: str = "sessions") -> Sequences:
        has: collections.Counter[str] = collections.Counter()
        follows: collections.Counter[tuple[str, str]] = collections.Counter()
        n = 0
        for calls in sessions:
            if not calls:
                continue
            n += 1
            has.update(set(calls))
            pairs = {(a, b) for i, a in enumerate(calls) for b in calls[i + 1 : i + 1 + self.window] if a != b}
            follows.update(pairs)
        rules = []
        for (a, b), together in follows.items():
            if together < self.min_together:
                continue
            for anchor, tool, relation in ((a, b, "after"), (b, a, "before")):  # b after a; a before b
                confidence = together / has[anchor]
                lift = confidence / (has[tool] / n)
                if confidence >= self.min_confidence and lift >= self.min_lift:
                    rules.append(Rule(tool, anchor, relation, together, has[anchor], round(lift, 2), unit))
        return Sequences(rules, n)
