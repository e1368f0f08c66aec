"""Per-tool call history and recommendation feedback, kept in the sidecar's store (SQLite, or
PostgreSQL shared by several sidecars: the SQL here is written once, `store.py` says how).

Three layers: `tool_metrics` holds lifetime totals per (server, tool), updated in the same
transaction as each raw call row, so the recommender reads one small table; `tool_calls` is
the raw log, kept `retention_days` for windowed questions (which agent, how recently, is
this server failing right now); `tool_metrics_daily` is what the raw log becomes after that.
Windowed queries read raw and daily together, so a roll-up never changes an answer.
`tool_calls_recent` counts the raw log's calls ahead in short buckets, for the recent-calls
question every ranking asks (is this server failing now, this agent over its rate).

`record_call` returns only after its transaction committed: the server may acknowledge a
`tool_result` as soon as it returns, and a kill -9 afterwards loses nothing (SQLite's WAL, or
PostgreSQL, keeps committed transactions across a process crash).
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Iterable, Sequence
from datetime import datetime, timezone
from typing import Any

import msgspec
import orjson

from ..core.catalog import SEP, Catalog
from .base import Store, StoreBusy

DAY_S = 86400.0
MAX_ERROR_CHARS = 500  # the default cap of a stored error (StringCaps.error)

SCHEMA = """
CREATE TABLE IF NOT EXISTS tool_metrics (
    id             INTEGER PRIMARY KEY AUTOINCREMENT,
    server         TEXT NOT NULL,          -- '' when the tool has no server
    tool           TEXT NOT NULL,          -- the server's own name for the tool
    call_count     INTEGER NOT NULL DEFAULT 0,
    success_count  INTEGER NOT NULL DEFAULT 0,
    failure_count  INTEGER NOT NULL DEFAULT 0,
    avg_latency_ms REAL,                   -- over the calls that reported a latency
    latency_count  INTEGER NOT NULL DEFAULT 0,
    last_called_at REAL,                   -- unix seconds
    last_success_at REAL,
    last_error     TEXT,
    created_at     REAL NOT NULL,
    updated_at     REAL NOT NULL,
    UNIQUE (server, tool)
);
CREATE TABLE IF NOT EXISTS tool_calls (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    call_id    TEXT UNIQUE,                -- the client's id: a resent result is counted once
    ts         REAL NOT NULL,
    server     TEXT NOT NULL,
    tool       TEXT NOT NULL,
    agent      TEXT,
    success    INTEGER NOT NULL,
    latency_ms REAL,
    error      TEXT,
    reporter   TEXT                        -- who reported it: the server's connection id; NULL: this process's own call
);
CREATE INDEX IF NOT EXISTS tool_calls_ts ON tool_calls (ts);
CREATE INDEX IF NOT EXISTS tool_calls_tool ON tool_calls (server, tool, ts);
CREATE INDEX IF NOT EXISTS tool_calls_agent ON tool_calls (agent, ts);
CREATE INDEX IF NOT EXISTS tool_calls_failed ON tool_calls (ts, server, reporter) WHERE success = 0;
CREATE TABLE IF NOT EXISTS tool_calls_recent (
    bucket    INTEGER NOT NULL,            -- the raw log's calls counted ahead per RECENT_BUCKET_S: floor(ts / it)
    server    TEXT NOT NULL,
    tool      TEXT NOT NULL,
    calls     INTEGER NOT NULL,
    successes INTEGER NOT NULL,
    PRIMARY KEY (bucket, server, tool)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS tool_metrics_daily (
    day            TEXT NOT NULL,          -- UTC, YYYY-MM-DD
    server         TEXT NOT NULL,
    tool           TEXT NOT NULL,
    agent          TEXT NOT NULL DEFAULT '',
    call_count     INTEGER NOT NULL,
    success_count  INTEGER NOT NULL,
    failure_count  INTEGER NOT NULL,
    latency_sum_ms REAL NOT NULL DEFAULT 0,
    latency_count  INTEGER NOT NULL DEFAULT 0,
    last_called_at REAL,
    last_success_at REAL,
    last_error     TEXT,
    PRIMARY KEY (day, server, tool, agent)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS feedback (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    ts          REAL NOT NULL,
    query       TEXT NOT NULL,
    recommended TEXT NOT NULL,             -- JSON list of tool names, best first
    selected    TEXT,
    rating      REAL,                      -- 0..5
    success     INTEGER,
    latency_ms  REAL,
    agent       TEXT,
    variant     TEXT
);
CREATE INDEX IF NOT EXISTS feedback_variant ON feedback (variant, ts);
CREATE TABLE IF NOT EXISTS record_refs (
    ref     TEXT NOT NULL,                 -- the client's ref within its key (ready.resume)
    kind    TEXT NOT NULL,                 -- tool_result | feedback
    digest  TEXT NOT NULL,                 -- sha256 of the record as the client sent it
    row_id  INTEGER,                       -- its row in tool_calls / feedback
    ts      REAL NOT NULL,
    PRIMARY KEY (ref, kind)
);
CREATE INDEX IF NOT EXISTS record_refs_ts ON record_refs (ts);
CREATE TABLE IF NOT EXISTS metrics_state (
    key   TEXT PRIMARY KEY,                -- generation: bumped on every change; last_rollup
    value REAL NOT NULL
);
INSERT INTO metrics_state VALUES ('generation', 0), ('last_rollup', 0) ON CONFLICT DO NOTHING;
"""


class Summary(msgspec.Struct):
    """One tool's row as `sidecar metrics --json` prints it."""

    server: str
    tool: str
    call_count: int
    success_count: int
    failure_count: int
    avg_latency_ms: float | None
    last_error: str | None


class ToolMetrics(msgspec.Struct):
    server: str
    tool: str
    call_count: int = 0
    success_count: int = 0
    failure_count: int = 0
    avg_latency_ms: float | None = None
    last_error: str | None = None
    last_called_at: float | None = None
    last_success_at: float | None = None

    @property
    def success_rate(self) -> float:
        return self.success_count / self.call_count if self.call_count else math.nan

    def summary(self) -> Summary:
        lat = None if self.avg_latency_ms is None else round(self.avg_latency_ms, 3)
        return Summary(self.server, self.tool, self.call_count, self.success_count, self.failure_count, lat, self.last_error)


class Listing(msgspec.Struct):
    tools: list[Summary]


class Feedback(msgspec.Struct, frozen=True):
    """What happened after a recommendation: which tool was used, how it went, how it was rated."""

    query: str
    recommended: list[str]
    selected: str | None = None
    rating: float | None = None
    success: bool | None = None
    latency_ms: float | None = None
    agent: str | None = None
    variant: str | None = None
    ts: float | None = None
    id: int | None = None

    def __post_init__(self) -> None:
        if self.rating is not None and not 0.0 <= self.rating <= 5.0:
            raise ValueError(f"rating={self.rating} must be within 0..5")


class StringCaps(msgspec.Struct, frozen=True):
    """The longest stored value of each client-given string, in characters. Every row carries
    them, so an uncapped one multiplies what a client can make the store keep (a 200 KB agent
    on every call). Longer values are cut, not refused: the record still counts."""

    agent: int = 128
    query: int = 1000
    error: int = MAX_ERROR_CHARS
    name: int = 256  # server, tool, selected, each recommended name, variant

    def __post_init__(self) -> None:
        for key in self.__struct_fields__:
            if getattr(self, key) < 1:
                raise ValueError(f"StringCaps.{key}={getattr(self, key)} must be at least 1")


def cut(value: str | None, limit: int) -> str | None:
    return value[:limit] if value is not None and len(value) > limit else value


class RollupStats(msgspec.Struct):
    rows: int  # raw rows folded into tool_metrics_daily (and deleted)
    groups: int
    cutoff: float


class CallCount(msgspec.Struct, frozen=True):
    calls: int
    successes: int


def key_of(catalog: Catalog | None, name: str) -> tuple[str, str]:
    """(server, tool) for a tool name as a client calls it: the catalog's entry when known,
    else split at the server__tool separator."""
    tool = catalog.get(name) if catalog is not None else None
    if tool is not None:
        return tool.server or "", tool.bare_name
    if SEP in name:
        server, _, bare = name.partition(SEP)
        return server, bare
    return "", name


def day_of(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d")


TABLES = frozenset({"tool_metrics", "tool_calls", "tool_metrics_daily", "feedback", "metrics_state", "record_refs", "tool_calls_recent"})
# The recent calls every ranking asks for (`recent`) are counted ahead in buckets of this many
# seconds, so a ranking reads a row per tool and bucket, not every call of the window (a soak's
# 8,000 calls in five minutes took 3.6 ms a ranking, growing with traffic). A power of two:
# ts / 16 is exact in floating point, so a call's bucket and the window's edge agree.
RECENT_BUCKET_S = 16


class RefReused(ValueError):
    """A ref already recorded with another payload: the resend is refused, not taken as the first."""

    def __init__(self, kind: str, ref: str):
        super().__init__(f"this ref was already used for a different {kind}")
        self.kind, self.ref = kind, ref


class CallRecord(msgspec.Struct, frozen=True):
    """One tool call as it is stored (`MetricsStore.call_record`): strings cut to the caps,
    its time set. With `call_id` and `digest`, `call_id` is also its ref in `record_refs`."""

    server: str
    tool: str
    success: bool
    latency_ms: float | None
    error: str | None
    agent: str | None
    call_id: str | None
    ts: float
    reporter: str | None
    digest: str | None

    kind = "tool_result"

    @property
    def ref(self) -> str | None:
        return self.call_id


class FeedbackRecord(msgspec.Struct, frozen=True):
    """One feedback row as it is stored (`MetricsStore.feedback_record`)."""

    row: tuple  # the feedback table's columns after id, in order
    rated: bool
    ref: str | None
    digest: str | None
    ts: float

    kind = "feedback"


Record = CallRecord | FeedbackRecord
BATCH_ROWS = 256  # rows in one multi-row statement (SQLite allows 32,766 parameters)
RACE_RETRIES = 5  # a batch retried after a replica claimed one of its refs meanwhile (PostgreSQL)


class _Raced(Exception):
    """A multi-row insert skipped a row another replica committed since this batch looked: the
    transaction is rolled back and the batch looked at again."""


def _or_raise(answer: int | RefReused) -> int:
    if isinstance(answer, RefReused):
        raise answer
    return answer


def _chunks(items: Sequence, n: int = BATCH_ROWS) -> Iterable[Sequence]:
    for at in range(0, len(items), n):
        yield items[at : at + n]


def _insert_all(db, head: str, rows: Sequence[tuple], tail: str = "") -> None:
    """`INSERT head VALUES (...), (...) tail`, BATCH_ROWS rows a statement; raises _Raced when
    a conflict skipped one (the caller left only rows that were new when it looked)."""
    for part in _chunks(rows):
        marks = "(" + ",".join("?" * len(part[0])) + ")"
        cur = db.execute(f"INSERT INTO {head} VALUES {','.join([marks] * len(part))} {tail}", [v for row in part for v in row])
        if cur.rowcount != len(part):
            raise _Raced()


def _ids_by_call_id(db, call_ids: Sequence[str]) -> dict[str, int]:
    """{call_id: row id} of the stored calls among `call_ids`, in one row per statement: SQLite
    gives the GIL back at every row it steps over, and beside a busy event loop each hand-back
    waits up to the 5 ms switch interval (a row a record held a 1,000-connection soak's
    writes to ~23 a second)."""
    out: dict[str, int] = {}
    for part in _chunks(call_ids):
        text = db.execute(f"SELECT CAST(json_agg(json_build_array(call_id, id)) AS TEXT) FROM tool_calls "
                          f"WHERE call_id IN ({','.join('?' * len(part))})", part).fetchone()[0]  # fmt: skip
        out.update((c, int(i)) for c, i in orjson.loads(text or "[]"))
    return out


def _claims(db, records: Sequence[Record]) -> tuple[list[int | RefReused | None], dict[int, int]]:
    """Each record's ref claimed for it, or its answer when the ref was recorded before: the
    first record's row for the same payload, RefReused for another. Returns those answers (None:
    claimed now, to be written) and {index: index of the batch's earlier record with the same
    ref and payload}. A claim commits with the rows it names: a replica claiming the same ref
    at the same moment waits for this transaction (PostgreSQL's unique index), then finds it."""
    out: list[int | RefReused | None] = [None] * len(records)
    keyed = [(i, (r.ref, r.kind)) for i, r in enumerate(records) if r.ref is not None and r.digest is not None]
    before: dict[tuple[str, str], tuple[str, int | None]] = {}
    for part in _chunks(sorted({ref for _, (ref, _) in keyed})):
        for ref, kind, digest, row_id in db.execute(f"SELECT ref, kind, digest, row_id FROM record_refs "
                                                    f"WHERE ref IN ({','.join('?' * len(part))})", part).fetchall():  # fmt: skip
            before[(ref, kind)] = (digest, row_id)
    first: dict[tuple[str, str], int] = {}
    same: dict[int, int] = {}
    claims: list[tuple] = []
    for i, key in keyed:
        r = records[i]
        if key in before:
            digest, row_id = before[key]
            out[i] = int(row_id) if digest == r.digest and row_id is not None else RefReused(r.kind, key[0])
        elif key in first:
            j = first[key]
            if records[j].digest == r.digest:
                same[i] = j
            else:
                out[i] = RefReused(r.kind, key[0])
        else:
            first[key] = i
            claims.append((key[0], key[1], r.digest, r.ts))
    if claims:
        _insert_all(db, "record_refs (ref, kind, digest, ts)", claims, "ON CONFLICT (ref, kind) DO NOTHING")
    return out, same


def _write_calls(db, calls: Sequence[tuple[int, CallRecord]], out: list, same: dict[int, int]) -> list[CallRecord]:
    """The calls still unanswered, logged; returns those counted (not a resent call_id)."""
    named = [(i, c) for i, c in calls if c.call_id is not None]
    stored = _ids_by_call_id(db, sorted({c.call_id for _, c in named})) if named else {}
    first: dict[str, int] = {}
    new: list[tuple[int, CallRecord]] = []
    for i, c in named:
        if c.call_id in stored:  # resent: the first row's id, nothing counted
            out[i] = stored[c.call_id]
        elif c.call_id in first:
            same[i] = first[c.call_id]
        else:
            first[c.call_id] = i
            new.append((i, c))
    if new:
        _insert_all(db, "tool_calls (call_id, ts, server, tool, agent, success, latency_ms, error, reporter)",
                    [_call_row(c) for _, c in new], "ON CONFLICT (call_id) DO NOTHING")  # fmt: skip
        ids = _ids_by_call_id(db, [c.call_id for _, c in new])
        for i, c in new:
            out[i] = ids[c.call_id]
    for i, c in calls:  # no call_id: this process's own calls, one at a time
        if c.call_id is None:
            out[i] = int(db.execute("INSERT INTO tool_calls (call_id, ts, server, tool, agent, success, latency_ms, error, reporter) "
                                    "VALUES (?,?,?,?,?,?,?,?,?) RETURNING id", _call_row(c)).fetchone()[0])  # fmt: skip
            new.append((i, c))
    refs = sorted({c.call_id for _, c in calls if c.digest is not None and c.call_id is not None})
    for part in _chunks(refs):
        db.execute(f"UPDATE record_refs SET row_id = (SELECT id FROM tool_calls WHERE call_id = record_refs.ref) "
                   f"WHERE kind = 'tool_result' AND row_id IS NULL AND ref IN ({','.join('?' * len(part))})", part)  # fmt: skip
    return [c for _, c in new]


def bucket_of(ts: float) -> int:
    return math.floor(ts / RECENT_BUCKET_S)


def _call_row(c: CallRecord) -> tuple:
    return (c.call_id, c.ts, c.server, c.tool, c.agent, 1 if c.success else 0, c.latency_ms, None if c.success else c.error, c.reporter)


def _count_calls(db, calls: Sequence[CallRecord]) -> None:
    """The new calls folded into their tools' totals, one row per tool: the totals a call at a
    time would leave (the last call's time and error, latency averaged over all)."""
    totals: dict[tuple[str, str], list] = {}
    for c in calls:
        t = totals.setdefault((c.server, c.tool), [0, 0, 0.0, 0, c.ts, None, None, c.ts, c.ts])
        t[0] += 1
        t[1] += 1 if c.success else 0
        if c.latency_ms is not None:
            t[2] += c.latency_ms
            t[3] += 1
        t[4] = max(t[4], c.ts)
        if c.success:
            t[5] = c.ts if t[5] is None else max(t[5], c.ts)
        elif c.error:
            t[6] = c.error
        t[7] = c.ts
    rows = [(server, tool, n, ok, n - ok, lat / lc if lc else None, lc, called, success_at, err, created, updated)
            for (server, tool), (n, ok, lat, lc, called, success_at, err, updated, created) in totals.items()]  # fmt: skip
    _count_buckets(db, calls)
    for part in _chunks(rows):
        db.execute(
            f"""INSERT INTO tool_metrics AS cur (server, tool, call_count, success_count, failure_count, avg_latency_ms,
                   latency_count, last_called_at, last_success_at, last_error, created_at, updated_at)
               VALUES {','.join(['(?,?,?,?,?,?,?,?,?,?,?,?)'] * len(part))}
               ON CONFLICT (server, tool) DO UPDATE SET
                   call_count = cur.call_count + excluded.call_count,
                   success_count = cur.success_count + excluded.success_count,
                   failure_count = cur.failure_count + excluded.failure_count,
                   avg_latency_ms = CASE WHEN excluded.latency_count = 0 THEN cur.avg_latency_ms
                       ELSE (coalesce(cur.avg_latency_ms, 0) * cur.latency_count + excluded.avg_latency_ms * excluded.latency_count)
                            / (cur.latency_count + excluded.latency_count) END,
                   latency_count = cur.latency_count + excluded.latency_count,
                   last_called_at = greatest(coalesce(cur.last_called_at, excluded.last_called_at), excluded.last_called_at),
                   last_success_at = CASE WHEN excluded.last_success_at IS NULL THEN cur.last_success_at
                       ELSE greatest(coalesce(cur.last_success_at, excluded.last_success_at), excluded.last_success_at) END,
                   last_error = coalesce(excluded.last_error, cur.last_error),
                   updated_at = excluded.updated_at""",
            [v for row in part for v in row],
        )


def _count_buckets(db, calls: Sequence[CallRecord]) -> None:
    """The new calls added to `tool_calls_recent`, a row per bucket and tool."""
    buckets: dict[tuple[int, str, str], list[int]] = {}
    for c in calls:
        b = buckets.setdefault((bucket_of(c.ts), c.server, c.tool), [0, 0])
        b[0] += 1
        b[1] += 1 if c.success else 0
    for part in _chunks([(*key, n, ok) for key, (n, ok) in buckets.items()]):
        db.execute(f"""INSERT INTO tool_calls_recent AS cur (bucket, server, tool, calls, successes)
                       VALUES {','.join(['(?,?,?,?,?)'] * len(part))}
                       ON CONFLICT (bucket, server, tool) DO UPDATE SET
                           calls = cur.calls + excluded.calls, successes = cur.successes + excluded.successes""",
                   [v for row in part for v in row])  # fmt: skip


def _write_batch(db, records: Sequence[Record]) -> list[int | RefReused]:
    """`MetricsStore.write_many` inside its transaction: a few statements a batch, whatever its
    size (refs looked up and claimed, calls inserted, their ids read, totals folded, one
    generation bump); feedback, rarer, a row at a time."""
    out, same = _claims(db, records)
    calls = [(i, r) for i, r in enumerate(records) if isinstance(r, CallRecord) and out[i] is None and i not in same]
    counted = _write_calls(db, calls, out, same) if calls else []
    rated = False
    for i, r in enumerate(records):
        if isinstance(r, FeedbackRecord) and out[i] is None and i not in same:
            row_id = out[i] = int(db.execute("INSERT INTO feedback (ts, query, recommended, selected, rating, success, latency_ms, agent, variant) "
                                             "VALUES (?,?,?,?,?,?,?,?,?) RETURNING id", r.row).fetchone()[0])  # fmt: skip
            rated = rated or r.rated
            if r.ref is not None and r.digest is not None:
                db.execute("UPDATE record_refs SET row_id=? WHERE ref=? AND kind='feedback'", (row_id, r.ref))
    if counted:
        _count_calls(db, counted)
    if counted or rated:
        db.execute("UPDATE metrics_state SET value = value + 1 WHERE key='generation'")
    for i, j in same.items():
        out[i] = out[j]
    return out  # type: ignore[return-value]


class MetricsStore:
    def __init__(self, store: Store, retention_days: int = 7, clock=time.time, caps: StringCaps | None = None,
                 write_timeout_s: float | None = None):  # fmt: skip
        """`write_timeout_s`: how long a write waits for a lock held by another process
        (SQLite's write lock, PostgreSQL's row locks; None: the store's default, 10 s) before
        it raises StoreBusy."""
        if retention_days < 1:
            raise ValueError(f"metrics_retention_days={retention_days} must be at least 1")
        self.store = store
        self.retention_days = retention_days
        self.clock = clock
        self.caps = caps or StringCaps()
        self.write_timeout_s = write_timeout_s
        self._ensure_schema()

    def _ensure_schema(self) -> None:
        """Create the tables, only if they are missing: opening an existing store only reads
        (`sidecar metrics` must not take the write lock a running sidecar's acks need)."""
        tables = self.store.tables()
        if not TABLES <= tables:
            self.store.ensure_schema(SCHEMA)
        if "reporter" not in self.store.columns("tool_calls"):  # a store from before the column
            self.store.ensure_schema("ALTER TABLE tool_calls ADD COLUMN reporter TEXT")
        if "tool_calls" in tables and "tool_calls_recent" not in tables:  # a store from before the buckets
            self._count_recent_ahead()

    def _count_recent_ahead(self) -> None:
        """Fill `tool_calls_recent` from the raw log a store kept before it existed."""
        rows = self.store.query("SELECT ts, server, tool, success FROM tool_calls")
        calls = [CallRecord(server, tool, bool(ok), None, None, None, None, ts, None, None) for ts, server, tool, ok in rows]
        self.store.write(lambda db: _count_buckets(db, calls), self.write_timeout_s)

    # --- writes: each one transaction, committed before returning -----------------------

    def record_call(self, server: str, tool: str, success: bool, latency_ms: float | None = None, error: str | None = None,
                    **kw: Any) -> int:  # fmt: skip
        """`call_record`'s call in a transaction of its own; returns the raw row's id once
        committed (RefReused raised, nothing written, for a ref used with another payload)."""
        return _or_raise(self.write_many([self.call_record(server, tool, success, latency_ms, error, **kw)])[0])

    def call_record(
        self,
        server: str,
        tool: str,
        success: bool,
        latency_ms: float | None = None,
        error: str | None = None,
        *,
        agent: str | None = None,
        call_id: str | None = None,
        ts: float | None = None,
        reporter: str | None = None,
        digest: str | None = None,
    ) -> CallRecord:
        """One tool call for `write_many`, which logs it and folds it into the tool's totals.
        A `call_id` seen before answers the first row's id and counts nothing.
        `reporter` names who reported it (the server's connection id), so one reporter's
        failures alone do not mark a server failing for everyone (`failure_reporters`); None
        is this process's own call. With `digest` (of the client's payload) the `call_id` is
        remembered with it in `record_refs`: the same payload again answers the first row's
        id, another one RefReused, recording nothing."""
        if latency_ms is not None and not (math.isfinite(latency_ms) and latency_ms >= 0):
            latency_ms = None
        caps = self.caps
        return CallRecord(cut(server, caps.name), cut(tool, caps.name), bool(success), latency_ms,
                          cut(error, caps.error) if error else None, cut(agent, caps.agent), call_id,
                          self.clock() if ts is None else ts, cut(reporter, caps.name), digest)  # fmt: skip

    def record_feedback(self, fb: Feedback, ref: str | None = None, digest: str | None = None) -> int:
        """`feedback_record`'s row in a transaction of its own; returns its id once committed."""
        return _or_raise(self.write_many([self.feedback_record(fb, ref, digest)])[0])

    def feedback_record(self, fb: Feedback, ref: str | None = None, digest: str | None = None) -> FeedbackRecord:
        """One feedback row for `write_many`. With `ref` and `digest` (of the client's
        payload), a resend of the same payload answers the first row's id and a changed one
        RefReused, as for `call_record`."""
        ts = self.clock() if fb.ts is None else fb.ts
        caps = self.caps
        recommended = orjson.dumps([cut(name, caps.name) for name in fb.recommended]).decode()
        row = (ts, cut(fb.query, caps.query), recommended, cut(fb.selected, caps.name), fb.rating,
               None if fb.success is None else int(fb.success), fb.latency_ms, cut(fb.agent, caps.agent), cut(fb.variant, caps.name))  # fmt: skip
        return FeedbackRecord(row, fb.rating is not None, ref, digest, ts)

    def write_many(self, records: Sequence[Record]) -> list[int | RefReused]:
        """Records (`call_record`, `feedback_record`) in one transaction, committed before
        returning: each one's row id, or RefReused in the place of one whose ref was used for
        another payload (it wrote nothing; the others are kept). A few statements whatever the
        batch's size, so a server under load commits what arrived meanwhile at once (a
        1,000-connection soak, five statements a record, queued 53,000 records faster than
        they committed). Waits at most `write_timeout_s` for the write lock."""
        if not records:
            return []
        for _ in range(RACE_RETRIES):
            try:
                return self.store.write(lambda db: _write_batch(db, records), self.write_timeout_s)
            except _Raced:
                continue
        raise StoreBusy(f"{len(records)} records not written: other sidecars kept recording the same refs")

    def reset(self, server: str | None = None, tool: str | None = None) -> int:
        """Forget the call history of the matching tools (all when neither is given); returns
        how many tools had totals. Feedback is kept: it is the learning record."""
        where, params = _where(server=server, tool=tool)
        with self.store.transaction() as db:
            n = db.execute(f"DELETE FROM tool_metrics{where}", params).rowcount
            db.execute(f"DELETE FROM tool_calls{where}", params)
            db.execute(f"DELETE FROM tool_calls_recent{where}", params)
            db.execute("DELETE FROM record_refs WHERE kind='tool_result' AND row_id NOT IN (SELECT id FROM tool_calls)")
            db.execute(f"DELETE FROM tool_metrics_daily{where}", params)
            db.execute("UPDATE metrics_state SET value = value + 1 WHERE key='generation'")
        return n

    def rollup(self, now: float | None = None) -> RollupStats:
        """Fold raw calls older than the retention into per-day rows and delete them. Adds to
        existing day rows, so a day rolled up in two runs sums correctly. One transaction that
        first takes the `last_rollup` row: a replica rolling up at the same moment waits for
        it, then finds the rows gone (PostgreSQL reads anew at each statement); and only the
        rows read are deleted, so a call arriving meanwhile is never dropped uncounted."""
        now = self.clock() if now is None else now
        cutoff = now - self.retention_days * DAY_S
        with self.store.transaction() as db:
            db.execute("UPDATE metrics_state SET value = ? WHERE key='last_rollup'", (now,))
            rows = db.execute(
                """SELECT id, server, tool, coalesce(agent, ''), ts, success, latency_ms, error
                   FROM tool_calls WHERE ts < ? ORDER BY ts""",
                (cutoff,),
            ).fetchall()
            groups: dict[tuple[str, str, str, str], list] = {}
            for _, server, tool, agent, ts, success, lat, error in rows:
                g = groups.setdefault((day_of(ts), server, tool, agent), [0, 0, 0, 0.0, 0, None, None, None])
                g[0] += 1
                g[1] += success
                g[2] += 1 - success
                if lat is not None:
                    g[3] += lat
                    g[4] += 1
                g[5] = ts
                if success:
                    g[6] = ts
                elif error:
                    g[7] = error
            db.executemany(
                """INSERT INTO tool_metrics_daily AS cur VALUES (?,?,?,?,?,?,?,?,?,?,?,?)
                   ON CONFLICT (day, server, tool, agent) DO UPDATE SET
                       call_count = cur.call_count + excluded.call_count,
                       success_count = cur.success_count + excluded.success_count,
                       failure_count = cur.failure_count + excluded.failure_count,
                       latency_sum_ms = cur.latency_sum_ms + excluded.latency_sum_ms,
                       latency_count = cur.latency_count + excluded.latency_count,
                       last_called_at = greatest(coalesce(cur.last_called_at, 0), excluded.last_called_at),
                       last_success_at = CASE WHEN cur.last_success_at IS NULL OR excluded.last_success_at IS NULL
                           THEN coalesce(cur.last_success_at, excluded.last_success_at)
                           ELSE greatest(cur.last_success_at, excluded.last_success_at) END,
                       last_error = coalesce(excluded.last_error, cur.last_error)""",
                [(*k, *v) for k, v in groups.items()],
            )
            db.execute("DELETE FROM record_refs WHERE ts < ?", (cutoff,))  # refs live as long as the raw calls
            db.execute("DELETE FROM tool_calls_recent WHERE bucket < ?", (bucket_of(cutoff),))  # and the buckets
            ids = [r[0] for r in rows]
            deleted = 0
            for i in range(0, len(ids), 500):
                chunk = ids[i:i + 500]
                deleted += db.execute(f"DELETE FROM tool_calls WHERE id IN ({','.join('?' * len(chunk))})", chunk).rowcount
        return RollupStats(rows=deleted, groups=len(groups), cutoff=cutoff)

    def rollup_if_due(self, now: float | None = None, every_s: float = DAY_S) -> RollupStats | None:
        """What the server calls at start and on a timer: a roll-up at most once per `every_s`."""
        now = self.clock() if now is None else now
        last = self.store.query("SELECT value FROM metrics_state WHERE key='last_rollup'")[0][0]
        if now - last < every_s:
            return None
        return self.rollup(now)

    # --- reads ------------------------------------------------------------------------------

    def generation(self) -> int:
        """Changes whenever a call, a rating or a reset changes what the recommender reads."""
        return int(self.store.query("SELECT value FROM metrics_state WHERE key='generation'")[0][0])

    def all(self, days: float | None = None) -> list[ToolMetrics]:
        """Every tool's totals (with `days`, over that window), by server and tool: what each
        ranking reads once per generation, so read as one row (`_packed`)."""
        if days is not None:
            return self._select(None, None, days)
        rows = _packed(self.store, "SELECT server, tool, call_count, success_count, failure_count, avg_latency_ms, last_error, "
                                   "last_called_at, last_success_at FROM tool_metrics", (), 9)  # fmt: skip
        return sorted((ToolMetrics(*r) for r in rows), key=lambda m: (m.server, m.tool))

    def tool(self, server: str, tool: str, days: float | None = None) -> ToolMetrics | None:
        found = self._select(server, tool, days)
        return found[0] if found else None

    def server(self, server: str, days: float | None = None) -> list[ToolMetrics]:
        return self._select(server, None, days)

    def top(self, limit: int = 10, min_calls: int = 1, days: float | None = None) -> list[ToolMetrics]:
        """The most reliable tools: highest success rate, then most calls."""
        rows = [m for m in self._select(None, None, days) if m.call_count >= min_calls]
        rows.sort(key=lambda m: (-m.success_rate, -m.call_count, m.server, m.tool))
        return rows[:limit]

    def failing(self, threshold: float = 0.5, min_calls: int = 3, days: float | None = None) -> list[ToolMetrics]:
        """Tools whose success rate is under `threshold` over at least `min_calls` calls, worst first."""
        rows = [m for m in self._select(None, None, days) if m.call_count >= min_calls and m.success_rate < threshold]
        rows.sort(key=lambda m: (m.success_rate, -m.call_count, m.server, m.tool))
        return rows

    def listing(self, server: str | None = None, tool: str | None = None, failing: bool = False,
                threshold: float = 0.5, min_calls: int = 3) -> Listing:  # fmt: skip
        """What `sidecar metrics` shows. `tool` may be server__tool."""
        if tool and SEP in tool and server is None:
            server, tool = key_of(None, tool)
        rows = self._select(server, tool, None) if (server or tool) else self.all()
        if failing:
            rows = [m for m in rows if m.call_count >= min_calls and m.success_rate < threshold]
        return Listing([m.summary() for m in rows])

    def per_agent(self, agent: str, days: float | None = None) -> dict[tuple[str, str], CallCount]:
        """One agent's calls and successes per (server, tool), from the raw log and the daily
        roll-ups together."""
        raw_where, raw_params, daily_where, daily_params = self._window(days)
        agent = cut(agent, self.caps.agent)  # stored cut to the cap: looked up the same way
        out: dict[tuple[str, str], CallCount] = {}
        rows = _packed(
            self.store,
            f"""SELECT server, tool, sum(c), sum(s) FROM (
                    SELECT server, tool, count(*) AS c, sum(success) AS s FROM tool_calls
                        WHERE agent=?{raw_where.replace('WHERE', 'AND')} GROUP BY server, tool
                    UNION ALL
                    SELECT server, tool, sum(call_count), sum(success_count) FROM tool_metrics_daily
                        WHERE agent=?{daily_where.replace('WHERE', 'AND')} GROUP BY server, tool) AS both_logs
                GROUP BY server, tool""",
            (agent, *raw_params, agent, *daily_params),
            4,
        )
        for server, tool, c, s in rows:
            out[(server, tool)] = CallCount(int(c), int(s))
        return out

    def recent(self, window_s: float, agent: str | None = None, now: float | None = None) -> dict[tuple[str, str], CallCount]:
        """Calls in the last `window_s` seconds per (server, tool), optionally one agent's:
        what availability and rate limits look at (always inside the raw log's retention)."""
        since = (self.clock() if now is None else now) - window_s
        if agent is not None:  # one agent's calls: few, found through their index
            rows = _packed(self.store, "SELECT server, tool, count(*), sum(success) FROM tool_calls WHERE ts >= ? AND agent = ? GROUP BY server, tool",
                           (since, cut(agent, self.caps.agent)), 4)  # fmt: skip
        else:  # the buckets after the one the window starts in, and that one's calls from the raw log
            edge = bucket_of(since) + 1
            rows = _packed(
                self.store,
                """SELECT server, tool, sum(c), sum(s) FROM (
                       SELECT server, tool, calls AS c, successes AS s FROM tool_calls_recent WHERE bucket >= ?
                       UNION ALL
                       SELECT server, tool, 1, success FROM tool_calls WHERE ts >= ? AND ts < ?) AS both_counts
                   GROUP BY server, tool""",
                (edge, since, edge * RECENT_BUCKET_S),
                4,
            )
        return {(s, t): CallCount(int(c), int(k)) for s, t, c, k in rows}

    def failure_reporters(self, window_s: float, now: float | None = None) -> dict[str, tuple[int, bool]]:
        """Per server, who reported its failures in the last `window_s` seconds: the number
        of distinct reporters (connections), and whether this process's own calls (no
        reporter) failed too. What keeps one client from marking a server failing for all."""
        since = (self.clock() if now is None else now) - window_s
        rows = _packed(
            self.store,
            # grouped by an expression, so SQLite reads the window's failures (tool_calls_failed)
            # rather than every retained call in (server, tool) order
            """SELECT server || '', count(DISTINCT reporter), max(CASE WHEN reporter IS NULL THEN 1 ELSE 0 END) FROM tool_calls
               WHERE ts >= ? AND success = 0 GROUP BY server || ''""",
            (since,),
            3,
        )
        return {s: (int(n), bool(own)) for s, n, own in rows}

    def call_sequences(self, catalog: Catalog, limit: int = 50_000, skip: Collection[str] = ()) -> list[list[str]]:
        """Each connection's calls of `catalog`'s tools in the order reported (the raw log's,
        the last `retention_days`; of the latest `limit` calls): what `SequenceFit` learns
        which tools go together from. This process's own calls (no reporter) are left out, and
        the connections in `skip` (those whose user turns say which calls went together)."""
        names = {key_of(catalog, t.name): t.name for t in catalog}
        rows = self.store.query("SELECT reporter, server, tool FROM tool_calls WHERE reporter IS NOT NULL ORDER BY id DESC LIMIT ?", (limit,))
        by: dict[str, list[str]] = {}
        for reporter, server, tool in reversed(rows):
            if (name := names.get((server, tool))) is not None and reporter not in skip:
                by.setdefault(reporter, []).append(name)
        return list(by.values())

    def ratings(self) -> dict[str, tuple[int, float]]:
        """(number of ratings, average rating) per selected tool name."""
        rows = _packed(self.store, "SELECT selected, count(*), avg(rating) FROM feedback WHERE rating IS NOT NULL AND selected IS NOT NULL GROUP BY selected",
                       (), 3)  # fmt: skip
        return {name: (int(n), float(avg)) for name, n, avg in rows}

    def feedback(self, variant: str | None = None, agent: str | None = None) -> list[Feedback]:
        sql = "SELECT id, ts, query, recommended, selected, rating, success, latency_ms, agent, variant FROM feedback"
        where, params = _where(variant=variant, agent=agent)
        sql += where
        out = []
        for fid, ts, q, rec, sel, rating, success, lat, ag, var in self.store.query(sql + " ORDER BY id", params):
            out.append(Feedback(q, orjson.loads(rec), sel, rating, None if success is None else bool(success), lat, ag, var, ts, fid))
        return out

    # --- helpers ------------------------------------------------------------------------------

    def _window(self, days: float | None) -> tuple[str, list, str, list]:
        if days is None:
            return "", [], "", []
        since = self.clock() - days * DAY_S
        return " WHERE ts >= ?", [since], " WHERE day >= ?", [day_of(since)]

    def _select(self, server: str | None, tool: str | None, days: float | None) -> list[ToolMetrics]:
        """Lifetime totals from tool_metrics, or with `days`, the window summed over the raw
        log and the daily roll-ups."""
        where, params = _where(server=server, tool=tool)
        if days is None:
            rows = self.store.query(
                f"""SELECT server, tool, call_count, success_count, failure_count, avg_latency_ms, last_error,
                           last_called_at, last_success_at FROM tool_metrics{where} ORDER BY server, tool""",
                params,
            )
            return [ToolMetrics(*r) for r in rows]
        since = self.clock() - days * DAY_S
        and_match = where.replace(" WHERE", " AND")
        raw = self.store.query(
            f"""SELECT server, tool, count(*), sum(success), sum(coalesce(latency_ms, 0)), count(latency_ms), max(ts),
                       max(CASE WHEN success = 1 THEN ts END),
                       (SELECT error FROM tool_calls e WHERE e.server = c.server AND e.tool = c.tool AND e.error IS NOT NULL
                        ORDER BY e.ts DESC LIMIT 1)
                FROM tool_calls c WHERE ts >= ?{and_match} GROUP BY server, tool""",
            (since, *params),
        )
        daily = self.store.query(
            f"""SELECT server, tool, sum(call_count), sum(success_count), sum(latency_sum_ms), sum(latency_count),
                       max(last_called_at), max(last_success_at),
                       (SELECT last_error FROM tool_metrics_daily e WHERE e.server = d.server AND e.tool = d.tool
                        AND e.last_error IS NOT NULL ORDER BY e.day DESC LIMIT 1)
                FROM tool_metrics_daily d WHERE day >= ?{and_match} GROUP BY server, tool""",
            (day_of(since), *params),
        )
        return _merge(daily, raw)


def _packed(store: Store, sql: str, params: Sequence[Any], width: int) -> list[list]:
    """`sql`'s rows (`width` columns) read as one JSON row: SQLite gives the GIL back at each
    row it steps to, and beside a busy event loop each hand-back waits up to the 5 ms switch
    interval (`recent`'s 20 rows took 54 ms a ranking that way). Reals come back to SQLite's
    15 significant digits (timestamps to 10 microseconds)."""
    cols = ", ".join(f"c{i}" for i in range(width))
    text = store.query(f"WITH q({cols}) AS ({sql}) SELECT CAST(json_agg(json_build_array({cols})) AS TEXT) FROM q", params)[0][0]
    return orjson.loads(text) if text else []


def _where(**columns: object) -> tuple[str, list]:
    """' WHERE a = ? AND b = ?' for the columns given a value (None: any), and the values."""
    given = {k: v for k, v in columns.items() if v is not None}
    clause = " WHERE " + " AND ".join(f"{k} = ?" for k in given) if given else ""
    return clause, list(given.values())


def _merge(*sources: Iterable[Sequence]) -> list[ToolMetrics]:
    """Sum (server, tool, calls, successes, latency sum, latency n, last, last ok, error) rows;
    later sources' errors win (the raw log is newer than the roll-ups)."""
    acc: dict[tuple[str, str], list] = {}
    for rows in sources:
        for server, tool, c, s, lsum, ln, last, last_ok, err in rows:
            a = acc.setdefault((server, tool), [0, 0, 0.0, 0, None, None, None])
            a[0] += int(c)
            a[1] += int(s or 0)
            a[2] += float(lsum or 0)
            a[3] += int(ln or 0)
            a[4] = max(filter(None, (a[4], last)), default=None)
            a[5] = max(filter(None, (a[5], last_ok)), default=None)
            a[6] = err or a[6]
    out = []
    for (server, tool), (c, s, lsum, ln, last, last_ok, err) in sorted(acc.items()):
        out.append(ToolMetrics(server, tool, c, s, c - s, lsum / ln if ln else None, err, last, last_ok))
    return out
