"""The evaluations waiting for the embedding worker, with a predictable overload policy.

The worker takes everything pending at once and judges it in one batch. While it works,
new spans pile up here; when that happens faster than the worker drains them, the queue
degrades in a fixed order and counts each loss:

- superseded: a clause has at most one pending span; a newer one with the same key
  replaces it (the newer span of a growing clause contains the older one; distinct
  clauses have distinct keys, so a finished clause is never dropped for the next);
- overflow: beyond `max_pending`, the oldest are dropped;
- stale: a span that waited longer than `stale_s` is dropped when taken, since its
  answer would come after the model had moved on.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

REASONS = ("superseded", "overflow", "stale")


class Pending:
    def __init__(self, max_pending: int, stale_s: float):
        self.max_pending = max_pending
        self.stale_s = stale_s
        self.dropped: Counter[str] = Counter({r: 0 for r in REASONS})
        self._items: OrderedDict[object, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, ev: Any) -> None:
        """Queue an evaluation (anything with `.key` and `.received`)."""
        if self._items.pop(ev.key, None) is not None:
            self.dropped["superseded"] += 1
        self._items[ev.key] = ev
        while len(self._items) > self.max_pending:
            self._items.popitem(last=False)
            self.dropped["overflow"] += 1

    def take(self, now: float) -> list[Any]:
        """Everything pending and still fresh, oldest first; the queue is left empty."""
        items = list(self._items.values())
        self._items.clear()
        fresh = [e for e in items if now - e.received <= self.stale_s]
        self.dropped["stale"] += len(items) - len(fresh)
        return fresh
