"""The SQLite store: embedding cache and file digests; other modules keep their tables here
(`metrics.py`: tool calls and feedback).

One file, WAL mode, one connection guarded by a lock: the sidecar's writes are small and
few, and WAL lets other processes (the CLI reading metrics) read while it writes.

The default file is shared by every sidecar process of the user, so another process may hold
SQLite's write lock. `write()` waits for it in short slices (BUSY_SLICE_MS, the store's own
lock released between them so this process's reads go on), retries a transaction that lost
the race, and gives up with `StoreBusy` after the caller's bound instead of blocking on it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
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


def default_path() -> pathlib.Path:
    """SIDECAR_STORE, else $XDG_DATA_HOME/sidecar/sidecar.db, else ~/.local/share/sidecar/sidecar.db."""
    if env := os.environ.get("SIDECAR_STORE"):
        return pathlib.Path(env)
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(pathlib.Path.home(), ".local", "share")
    return pathlib.Path(base) / "sidecar" / "sidecar.db"


def text_key(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


BUSY_SLICE_MS = 50  # one attempt's wait for another process's write lock
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


class Store:
    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
        except (OSError, sqlite3.Error) as e:
            raise StoreError(f"cannot open store {self.path}: {e}") from None
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction under the store's lock: committed when the block ends (so a
        caller may acknowledge what it wrote), rolled back if it raises."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def write(self, fn: Callable[[sqlite3.Connection], T], timeout_s: float | None = None) -> T:
        """`fn(db)` in one write transaction, committed before returning (so a caller may
        acknowledge what it wrote). SQLite's write lock, when another process holds it, is
        waited for in slices of BUSY_SLICE_MS with this store's lock released in between;
        a transaction that loses the race (busy at BEGIN or COMMIT) is rolled back and run
        again. After `timeout_s` (None: BUSY_TIMEOUT_MS) of trying: StoreBusy. `fn` may
        run more than once: it must only touch the database."""
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
                        out = fn(self._db)
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
            return self._db.execute(sql, params).fetchall()

    def ensure_schema(self, ddl: str) -> None:
        """Let a module that keeps its own tables here create them (idempotent DDL)."""
        with self._lock:
            self._db.executescript(ddl)

    def vectors(self, model: str, keys: Iterable[str]) -> dict[str, np.ndarray]:
        keys = list(keys)
        out: dict[str, np.ndarray] = {}
        with self._lock:
            for i in range(0, len(keys), 500):
                chunk = keys[i:i + 500]
                marks = ",".join("?" * len(chunk))
                rows = self._db.execute(
                    f"SELECT text_sha, dim, vector FROM embedding_cache WHERE model=? AND text_sha IN ({marks})",
                    [model, *chunk],
                )
                for sha, dim, blob in rows:
                    vec = np.frombuffer(blob, dtype=np.float32)
                    if vec.shape[0] == dim:
                        out[sha] = vec
        return out

    def put_vectors(self, model: str, items: dict[str, np.ndarray]) -> None:
        rows = [(model, k, int(v.shape[0]), np.asarray(v, np.float32).tobytes()) for k, v in items.items()]
        with self._lock, self._db:
            self._db.execute("BEGIN")
            self._db.executemany("INSERT OR REPLACE INTO embedding_cache VALUES (?,?,?,?)", rows)

    def checkpoint(self) -> None:
        """Fold the WAL into the main file (on shutdown: leave one self-contained file)."""
        with self._lock:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def file_sha256(self, path: str | pathlib.Path) -> str:
        """A file's sha256, computed once per (path, size, mtime)."""
        path = pathlib.Path(path).resolve()
        st = path.stat()
        with self._lock:
            row = self._db.execute("SELECT size, mtime_ns, sha256 FROM file_digest WHERE path=?", (str(path),)).fetchone()
        if row and row[0] == st.st_size and row[1] == st.st_mtime_ns:
            return row[2]
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        digest = h.hexdigest()
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO file_digest VALUES (?,?,?,?)", (str(path), st.st_size, st.st_mtime_ns, digest))
        return digest
