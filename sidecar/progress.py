"""What a command shows on stderr while a step runs: a bar for work that can be counted (texts
embedded, items judged), one line for a step that cannot (a model loading, a classifier
fitting).

A newcomer's first `sidecar replay --catalog fixtures/catalogs/ALL.json` spends minutes
embedding 605 tools; silent, it looks hung. So every step that may take more than a couple
of seconds says so here, on stderr only: stdout stays the command's answer (`--json`
prints exactly one JSON document). `enabled=False` (the library's `progress=False`) keeps
both quiet; bars show on a pipe too, not only on a terminal, so a log or a test sees them.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tqdm import tqdm

SLOW_S = 1.0  # a step still running after this long says what it is doing
# Held while llama.cpp loads a model: llama-cpp-python points file descriptors 1 and 2 (and
# sys.stdout, sys.stderr) at /dev/null meanwhile, so a line another thread wrote then was lost
# ("listening on" once, while a second context loaded beside). What this module writes, and the
# log handler `log_to_stderr` installs, waits for the load instead.
STDIO = threading.RLock()


def bar(total: int, desc: str, enabled: bool = True, unit: str = "item") -> tqdm:
    """A progress bar on stderr, cleared when it closes (`with bar(...) as b: b.update(n)`)."""
    from tqdm import tqdm  # here: importing it (and importlib.metadata) is 20 ms of every start

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not enabled, leave=False, dynamic_ncols=True)


def note(message: str, enabled: bool = True) -> None:
    """One line on stderr, before a step that shows no bar."""
    if enabled:
        with STDIO:
            print(f"sidecar: {message}", file=sys.stderr, flush=True)


class _StderrHandler(logging.StreamHandler):
    """Log records on stderr, never while a model loads (STDIO)."""

    def emit(self, record: logging.LogRecord) -> None:
        with STDIO:
            super().emit(record)


def log_to_stderr(level: int) -> None:
    """The commands' logging: records at `level` and up on stderr, "sidecar: LEVEL name: message"."""
    logging.basicConfig(level=level, format="sidecar: %(levelname)s %(name)s: %(message)s", handlers=[_StderrHandler()])


@contextlib.contextmanager
def slow_step(message: str, enabled: bool = True, after_s: float = SLOW_S) -> Iterator[None]:
    """`note(message)` if the step is still running after `after_s` seconds: loading a model
    takes a fraction of a second when its file is in the page cache (nothing to say), several
    on a cold disk (it reads and hashes the whole file first), and a step that fails at once
    (an unknown model) prints only its error."""
    timer = threading.Timer(after_s, note, (message,)) if enabled else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
