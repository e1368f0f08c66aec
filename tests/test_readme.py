"""The README stays true. Its first screen holds exactly the command CI runs, and every command
in its ```sh blocks runs as written from a fresh clone: the walk below runs each `sidecar ...`
(or `.venv/bin/sidecar`, `python -m sidecar...`) line from the repository root with this
test's venv, in README order, and asserts it exits 0. A `sidecar serve` line is started, waited
for until it listens (and its page and /healthz answer), and kept running for the lines after
it, which reach it at the port it got. The setup commands themselves are skipped by name,
each with its reason (SKIPPED); anything else in a ```sh block fails the walk, so a new kind of
command needs a decision here. The ```python block (the client example) runs too, against the
walk's server."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass


from .conftest import ROOT, serve_process

README = ROOT / "README.md"
COMMAND_TIMEOUT_S = 1800  # the tour's `tune` (751 BFCL questions, nomic, a fresh store) took 738 s on 2 cores shared with other runs
README_URL = "127.0.0.1:8765"  # where the README's commands reach `sidecar serve`

# A command's first words -> why the walk does not run it. Keep this short: every entry is a
# README command nobody checks.
SKIPPED = {
    ("apt-get",): "installs Debian packages as root, from the network (the setup itself)",
    ("python3", "-m", "venv"): "creates the venv this test already runs in",
    (".venv/bin/pip", "install"): "installs from the package index and builds llama.cpp (~7 minutes)",
    (".venv/bin/python", "-m", "pytest"): "the whole test suite, which this test is part of",
}

def test_ci_runs_the_readme_test_command():
    readme = README.read_text()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci.startswith("python3 -m venv .venv") and "pytest" in ci
    first_screen = "\n".join(readme.splitlines()[:30])
    assert ci in first_screen
    assert "sidecar " in first_screen.split(ci)[0]  # the run command comes first


# Reading the README ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    line: int  # in README.md
    words: tuple[str, ...]

    def __str__(self) -> str:
        return f"README.md:{self.line}: {shlex.join(self.words)}"


def blocks(text: str, lang: str) -> list[tuple[int, str]]:
    """Each ```LANG block: the line number of its first line, and its text."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].strip() == f"```{lang}":
            start, body = i + 2, []
            i += 1
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            out.append((start, "\n".join(body)))
        i += 1
    return out


def commands(text: str) -> list[Command]:
    """Every command of the ```sh blocks, in order; `a && b` is two commands, `# ...` a comment."""
    out = []
    for start, body in blocks(text, "sh"):
        for n, line in enumerate(body.splitlines(), start):
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                out.append(Command(n, tuple(words[:cut])))
                words = words[cut + 1 :]
    return out


def skipped(cmd: Command) -> str | None:
    for prefix, why in SKIPPED.items():
        if cmd.words[: len(prefix)] == prefix:
            return why
    return None


def argv(cmd: Command) -> list[str] | None:
    """What runs `cmd` with this test's venv, or None if it is not a sidecar command."""
    w = list(cmd.words)
    if w[0] in ("sidecar", ".venv/bin/sidecar"):
        script = pathlib.Path(sys.executable).parent / "sidecar"
        return [str(script), *w[1:]] if script.exists() else [sys.executable, "-m", "sidecar", *w[1:]]
    if w[0] in ("python", "python3", ".venv/bin/python") and w[1:2] == ["-m"] and re.fullmatch(r"sidecar(\.\w+)*", w[2]):
        return [sys.executable, *w[1:]]
    return None


def test_every_readme_command_is_run_or_skipped_for_a_stated_reason():
    cmds = commands(README.read_text())
    assert any(c.words[:2] == ("sidecar", "serve") for c in cmds), "the tour starts a server"
    unknown = [str(c) for c in cmds if skipped(c) is None and argv(c) is None]
    assert not unknown, "README commands the walk neither runs nor skips (add them to SKIPPED with a reason, or make them sidecar commands):\n" + "\n".join(unknown)


# Walking it -----------------------------------------------------------------------------------


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read().decode(errors="replace")


