"""What a command shows on stderr while it works (sidecar/progress.py). A real CLI run on a
catalog that needs embedding is tests/test_replay.py::test_cli_replay_json_and_events."""

from __future__ import annotations

import threading
import time

from sidecar import progress


def test_a_slow_step_says_what_it_is_doing(capsys):
    seen = ""
    with progress.slow_step("loading a model", after_s=0.0):
        deadline = time.monotonic() + 30  # a bound against a hang, not a speed assertion
        while "loading" not in seen and time.monotonic() < deadline:
            seen += capsys.readouterr().err
            time.sleep(0.01)
    assert seen == "sidecar: loading a model\n"


def test_a_quick_step_and_a_disabled_one_say_nothing(capsys):
    before = threading.active_count()
    with progress.slow_step("loading a model", after_s=60.0):
        pass
    with progress.slow_step("loading a model", enabled=False, after_s=0.0):
        time.sleep(0.05)
    with progress.bar(10, "indexing", enabled=False) as bar:
        bar.update(10)
    progress.note("indexing", enabled=False)
    assert capsys.readouterr().err == ""
    assert threading.active_count() <= before + 1  # the cancelled timer's thread ends (or is ending)


def test_a_bar_counts_on_stderr_only(capsys):
    with progress.bar(3, "indexing 3 tools", unit="text") as bar:
        bar.update(3)
    out = capsys.readouterr()
    assert out.out == "" and "indexing 3 tools:   0%" in out.err and "0/3" in out.err
    assert out.err.endswith("\r")  # cleared when done: what follows is not mixed into it


LOADS_BESIDE = """
import logging, sys, threading
from sidecar import progress
from sidecar.core import models
from sidecar.core.embed import Embedder

progress.log_to_stderr(logging.WARNING)
r = models.resolve(models.SMALL_MODEL)
embedders = [Embedder(r.path, name=r.name, identity="t", threads=1, max_tokens=r.spec.n_ctx) for _ in range(3)]
done = threading.Event()

def beside():  # each second context loads on its first call, while the main thread writes
    for e in embedders:
        with e.beside():
            e.embed(["save a text file"])
    done.set()

threading.Thread(target=beside).start()
n = 0
while not done.is_set() or n < 20:
    progress.note(f"note {n}")
    logging.getLogger("t").warning("log %d", n)
    n += 1
progress.note(f"wrote {n}")
"""


def test_no_line_is_lost_while_a_second_context_loads_beside():
    """llama-cpp-python points stdout and stderr at /dev/null while it loads a model; the
    second context now loads on its first call, on a thread of its own (a warm start that
    needs it never loads it), so what other threads write meanwhile waits for the load
    (progress.STDIO) instead of vanishing."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", LOADS_BESIDE], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stderr.splitlines()
    n = int(lines[-1].removeprefix("sidecar: wrote "))
    assert n >= 20
    notes = {line for line in lines if line.startswith("sidecar: note ")}
    logs = {line for line in lines if line.startswith("sidecar: WARNING t: log ")}
    assert notes == {f"sidecar: note {i}" for i in range(n)}
    assert logs == {f"sidecar: WARNING t: log {i}" for i in range(n)}
