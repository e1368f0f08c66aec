"""The store's interface, which every backend implements: the embedding cache and file
digests, and the tables other modules keep here (`metrics`: tool calls and feedback).

Callers write one SQL, SQLite's flavour with `?` placeholders, `INSERT ... AS cur ... ON
CONFLICT (...) DO UPDATE`, `RETURNING id`, and `greatest(a, b)` for the larger of two
non-NULL values; each backend's `sql()` turns it into its own (the only place the dialects
differ). Every write is one transaction committed before `write()` returns, so a caller may
acknowledge what it wrote. The backends (`sqlite`, `postgres`) import this module and nothing
here imports them: `sidecar.store.open_store` picks one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import time
from collections.abc import Callable, Iterable, Sequence
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


def default_path(data_home: str | None = None) -> pathlib.Path:
    """The store when none is configured: <data home>/sidecar/sidecar.db, the data home being
    ~/.local/share unless given (`config.load` gives $XDG_DATA_HOME: it alone reads the
    environment)."""
    base = data_home or os.path.join(pathlib.Path.home(), ".local", "share")
    return pathlib.Path(base) / "sidecar" / "sidecar.db"


def text_key(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


BUSY_TIMEOUT_MS = 10_000  # every other statement's wait (sqlite3's busy handler; PostgreSQL's lock timeout)


class StoreError(RuntimeError):
    pass


class StoreBusy(StoreError):
    """Another process held the store's write lock for longer than the write's bound."""


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
    """What every backend provides (`open_store(location)` opens the one a location names).

    A backend implements `sql`, `write`, `transaction`, `query`, `ensure_schema`, `tables`,
    `columns`, `checkpoint` and `close`; the embedding cache and file digests below are
    written once, in the package's SQL, on top of them."""

    location: str  # for messages: a path, or a URL without its password


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

    def built(self, table: str, key: str) -> bytes | None:
        """What a table of built things (columns key, built_at, entry: a lexical index, a
        fitted classifier) keeps under `key`, or None."""
        found = self.query(f"SELECT entry FROM {table} WHERE key=?", (key,))
        return bytes(found[0][0]) if found else None

    def keep_built(self, table: str, key: str, entry: bytes, kept: int) -> None:
        """Keep `entry` under `key` in such a table, and only its `kept` newest entries; a store
        busy past its bound only costs the keeping."""

        def keep(tx) -> None:
            tx.execute(f"""INSERT INTO {table} AS cur VALUES (?,?,?) ON CONFLICT (key)
                           DO UPDATE SET built_at = excluded.built_at, entry = excluded.entry""", (key, time.time(), entry))  # fmt: skip
            tx.execute(f"DELETE FROM {table} WHERE key NOT IN (SELECT key FROM {table} ORDER BY built_at DESC LIMIT ?)", (kept,))

        try:
            self.write(keep)
        except StoreBusy:
            pass

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
