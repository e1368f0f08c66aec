"""serve answers before a large catalog is embedded: a real SidecarServer on 127.0.0.1 over two
real servers' catalogs (40 tools, more than a start embeds before serving) and a fresh SQLite
store is ready on none of them, says so in /healthz, indexes them in the background, and then
ranks them; a second start on the same store is whole at once."""

from __future__ import annotations

import asyncio
import logging
import threading

from sidecar import config as config_mod
from sidecar.client import SidecarClient
from sidecar.core.pipeline import COLD_AT_ONCE, Request
from sidecar.serve.server import SidecarServer
from sidecar.store import open_store
from tests.conftest import CATALOGS
from tests.test_server import SMALL, WAIT_S, http_get

SERVERS = [CATALOGS / "filesystem.json", CATALOGS / "github.json"]


def _server(tmp_path) -> SidecarServer:
    cfg = config_mod.load(env={}, overrides={("model", "name"): SMALL, ("catalogs",): [str(c) for c in SERVERS], ("server", "port"): 0})
    return SidecarServer(cfg, store=open_store(tmp_path / "c.db"))


def test_a_large_cold_catalog_is_served_at_once_and_completed_in_the_background(tmp_path):
    async def body():
        server = _server(tmp_path)
        release = threading.Event()
        server._indexer.submit(release.wait)  # hold the index thread: the completion cannot embed yet
        await server.start()
        try:
            await asyncio.wait_for(server.loaded.wait(), WAIT_S)
            assert server.load_error is None
            pipe = server.engine.pipeline
            whole = len(pipe.whole)
            assert whole == 40 > COLD_AT_ONCE and len(pipe.catalog) == 0
            status, _, text = await http_get(server.port, "/healthz")
            assert (status, text) == (200, f"ok, indexed 0 of {whole} tools\n")
            async with await SidecarClient.connect(server.url, session="early") as sc:
                assert sc.ready.tools == []  # answering, on what is indexed
            release.set()
            await asyncio.wait_for(asyncio.to_thread(server.completion.done.wait), 300)
            assert len(server.engine.pipeline.catalog) == whole
            status, _, text = await http_get(server.port, "/healthz")
            assert (status, text) == (200, "ok\n")
            [ranked] = server.engine.pipeline.rank_batch([Request("open a pull request for my feature branch")], k=1)
            assert ranked[0].tool == "github__create_pull_request"
        finally:
            release.set()
            await server.shutdown()

    asyncio.run(body())

    async def again():
        server = _server(tmp_path)
        await server.start()
        try:
            await asyncio.wait_for(server.loaded.wait(), WAIT_S)
            pipe = server.engine.pipeline
            assert len(pipe.catalog) == len(pipe.whole) == 40 and not pipe.pending  # the store holds them all
        finally:
            await server.shutdown()

    asyncio.run(again())


def test_a_shutdown_while_the_catalog_is_completed_stops_it_without_an_error(tmp_path, caplog):
    """Ctrl-C during a cold start's background indexing cancels the step under way: the log
    says where it stopped, not "ERROR ... Traceback" as if something had gone wrong."""

    async def body():
        server = _server(tmp_path)
        release = threading.Event()
        server._indexer.submit(release.wait)  # the completion waits on the index thread
        await server.start()
        try:
            await asyncio.wait_for(server.loaded.wait(), WAIT_S)
            assert server.engine.pipeline.pending
        finally:
            await server.shutdown()
            release.set()
        return server.completion

    with caplog.at_level(logging.INFO, logger="sidecar"):
        completion = asyncio.run(body())
        assert completion.done.wait(60)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert any(r.getMessage() == "completion stopped at shutdown: 0 of 40 tools indexed" for r in caplog.records)
