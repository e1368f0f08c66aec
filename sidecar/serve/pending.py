"""The evaluations waiting for the embedding worker, with a predictable overload policy and
fair, bounded batches.

Evaluations are queued per connection (an evaluation's `owner`). The worker takes a
bounded batch (`take(now, limit, budget)`: at most `limit` spans and about `budget` of
estimated work), one span per connection in turn, so a connection that queued hundreds of
spans gets one slot per round like everyone else. User turns go first, one per connection
in the same order: a turn is what its chat app waits on before the model answers, where a
reply's clause is judged while the reply goes on. While the worker judges, new spans pile
up here; when that happens faster than the worker drains them, the queue degrades in a fixed
order and counts each loss:

- superseded: a clause has at most one pending span; a newer one with the same key
  replaces it (the newer span of a growing clause contains the older one; distinct
  clauses have distinct keys, so a finished clause is never dropped for the next);
- shed: when what waits would take the model longer than a budget (`shed(budget, cost)`,
  the server's `shed_ms`), replies' spans go before any user turn, and whole streams, never
  single spans of many: the connection with the most estimated work waiting loses its
  stream with the most, again until the rest fits (of the last stream only its oldest
  spans, as many as needed; fair share: a connection with one span waiting keeps it while a
  flooding one has more); the streams kept are answered within the budget instead of every
  stream late;
- overflow: beyond `max_pending`, the oldest span of the connection with the most queued
  is dropped (a flooding connection loses its own work, not its neighbours');
- stale: a span that waited longer than `stale_s` is dropped when taken, since its
  answer would come after the model had moved on.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable
from typing import Any

REASONS = ("superseded", "shed", "overflow", "stale")


def _group(ev: Any) -> Any:
    return getattr(ev, "owner", None)


def _turn(ev: Any) -> bool:
    return getattr(ev, "source", None) == "user"


def _stream(ev: Any) -> Any:
    stream = getattr(ev, "stream", None)
    return (_group(ev), getattr(stream, "id", stream))


class Pending:
    def __init__(self, max_pending: int, stale_s: float, weight: Callable[[Any], float] | None = None):
        """`weight(ev)`: a span's share of the model's work (the server: its characters plus
        a fixed overhead; default 1 a span), kept as a running total for `shed`."""
        self.max_pending = max_pending
        self.stale_s = stale_s
        self.weight = weight or (lambda ev: 1.0)
        self.weight_total = 0.0
        self._weights: Counter[Any] = Counter()  # connection -> the weight it has waiting
        self.dropped: Counter[str] = Counter({r: 0 for r in REASONS})
        self.shed_weight: Counter[Any] = Counter()  # connection -> the weight shed from it, until `take_shed`
        # connection -> its evaluations by key, oldest first; the connections in round-robin
        # order (one that was served moves to the back)
        self._groups: OrderedDict[Any, OrderedDict[object, Any]] = OrderedDict()
        self._streams: Counter[tuple] = Counter()  # (connection, stream id) -> spans pending
        self._turns: Counter[Any] = Counter()  # connection -> its user turns' spans pending
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def count(self, group: Any) -> int:
        """Spans a connection has waiting."""
        items = self._groups.get(group)
        return len(items) if items is not None else 0

    def owners(self) -> set[Any]:
        """The connections with spans waiting."""
        return set(self._groups)

    def heaviest_share(self) -> float:
        """The largest share of the waiting weight that one connection holds (0 when none
        waits): near 1 when one connection floods, small when many share the load."""
        return max(self._weights.values()) / self.weight_total if self._weights and self.weight_total > 0 else 0.0

    def stream_pending(self, group: Any, stream_id: Any) -> bool:
        """Whether a stream still has spans waiting (its `ended` must wait for them)."""
        return self._streams.get((group, stream_id), 0) > 0

    def put(self, ev: Any) -> None:
        """Queue an evaluation (anything with `.key` and `.received`; `.owner` and
        `.stream` group it when present; `.queued`, when set, is when its wait began, if not at
        `.received`)."""
        g = _group(ev)
        items = self._groups.get(g)
        if items is None:
            items = self._groups[g] = OrderedDict()
        self._supersede(items, ev.key)
        items[ev.key] = ev
        self._n += 1
        self.weight_total += self.weight(ev)
        self._weights[g] += self.weight(ev)
        self._streams[_stream(ev)] += 1
        if _turn(ev):
            self._turns[g] += 1
        while self._n > self.max_pending:
            biggest = max(self._groups, key=lambda k: len(self._groups[k]))
            _, gone = self._groups[biggest].popitem(last=False)
            if not self._groups[biggest]:
                del self._groups[biggest]
            self._forget(gone)
            self.dropped["overflow"] += 1

    def supersede(self, ev: Any) -> None:
        """`ev` was decided without waiting: a pending span with its key is dropped
        (superseded), as `put` would have replaced it."""
        items = self._groups.get(_group(ev))
        if items is not None and self._supersede(items, ev.key) and not items:
            del self._groups[_group(ev)]

    def _supersede(self, items: OrderedDict[object, Any], key: object) -> bool:
        """Drop the pending span with `key` from its connection's `items`, counted as superseded."""
        old = items.pop(key, None)
        if old is None:
            return False
        self.dropped["superseded"] += 1
        self._forget(old)
        return True

    def take(self, now: float, limit: int | None = None, budget: float | None = None,
             cost: Callable[[Any], float] | None = None, one_round: bool = False) -> list[Any]:  # fmt: skip
        """Up to `limit` fresh evaluations (all when None), one per connection in turn, each
        connection's oldest first; with `budget` and `cost`, only while the taken spans' cost
        stays within the budget: the first span is always taken, and a later one that would
        pass the budget ends the batch and comes first in the next (a short span taken first is
        not then held behind a neighbour's long one: a 4,000-character turn is 100-130 ms of
        MiniLM against a shared budget of 40 ms). `one_round`: once two connections have a span in
        the batch, none gets a second, so a connection with one span waiting shares its batch
        with one span of each other, not with a budget's worth of a flooding one's (a lone
        connection still fills the budget). Before that round, each connection's oldest user
        turn, if it has one waiting, in the same order. Stale ones met on the way are dropped;
        what is not taken stays queued."""
        out: list[Any] = []
        spent = 0.0
        served: set[Any] = set()
        turns = [g for g in self._groups if g in self._turns] if self._turns else []
        for g in turns:  # a user turn of each connection that has one, first
            if limit is not None and len(out) >= limit:
                return out
            key, ev = next((k, e) for k, e in self._groups[g].items() if _turn(e))
            taken = self._take_one(g, key, ev, now, budget if out else None, spent, cost, served)
            if taken is None:
                return out  # past the budget: the batch ends here
            if taken:
                out.append(ev)
                spent += taken[0]
        while self._groups and (limit is None or len(out) < limit):
            g, items = next(iter(self._groups.items()))
            if one_round and g in served and len(served) > 1:
                break
            key, ev = next(iter(items.items()))
            taken = self._take_one(g, key, ev, now, budget if out else None, spent, cost, served)
            if taken is None:
                break
            if taken:
                out.append(ev)
                spent += taken[0]
        return out

    def _take_one(self, g: Any, key: object, ev: Any, now: float, budget: float | None, spent: float,
                  cost: Callable[[Any], float] | None, served: set[Any]) -> tuple[float, ...] | None:  # fmt: skip
        """Take `ev` (its key `key`) off connection `g`'s queue, for `take`: (its cost,) when
        fresh, () when stale (dropped and counted), None when it would take the batch past
        `budget` (None: no bound) from `spent` (it stays queued)."""
        fresh = now - (getattr(ev, "queued", None) or ev.received) <= self.stale_s
        c = cost(ev) if cost is not None and fresh else 0.0
        if fresh and budget is not None and spent + c > budget:
            return None
        served.add(g)
        items = self._groups[g]
        del items[key]
        self._forget(ev)
        if items:
            self._groups.move_to_end(g)
        else:
            del self._groups[g]
        if not fresh:
            self.dropped["stale"] += 1
            return ()
        return (c,)

    def shed(self, budget: float, turns: float | None = None) -> int:
        """Drop whole streams while the waiting spans' weight exceeds `budget`: each time,
        the stream with the most weight of the connection with the most weight, oldest span
        first, and of the last one only what the budget needs (a lone flooding stream keeps
        its newest spans). A reply's spans go before any user turn: a turn is the one request
        its chat app waits on before the model answers, where a reply's later clauses are
        judged anyway (a 1,000-connection soak on nomic shed 171 of 1,195 probe turns when
        the turns of the connections with the most waiting went first). The last span waiting
        is never shed: it holds no one up, and a lone long user turn whose estimate passed the
        budget (a 4,200-character turn after one short one, with nomic) went unanswered.
        `turns` (at least `budget`; default `budget`): user turns go only while the rest
        exceeds it, so a turn waits longer before it is lost than a reply's clause does.
        Returns how many spans went (counted as "shed"). O(1) when within the budget, else
        O(n log n) in the spans waiting."""
        turns = budget if turns is None else max(turns, budget)
        if self.weight_total <= budget:
            return 0
        n = self._shed(budget, lambda ev: getattr(ev, "source", None) != "user")
        if self.weight_total > turns:
            n += self._shed(turns, lambda ev: True)
        self.dropped["shed"] += n
        return n

    def _shed(self, budget: float, eligible: Callable[[Any], bool]) -> int:
        """`shed` among the `eligible` spans."""
        streams: dict[Any, dict[Any, list]] = defaultdict(lambda: defaultdict(list))  # group -> stream -> [(key, weight)]
        for g, items in self._groups.items():
            for key, ev in items.items():
                if eligible(ev):
                    streams[g][_stream(ev)].append((key, self.weight(ev)))
        total = self.weight_total
        owed = {g: sum(c for spans in by.values() for _, c in spans) for g, by in streams.items()}
        # (-weight, tie, connection); ties: the one served last (at the back of the round) first
        heap = [(-w, -i, g) for i, (g, w) in enumerate(owed.items())]
        heapq.heapify(heap)
        order = {g: sorted(by.values(), key=lambda spans: -sum(c for _, c in spans)) for g, by in streams.items()}
        n = 0
        while total > budget and heap and self._n > 1:
            _, tie, g = heapq.heappop(heap)
            spans = order[g][0]
            items = self._groups[g]
            while spans and total > budget and self._n > 1:  # oldest first: the whole stream, unless less will do
                key, c = spans.pop(0)
                self._forget(items.pop(key))
                total -= c
                owed[g] -= c
                self.shed_weight[g] += c
                n += 1
            if not spans:
                order[g].pop(0)
            if not items:
                del self._groups[g]
            if order[g]:
                heapq.heappush(heap, (-owed[g], tie, g))
        return n

    def take_shed(self) -> Counter[Any]:
        """The weight shed from each connection since the last call."""
        out, self.shed_weight = self.shed_weight, Counter()
        return out

    def discard(self, group: Any) -> int:
        """Forget a connection's waiting spans (it closed); returns how many."""
        items = self._groups.pop(group, None)
        if not items:
            return 0
        for ev in items.values():
            self._forget(ev)
        return len(items)

    def _forget(self, ev: Any) -> None:
        self._n -= 1
        self.weight_total -= self.weight(ev)
        g = _group(ev)
        self._weights[g] -= self.weight(ev)
        if self._weights[g] <= 1e-9:
            del self._weights[g]
        key = _stream(ev)
        self._streams[key] -= 1
        if self._streams[key] <= 0:
            del self._streams[key]
        if _turn(ev):
            self._turns[g] -= 1
            if self._turns[g] <= 0:
                del self._turns[g]
