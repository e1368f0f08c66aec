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