def test_every_readme_command_runs_as_written(tmp_path):
    text = README.read_text()
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data"), "PYTHONUNBUFFERED": "1"}
    for key in ("SIDECAR_STORE", "SIDECAR_CONFIG", "SIDECAR_PORT", "SIDECAR_HOST", "SIDECAR_TOKEN", "SIDECAR_CALIBRATION"):
        env.pop(key, None)  # the user's store and settings stay out; the model dir is the default one
    before = set(ROOT.iterdir())
    ran, skips, url = [], [], README_URL
    try:
        with contextlib.ExitStack() as servers:
            for cmd in commands(text):
                if why := skipped(cmd):
                    skips.append(f"{cmd}  [skipped: {why}]")
                    continue
                run = argv(cmd)
                assert run is not None, f"{cmd}: not a command the walk knows"
                run = [w.replace(README_URL, url) for w in run]
                t0 = time.monotonic()
                if cmd.words[1:2] == ("serve",):
                    served = servers.enter_context(serve_process(run[run.index("serve") + 1 :], tmp_path, env=env, timeout=COMMAND_TIMEOUT_S))
                    url = served.url.removeprefix("ws://")
                    assert _get(f"http://{url}/healthz")[0] == 200, served.log_text()
                    status, page = _get(f"http://{url}/")
                    assert status == 200 and "<html" in page.lower(), page[:200]
                else:
                    done = subprocess.run(run, capture_output=True, text=True, env=env, cwd=ROOT, timeout=COMMAND_TIMEOUT_S)
                    assert done.returncode == 0, f"{cmd}\nexited {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
                ran.append(f"{cmd}  [{time.monotonic() - t0:.1f} s]")
            assert url != README_URL, "the walk reached no `sidecar serve`"
            for line, code in blocks(text, "python"):
                done = subprocess.run([sys.executable, "-c", code.replace(README_URL, url)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
                assert done.returncode == 0, f"README.md:{line}: the ```python block exited {done.returncode}\n{done.stdout}\n{done.stderr}"
                assert done.stdout.strip(), f"README.md:{line}: the ```python block printed no inject"
                ran.append(f"README.md:{line}: the ```python block")
    finally:
        for made in set(ROOT.iterdir()) - before:  # what the commands wrote into the clone (the tune's --out)
            if made.is_file():
                made.unlink()
    print("\nran:\n  " + "\n  ".join(ran) + "\nskipped:\n  " + "\n  ".join(skips))
    assert len(ran) >= 8, ran


def inline_commands(text: str) -> list[str]:
    """The `sidecar ...` spans of the README's prose (inline code, outside the ```sh blocks)."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.findall(r"`(sidecar [^`]+)`", prose)


def test_the_readmes_learn_traffic_line_runs_as_written(tmp_path):
    """`sidecar learn --traffic`, as the README's prose writes it (no catalog), shows what the
    store learned from a chat log read with `learn --from`: the same turns and tools."""
    [line] = [c for c in inline_commands(README.read_text()) if c.startswith("sidecar learn --traffic")]
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data")}
    for key in ("SIDECAR_STORE", "SIDECAR_CONFIG", "SIDECAR_CALIBRATION"):
        env.pop(key, None)

    def sidecar(words: list[str]) -> str:
        run = argv(Command(0, tuple(words)))
        done = subprocess.run([*run, "-q"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=COMMAND_TIMEOUT_S)
        assert done.returncode == 0, f"{shlex.join(words)}\nexited {done.returncode}\n{done.stdout}\n{done.stderr}"
        return done.stdout

    empty = sidecar(shlex.split(line))
    assert "0 turns followed by a call, 0 by none" in empty, empty
    read = sidecar(["sidecar", "learn", "--from", "fixtures/transcripts/notes/chats.json", "--catalog", "fixtures/catalogs/notes.json", "--json"])
    learned = json.loads(read)["examples"]
    assert learned["called"] > 0 and learned["tools"], learned
    shown = sidecar(shlex.split(line))
    assert f"{learned['called']} turns followed by a call, {learned['silent']} by none" in shown, shown
    listed = {tool: int(n) for n, tool in re.findall(r"^\s+(\d+)\s+(\S+)$", shown, flags=re.M)}
    assert listed == learned["tools"], shown
    assert "--catalog" in shown, "it says how to see what a refit would do"

