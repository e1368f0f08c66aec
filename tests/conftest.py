from __future__ import annotations

import contextlib
import os
import pathlib
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import pytest

from tests.mcp_support import fs_root, fs_server  # noqa: F401  (fixtures of the MCP tests: real servers)

ROOT = pathlib.Path(__file__).resolve().parent.parent
CATALOGS = ROOT / "fixtures" / "catalogs"
_LISTENING = re.compile(r"listening on (ws://\S+)")


def engine_of(pipe, cfg=None, history: bool = True):
    """The engine around an already loaded pipeline (the tests load each model once)."""
    from sidecar.config import Config
    from sidecar.engine import Sidecar, open_history

    cfg = cfg or Config()
    return Sidecar(cfg, pipe, pipe.store, open_history(cfg, pipe.store) if history and pipe.store is not None else None)


# A real `sidecar serve` process -------------------------------------------------------------


@dataclass(frozen=True)
class Served:
    """A running `sidecar serve`: where it listens, the process, and its log (stdout and stderr)."""

    url: str
    proc: subprocess.Popen
    log: pathlib.Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def serve_process(args: Sequence[str], tmp: pathlib.Path, *, env: Mapping[str, str | None] | None = None,
                  timeout: float = 120, name: str = "serve", whole: bool = True) -> Iterator[Served]:  # fmt: skip
    """`sidecar serve ARGS` on 127.0.0.1, port 0 (ARGS may override both), logging to
    TMP/NAME.log; yields once its log says where it listens (only said once everything has
    loaded) and, with `whole`, its /healthz says every tool is indexed (a cold catalog of more
    than 32 tools is indexed after it listens); stops it on exit. `env` is laid over
    os.environ (None removes a variable)."""
    with serve_processes([args], tmp, env=env, timeout=timeout, name=name, whole=whole) as (served,):
        yield served


@contextlib.contextmanager
def serve_processes(argss: Sequence[Sequence[str]], tmp: pathlib.Path, *, env: Mapping[str, str | None] | None = None,
                    timeout: float = 120, name: str = "serve", whole: bool = True) -> Iterator[list[Served]]:  # fmt: skip
    """`serve_process` for several processes started at once (they load side by side), logging to
    TMP/NAME-0.log, TMP/NAME-1.log ... (TMP/NAME.log for one); fails with a process's log
    when it exits or is not listening within `timeout` s, and stops every one on exit."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    logs = [tmp / (f"{name}.log" if len(argss) == 1 else f"{name}-{i}.log") for i in range(len(argss))]
    procs: list[subprocess.Popen] = []
    try:
        for args, log in zip(argss, logs):
            with open(log, "wb") as out:  # the child keeps its own descriptor
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "sidecar", "serve", "--host", "127.0.0.1", "--port", "0", *args],
                    stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT,
                ))  # fmt: skip
        deadline = time.monotonic() + timeout
        urls = [_listening_url(proc, log, deadline) for proc, log in zip(procs, logs)]
        if whole:
            for url, log in zip(urls, logs):
                _whole(url, log, deadline)
        yield [Served(url, proc, log) for url, proc, log in zip(urls, procs, logs)]
    finally:
        for proc in procs:
            _stop(proc)


def _listening_url(proc: subprocess.Popen, log: pathlib.Path, deadline: float) -> str:
    """The URL `proc` says it listens on; fails with its log if it exits or the deadline passes."""
    while True:
        exited = proc.poll() is not None  # read before the log, so a last line written before exit is seen
        text = log.read_text(errors="replace")
        if found := _LISTENING.search(text):
            return found.group(1)
        if exited:
            pytest.fail(f"sidecar serve exited with {proc.returncode} before listening; its log ({log}):\n{text}")
        if time.monotonic() > deadline:
            pytest.fail(f"sidecar serve was not listening in time; its log ({log}):\n{text}")
        time.sleep(0.1)


def _whole(url: str, log: pathlib.Path, deadline: float) -> None:
    """Wait until the server at ws `url` says on /healthz that its whole catalog is indexed."""
    import urllib.request

    health = url.replace("ws://", "http://", 1).rstrip("/") + "/healthz"
    body = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(health, timeout=5) as r:
                body = r.read().decode()
        except OSError as e:  # a 503 while loading, or not answering yet
            body = str(e)
        if body == "ok\n":
            return
        time.sleep(0.2)
    pytest.fail(f"sidecar serve never indexed its whole catalog ({health}: {body!r}); its log ({log}):\n{log.read_text(errors='replace')}")


def _stop(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM (it finishes in-flight work), then SIGKILL if it does not exit within `grace_s`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()
