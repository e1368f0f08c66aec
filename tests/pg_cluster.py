"""A throwaway PostgreSQL server for the tests and bench/store_write.py: initdb in a fresh
temp dir, listening on 127.0.0.1 on a free port (its unix socket in that dir, not /run),
stopped and deleted by `stop()`.

PostgreSQL refuses to run as root, so when we are root the server runs as the `postgres`
user (Debian's package creates it) through `runuser`. Missing binaries are an error naming
the package to install, never a skip.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pathlib
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid

INSTALL_HINT = "PostgreSQL server binaries not found (initdb, pg_ctl): install them with `apt-get install postgresql`"
START_TIMEOUT_S = 60


def bin_dir() -> pathlib.Path:
    """The newest /usr/lib/postgresql/N/bin with initdb, else the directory of initdb on PATH."""
    found = [pathlib.Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/initdb")]
    if found:
        return max(found, key=lambda d: int(d.parent.name) if d.parent.name.isdigit() else 0)
    if on_path := shutil.which("initdb"):
        return pathlib.Path(on_path).parent
    raise RuntimeError(INSTALL_HINT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """One running server. `url(db)` is a postgresql:// URL for a database on it;
    `new_database()` makes an empty one."""

    def __init__(self) -> None:
        self.bin = bin_dir()
        self.root = pathlib.Path(tempfile.mkdtemp(prefix="sidecar-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.user = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
        self.running = False
        try:
            if os.geteuid() == 0:
                try:
                    pw = pwd.getpwnam("postgres")
                except KeyError:
                    raise RuntimeError(f"running as root and there is no `postgres` user to run the server as: {INSTALL_HINT}") from None
                os.chown(self.root, pw.pw_uid, pw.pw_gid)
            self._run("initdb", "-D", str(self.data), "-U", self.user, "--auth=trust", "--encoding=UTF8", "--locale=C.UTF-8")
            opts = f"-c listen_addresses=127.0.0.1 -c port={self.port} -c unix_socket_directories={self.root} -c max_connections=60"
            self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-o", opts, "-w", "-t", str(START_TIMEOUT_S), "start")
            self.running = True
        except BaseException:
            self.stop()
            raise

    def _run(self, tool: str, *args: str) -> None:
        cmd = [str(self.bin / tool), *args]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=START_TIMEOUT_S + 30, check=False)
        if done.returncode != 0:
            log = self.root / "server.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}\n{tail}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """An empty database; returns its URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        if self.running:
            with contextlib.suppress(Exception):
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
            self.running = False
        shutil.rmtree(self.root, ignore_errors=True)
