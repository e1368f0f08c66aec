"""What the MCP tests share: the real servers they run and the bounded waits they use.

`mcp-server-time` (PyPI, the test extra), `@modelcontextprotocol/server-filesystem` (npm,
installed here into the pytest cache) and the small SDK servers in tests/mcp_servers/.
Import the fixtures (`fs_server`, `fs_root`) into a test module to use them.
"""

from __future__ import annotations

import asyncio
import pathlib
import shutil
import socket
import subprocess
import sys

import pytest

FS_PACKAGE = "@modelcontextprotocol/server-filesystem@2026.8.31"
TIME = {"command": sys.executable, "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"]}
MISSING = "/nonexistent/sidecar-test-no-such-command"  # a server command that does not exist


def run(coro, timeout: float = 120):
    """Run one async test body, bounded."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(predicate, timeout: float = 20, what: str = "condition"):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def listening(port: int, proc: subprocess.Popen, log: pathlib.Path, timeout: float = 30) -> None:
    """Wait until `proc` accepts connections on 127.0.0.1:`port` (fails if it exits)."""

    async def poll() -> None:
        while True:
            try:
                _, w = await asyncio.open_connection("127.0.0.1", port)
                w.close()
                return
            except OSError:
                assert proc.poll() is None, log.read_text()
                await asyncio.sleep(0.05)

    await asyncio.wait_for(poll(), timeout)


@pytest.fixture(scope="session")
def fs_server(request) -> pathlib.Path:
    """The npm filesystem server, installed once into the pytest cache (never skipped)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        pytest.fail(f"node and npm are needed to install {FS_PACKAGE} for this test (found node={node}, npm={npm})")
    root = pathlib.Path(request.config.cache.mkdir("npm-" + FS_PACKAGE.replace("/", "_").replace("@", "")))
    entry = root / "node_modules" / "@modelcontextprotocol" / "server-filesystem" / "dist" / "index.js"
    if not entry.exists():
        cmd = [npm, "install", "--prefix", str(root), "--no-audit", "--no-fund", "--no-save", FS_PACKAGE]
        try:
            done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`{' '.join(cmd)}` did not finish in 600 s")
        if done.returncode != 0 or not entry.exists():
            pytest.fail(f"could not install {FS_PACKAGE} with `{' '.join(cmd)}` (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return entry


@pytest.fixture
def fs_root(tmp_path) -> pathlib.Path:
    root = tmp_path / "files"
    root.mkdir()
    (root / "notes.txt").write_text("kubernetes setup: three nodes\n")
    return root


def fs_spec(entry: pathlib.Path, root: pathlib.Path) -> dict:
    return {"command": "node", "args": [str(entry), str(root)]}
