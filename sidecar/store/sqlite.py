"""The SQLite backend of the store: the embedded default, one file, for one machine.

WAL mode, one connection guarded by a lock: the sidecar's writes are small and few, and WAL
lets other processes (the CLI reading metrics) read while it writes. The default file is
shared by every sidecar process of the user, so another process may hold SQLite's write
lock. `write()` waits for it in short slices (BUSY_SLICE_MS, the store's own lock released
between them so this process's reads go on), retries a transaction that lost the race, and
gives up with `StoreBusy` after the caller's bound instead of blocking on it.
"""

from __future__ import annotations

import contextlib
import pathlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any


from .base import BUSY_TIMEOUT_MS, SCHEMA, Store, StoreBusy, StoreError, T, Tx

BUSY_SLICE_MS = 50  # one attempt's wait for another process's write lock
# SQLite's page cache, in KiB, of the store's one connection: what the store's reads may keep
# in memory (SQLite's own default, said here so it stays one cache, not one per thread).
PAGE_CACHE_KIB = 2000


def is_busy(e: sqlite3.Error) -> bool:
    """SQLITE_BUSY (any extended code): another connection holds the lock."""
    code = getattr(e, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF == sqlite3.SQLITE_BUSY
    return "locked" in str(e) or "busy" in str(e)


def sqlite_sql(text: str) -> str:
    """The package's SQL is PostgreSQL's where the two differ: SQLite's scalar max() is
    greatest() (both given non-NULL values), json_group_array() json_agg(), json_array()
    json_build_array()."""
    return text.replace("greatest(", "max(").replace("json_agg(", "json_group_array(").replace("json_build_array(", "json_array(")


class SQLiteStore(Store):
    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        self.location = str(self.path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(f"PRAGMA cache_size=-{PAGE_CACHE_KIB}")
            self._db.executescript(SCHEMA)
        except (OSError, sqlite3.Error) as e:
            raise StoreError(f"cannot open store {self.path}: {e}") from None
        self._lock = threading.Lock()
        self._tx = Tx(self._db, sqlite_sql)

    def sql(self, text: str) -> str:
        return sqlite_sql(text)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Tx]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._tx
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def write(self, fn: Callable[[Tx], T], timeout_s: float | None = None) -> T:
        """SQLite's write lock, when another process holds it, is waited for in slices of
        BUSY_SLICE_MS with this store's lock released in between; a transaction that loses
        the race (busy at BEGIN or COMMIT) is rolled back and run again."""
        limit = BUSY_TIMEOUT_MS / 1000 if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        pause = 0.002
        attempts = 0
        while True:
            attempts += 1
            with self._lock:
                try:
                    self._db.execute(f"PRAGMA busy_timeout={BUSY_SLICE_MS}")
                    try:
                        self._db.execute("BEGIN IMMEDIATE")
                    finally:
                        self._db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
                except sqlite3.OperationalError as e:
                    if not is_busy(e):
                        raise
                else:
                    try:
                        out = fn(self._tx)
                        self._db.execute("COMMIT")
                        return out
                    except sqlite3.OperationalError as e:
                        if self._db.in_transaction:
                            self._db.execute("ROLLBACK")
                        if not is_busy(e):
                            raise
                    except BaseException:
                        if self._db.in_transaction:
                            self._db.execute("ROLLBACK")
                        raise
            if time.monotonic() >= deadline:
                raise StoreBusy(f"{self.path} is locked by another process (waited {limit:g} s over {attempts} attempts)")
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.05)

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        with self._lock:
            return self._tx.execute(sql, params).fetchall()

    def ensure_schema(self, ddl: str) -> None:
        with self._lock:
            self._db.executescript(ddl)

    def tables(self) -> set[str]:
        return {r[0] for r in self.query("SELECT name FROM sqlite_master WHERE type='table'")}

    def columns(self, table: str) -> set[str]:
        return {r[1] for r in self.query(f"PRAGMA table_info({table})")}

    def checkpoint(self) -> None:
        """Fold the WAL into the main file (on shutdown: leave one self-contained file)."""
        with self._lock:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
