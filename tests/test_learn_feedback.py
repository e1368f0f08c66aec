"""Learning from real feedback, end to end: a client streams over a real websocket, rates one
of the tools it was injected; the store keeps the ranking that tool was offered in and the span
that caused it; `sidecar learn` replays those rows into weights."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys

from sidecar import config as config_mod
from sidecar.core import models
from sidecar import protocol as p
from sidecar.client import SidecarClient
from sidecar.engine import Sidecar
from sidecar.serve.server import SidecarServer

from .conftest import CATALOGS, ROOT

CATALOG = CATALOGS / "filesystem.json"
TURNS = [
    "write these notes into a new file named todo.txt",
    "open the settings file and show me what is in it",
    "make a new folder called archive in my documents",
    "move the old report into the backup directory",
    "list everything in the downloads folder",
]
BOUND_S = 300


def test_feedback_on_injected_tools_is_recorded_with_their_ranking_and_learn_fits_on_it(tmp_path):
    db = tmp_path / "s.db"
    cfg = config_mod.load(env={}, overrides={("model", "name"): models.SMALL_MODEL, ("catalogs",): [str(CATALOG)], ("store",): str(db),
                                             ("server", "port"): 0, ("server", "inject_margin"): 1.0})  # fmt: skip  (every ranked tool is injected)

    async def body() -> list[tuple[list[str], str, str]]:
        server = SidecarServer(cfg, engine=Sidecar.open(cfg, progress=False))
        await server.start()
        rated = []
        try:
            async with await SidecarClient.connect(server.url, session="learner") as sc:
                for i, text in enumerate(TURNS):
                    await sc.user(f"u{i}", text)
                    await sc.end(f"u{i}")
                    injects = []
                    while not isinstance(m := await sc.recv(60), p.Ended):
                        if isinstance(m, p.Inject):
                            injects.append(m)
                    if not injects or len(injects[0].tools) < 2:
                        continue
                    offered = [t.definition["name"] for t in injects[0].tools]
                    await sc.feedback(offered[1], selected=True, rating=5.0, ref=i)  # the user preferred the runner-up
                    ack = await sc.recv(60)
                    assert isinstance(ack, p.Ack) and ack.ref == i, ack
                    rated.append((offered, offered[1], text))
        finally:
            await server.shutdown()
        return rated

    rated = asyncio.run(asyncio.wait_for(body(), BOUND_S))
    assert len(rated) >= 3, rated
    con = sqlite3.connect(db)
    rows = con.execute("SELECT query, recommended, selected FROM feedback ORDER BY id").fetchall()
    con.close()
    assert [(q, json.loads(r), s) for q, r, s in rows] == [(text, offered, sel) for offered, sel, text in rated]

    out = subprocess.run([sys.executable, "-m", "sidecar", "learn", "--json", "--model", models.SMALL_MODEL, "--catalog", str(CATALOG),
                          "--store", str(db), "--heldout-fraction", "0"], capture_output=True, text=True, timeout=BOUND_S, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["samples"] == doc["feedback"] == len(rated)
    result = doc["result"]
    assert result["train"] == len(rated) and result["train_mrr_after"] >= result["train_mrr_before"]
    assert result["train_mrr_before"] < 1.0  # the runner-up was chosen: the configured weights did not rank it first

    empty = subprocess.run([sys.executable, "-m", "sidecar", "learn", "--model", models.SMALL_MODEL, "--catalog", str(CATALOG),
                            "--store", str(tmp_path / "empty.db")], capture_output=True, text=True, timeout=BOUND_S, cwd=ROOT)  # fmt: skip
    assert empty.returncode == 2 and "no feedback" in empty.stderr and "Traceback" not in empty.stderr
