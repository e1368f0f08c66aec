"""Storage: the store (embedding cache, file digests) and the metrics store (tool calls,
feedback) that feeds the recommender. One interface (`base.Store`), two backends:

- SQLite (`sqlite.SQLiteStore`): the embedded default, one file, for one machine;
- PostgreSQL (`postgres.PgStore`): a `postgresql://` URL, so several sidecars behind a load
  balancer share one history and learn together.

`open_store(location)` picks the backend; the rest of the package imports the store from here.
"""

from __future__ import annotations

import os
import re

from .base import BUSY_TIMEOUT_MS, SCHEMA, Store, StoreBusy, StoreError, Tx, default_path, text_key
from .sqlite import PAGE_CACHE_KIB, SQLiteStore

__all__ = ["BUSY_TIMEOUT_MS", "PAGE_CACHE_KIB", "SCHEMA", "SQLiteStore", "Store", "StoreBusy", "StoreError", "Tx",
           "backend_for", "default_path", "open_store", "text_key"]

PG_URL = re.compile(r"^postgres(ql)?://", re.IGNORECASE)
URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)


def open_store(location: str | os.PathLike | None) -> Store:
    """The store a config names: a `postgresql://` URL, a SQLite file, or None (and "") for
    the default SQLite file."""
    location = location or default_path()
    return backend_for(location)(location)


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
