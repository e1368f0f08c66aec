"""The server's memory stays bounded (issue 13): what a connection, the store and the C
libraries hold reaches a bound and stops there however many actions come. A real
SidecarServer on 127.0.0.1 (MiniLM, real SQLite) and real clients; the figures are read from
/metrics, as an operator would. Nothing here is timed: bench/soak.py measures RSS over time."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np

from sidecar import protocol as p
from sidecar.client import SidecarClient, tokens
from sidecar.config import ServerConfig
from sidecar.store import PAGE_CACHE_KIB, SQLiteStore
from sidecar.serve.telemetry import MMAP_THRESHOLD, native_memory

from .conftest import ROOT
from .test_server import (  # noqa: F401  (pipelines, small: fixtures)
    SEARCH,
    WAIT_S,
    http_get,
    parse_metrics,
    pipelines,
    run,
    serving,
    small,
)

TURNS = 40  # user turns and replies, each on a new stream id: ten times the streams' bound


def test_a_connection_remembers_a_bounded_number_of_streams_however_many_it_opens(small):
    async def body():
        async with serving(small, max_streams=4, closed_streams=4) as srv:
            async with await SidecarClient.connect(srv.url, session="mem") as sc:
                for i in range(TURNS):
                    await sc.user(f"u{i}", SEARCH)
                    for tok in tokens("Thanks, that was helpful. "):
                        await sc.token(f"r{i}", tok)
                    await sc.end(f"r{i}")
                    await sc.end(f"u{i}")
                ended = 0
                while ended < 2 * TURNS:  # every span judged (or dropped and counted) by now
                    msg = await sc.recv(WAIT_S)
                    assert not isinstance(msg, p.Error), msg
                    ended += isinstance(msg, p.Ended)
                _, _, text = await http_get(srv.port, "/metrics")
                m = parse_metrics(text)
                # 80 stream ids were used and all have ended: closed_streams are remembered
                assert 0 < m["sidecar_session_streams"] <= 4, m["sidecar_session_streams"]
                assert m["sidecar_queue_depth"] == 0
                assert not srv._ending  # every `end` answered leaves nothing behind
                native = native_memory()
                if native is not None:  # glibc: malloc's and SQLite's figures are exported
                    assert 0 < m["sidecar_malloc_in_use_bytes"] <= m["sidecar_malloc_heap_bytes"]
                    assert m["sidecar_malloc_arenas"] >= 1
                    assert m["sidecar_sqlite_memory_bytes"] > 0  # the store is open in this process

    run(body())


def test_the_store_keeps_one_page_cache_whichever_threads_read_it(tmp_path):
    """Store reads come from several threads (the model thread, the store threads of
    tool_result / feedback); they share one connection, so SQLite's page cache is one
    PAGE_CACHE_KIB cache however many threads read, and however large the file grows."""
    if native_memory() is None:  # SQLite's counter is read through glibc's dlopen
        return
    before = native_memory().sqlite
    store = SQLiteStore(tmp_path / "s.db")
    try:
        assert store.query("PRAGMA cache_size")[0][0] == -PAGE_CACHE_KIB
        rng = np.random.default_rng(13)
        keys = [f"{i:064x}" for i in range(4000)]  # 4000 vectors of 384 floats: ~6 MB of pages, 3x the cache
        store.put_vectors("m", {k: rng.standard_normal(384).astype(np.float32) for k in keys})
        errors: list[BaseException] = []

        def read(offset: int) -> None:
            try:
                for _ in range(2):
                    got = store.vectors("m", keys[offset:] + keys[:offset])
                    assert len(got) == len(keys)
            except BaseException as e:  # noqa: BLE001 (reported by the test)
                errors.append(e)

        threads = [threading.Thread(target=read, args=(i * 1000,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        grown = native_memory().sqlite - before
        # one cache, plus 1 MiB for schema, statements and lookaside (measured: 2.0 MiB in all at
        # the default); a connection per thread would add a cache each, ~2 MiB
        assert grown <= PAGE_CACHE_KIB * 1024 + (1 << 20), grown
    finally:
        store.close()


def test_big_buffers_stay_mapped_after_a_bigger_one_was_freed():
    """`sidecar serve` pins glibc's mmap threshold: without it, freeing a 16 MiB block raises
    the threshold to 16 MiB and the next 4 MiB buffers are carved from the heap, whose freed
    space stays resident (the soak's malloc free bytes grew in steps). In a fresh process:
    one with freed heap space serves a buffer from it, whatever the threshold."""
    if native_memory() is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    probe = (
        "import numpy as np\n"
        "from sidecar.serve.telemetry import MMAP_THRESHOLD, native_memory, pin_mmap_threshold\n"
        "assert pin_mmap_threshold()\n"
        "big = np.ones(8 * MMAP_THRESHOLD, np.uint8); del big\n"
        "before = native_memory().mapped\n"
        "buf = np.ones(2 * MMAP_THRESHOLD, np.uint8)\n"
        "print(native_memory().mapped - before)\n"
    )
    assert int(in_fresh_process(probe)) >= 2 * MMAP_THRESHOLD  # mapped on its own, not carved from the heap


def test_a_frames_buffers_are_reused_not_mapped_anew():
    """Under the threshold, the buffers of a frame up to max_frame_bytes come from the heap and
    go back to it: pinned at 128 KiB, each was a fresh mapping whose pages faulted when first
    written, and decoding a 1 MB token frame took 2.4 ms of the event loop instead of 0.9 ms
    (issue 33). In a fresh process: a freed frame-sized buffer's space serves the next one."""
    if native_memory() is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    assert ServerConfig().max_frame_bytes < MMAP_THRESHOLD
    probe = (
        "import numpy as np\n"
        "from sidecar.config import ServerConfig\n"
        "from sidecar.serve.telemetry import native_memory, pin_mmap_threshold\n"
        "assert pin_mmap_threshold()\n"
        "size = ServerConfig().max_frame_bytes\n"
        "first = np.ones(size, np.uint8); del first\n"
        "before = native_memory()\n"
        "again = np.ones(size, np.uint8)\n"
        "after = native_memory()\n"
        "print(after.mapped - before.mapped, after.heap - before.heap)\n"
    )
    assert in_fresh_process(probe).split() == ["0", "0"]  # neither a new mapping nor a grown heap: the freed space again


def in_fresh_process(code: str) -> str:
    """What `code` prints, run in a new interpreter (malloc's settings are process-wide)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout
