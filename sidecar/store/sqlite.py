"""The store: embedding cache and file digests; other modules keep their tables here
(`metrics.py`: tool calls and feedback). One interface, two backends:

- SQLite (`SQLiteStore`, here): the embedded default, one file, for one machine;
- PostgreSQL (`store_pg.PgStore`): a `postgresql://` URL, so several sidecars behind a load
  balancer share one history and learn together.

`open_store(location)` picks the backend. Callers write one SQL, SQLite's flavour with `?`
placeholders, `INSERT ... AS cur ... ON CONFLICT (...) DO UPDATE`, `RETURNING id`, and
`greatest(a, b)` for the larger of two non-NULL values; each backend's `sql()` turns it
into its own (the only place the dialects differ). Every write is one transaction committed
before `write()` returns, so a caller may acknowledge what it wrote.

SQLite: WAL mode, one connection guarded by a lock: the sidecar's writes are small and few,
and WAL lets other processes (the CLI reading metrics) read while it writes. The default
file is shared by every sidecar process of the user, so another process may hold SQLite's
write lock. `write()` waits for it in short slices (BUSY_SLICE_MS, the store's own lock
released between them so this process's reads go on), retries a transaction that lost the
race, and gives up with `StoreBusy` after the caller's bound instead of blocking on it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")

SCHEMA = """
CREATE TABLE IF NOT EXISTS embedding_cache (
    model    TEXT NOT NULL,   -- content hash of the model weights
    text_sha TEXT NOT NULL,   -- sha256 of the exact text embedded (task prefix included)
    dim      INTEGER NOT NULL,
    vector   BLOB NOT NULL,   -- float32, unit length
    PRIMARY KEY (model, text_sha)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS file_digest (
    path     TEXT PRIMARY KEY,
    size     INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    sha256   TEXT NOT NULL
);
"""

PG_URL = re.compile(r"^postgres(ql)?://", re.IGNORECASE)
URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)


def default_path(data_home: str | None = None) -> pathlib.Path:
    """The store when none is configured: <data home>/sidecar/sidecar.db, the data home being
    ~/.local/share unless given (`config.load` gives $XDG_DATA_HOME: it alone reads the
    environment)."""
    base = data_home or os.path.join(pathlib.Path.home(), ".local", "share")
    return pathlib.Path(base) / "sidecar" / "sidecar.db"


def text_key(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


BUSY_SLICE_MS = 50  # one attempt's wait for another process's write lock
# SQLite's page cache, in KiB, of the store's one connection: what the store's reads may keep
# in memory (SQLite's own default, said here so it stays one cache, not one per thread).
PAGE_CACHE_KIB = 2000
BUSY_TIMEOUT_MS = 10_000  # every other statement's wait (sqlite3's busy handler)


class StoreError(RuntimeError):
    pass


class StoreBusy(StoreError):
    """Another process held the store's write lock for longer than the write's bound."""


def is_busy(e: sqlite3.Error) -> bool:
    """SQLITE_BUSY (any extended code): another connection holds the lock."""
    code = getattr(e, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF == sqlite3.SQLITE_BUSY
    return "locked" in str(e) or "busy" in str(e)


def open_store(location: str | os.PathLike | None) -> Store:
    """The store a config names: a `postgresql://` URL, a SQLite file, or None (and "") for
    the default SQLite file."""
    return Store(location or default_path())


def backend_for(location: str | os.PathLike) -> type[Store]:
    if isinstance(location, str) and PG_URL.match(location):
        try:
            from .postgres import PgStore
        except ImportError as e:
            raise StoreError(f"a postgresql:// store needs psycopg 3 ({e}): pip install 'psycopg[binary]'") from None
        return PgStore
    if isinstance(location, str) and (m := URL.match(location)):
        raise StoreError(f"store {location.split('@')[-1]!r}: unsupported scheme {m.group(0)!r} (a SQLite file path, or postgresql://)")
    return SQLiteStore


class Tx:
    """A connection inside one transaction (or a read), speaking the package's SQL: `sql`
    is the backend's translation. Cursors come back as the driver gives them (fetchone,
    fetchall, rowcount)."""

    __slots__ = ("conn", "sql")

    def __init__(self, conn: Any, sql: Callable[[str], str]):
        self.conn, self.sql = conn, sql

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        return self.conn.execute(self.sql(sql), tuple(params))

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> Any:
        cur = self.conn.cursor()
        cur.executemany(self.sql(sql), list(rows))
        return cur


class Store:
    """What every backend provides. `Store(location)` opens the backend the location names,
    as `open_store` does (kept so `Store(path)` callers from before PostgreSQL still work).

    A backend implements `sql`, `write`, `transaction`, `query`, `ensure_schema`, `tables`,
    `columns`, `checkpoint` and `close`; the embedding cache and file digests below are
    written once, in the package's SQL, on top of them."""

    location: str  # for messages: a path, or a URL without its password

    def __new__(cls, location: str | os.PathLike | None = None, *args: Any, **kwargs: Any):
        backend = backend_for(location if location is not None else default_path()) if cls is Store else cls
        return super().__new__(backend)

    # --- the backend's part --------------------------------------------------------------

    def sql(self, text: str) -> str:
        """The package's SQL (SQLite's flavour) in this backend's."""
        raise NotImplementedError

    def write(self, fn: Callable[[Tx], T], timeout_s: float | None = None) -> T:
        """`fn(tx)` in one write transaction, committed before returning; waits at most
        `timeout_s` (None: BUSY_TIMEOUT_MS) for another process's locks, then StoreBusy.
        `fn` may run more than once (a lost race is retried): it must only touch the database."""
        raise NotImplementedError

    def transaction(self) -> contextlib.AbstractContextManager[Tx]:
        """One write transaction: committed when the block ends, rolled back if it raises."""
        raise NotImplementedError

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        raise NotImplementedError

    def ensure_schema(self, ddl: str) -> None:
        """Let a module that keeps its own tables here create them (idempotent DDL, SQLite's
        types: each backend maps them)."""
        raise NotImplementedError

    def tables(self) -> set[str]:
        raise NotImplementedError

    def columns(self, table: str) -> set[str]:
        raise NotImplementedError

    def checkpoint(self) -> None:
        """On shutdown: leave the store self-contained (SQLite folds its WAL in)."""

    def close(self) -> None:
        raise NotImplementedError

    # --- shared: the embedding cache and file digests -------------------------------------

    def vectors(self, model: str, keys: Iterable[str]) -> dict[str, np.ndarray]:
        keys = list(keys)
        out: dict[str, np.ndarray] = {}
        for i in range(0, len(keys), 500):
            chunk = keys[i:i + 500]
            marks = ",".join("?" * len(chunk))
            rows = self.query(f"SELECT text_sha, dim, vector FROM embedding_cache WHERE model=? AND text_sha IN ({marks})", [model, *chunk])
            for sha, dim, blob in rows:
                vec = np.frombuffer(blob, dtype=np.float32)
                if vec.shape[0] == dim:
                    out[sha] = vec
        return out

    def put_vectors(self, model: str, items: dict[str, np.ndarray]) -> None:
        rows = [(model, k, int(v.shape[0]), np.asarray(v, np.float32).tobytes()) for k, v in items.items()]
        if rows:
            self.write(lambda tx: tx.executemany(
                """INSERT INTO embedding_cache AS cur VALUES (?,?,?,?) ON CONFLICT (model, text_sha)
                   DO UPDATE SET dim = excluded.dim, vector = excluded.vector""", rows))  # fmt: skip

    def file_sha256(self, path: str | pathlib.Path) -> str:
        """A file's sha256, computed once per (path, size, mtime)."""
        path = pathlib.Path(path).resolve()
        st = path.stat()
        rows = self.query("SELECT size, mtime_ns, sha256 FROM file_digest WHERE path=?", (str(path),))
        if rows and rows[0][0] == st.st_size and rows[0][1] == st.st_mtime_ns:
            return rows[0][2]
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        digest = h.hexdigest()
        self.write(lambda tx: tx.execute(
            """INSERT INTO file_digest AS cur VALUES (?,?,?,?) ON CONFLICT (path)
               DO UPDATE SET size = excluded.size, mtime_ns = excluded.mtime_ns, sha256 = excluded.sha256""",
            (str(path), st.st_size, st.st_mtime_ns, digest)))  # fmt: skip
        return digest


def sqlite_sql(text: str) -> str:
    """SQLite's scalar max() is the package's greatest() (both given non-NULL values)."""
    return text.replace("greatest(", "max(")


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
