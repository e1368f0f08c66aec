"""Cases written while serving: with `[cases] writer` set, `serve` and `proxy` ask it for the
tools no pack and no earlier writing covers, after the engine is ready, and reindex with them.

Serving never waits for the writer: an LLM takes seconds a tool, so the catalog is served on its
descriptions from the start, and each batch of written tools lands in the store (kept by tool
content: a restart asks for nothing again) and then in the index, through the caller's
`reindex` (which embeds beside the judging and swaps the index on the model thread, as a live
catalog's change does). A tool whose reply is refused keeps its description alone and is asked
again on the next start.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor

from ..config import Config
from ..core.casebook import book_for, keep
from ..core.index import MIN_OWN_CASES
from ..engine import Sidecar
from ..learn import writer as writer_mod

log = logging.getLogger("sidecar.cases")
log.setLevel(logging.INFO)  # what the writer does is news to the operator: serve and proxy log WARNING and up otherwise

BATCH = 16  # tools written between two reindexes


def chat_for(cfg: Config, upstream: str | None = None) -> writer_mod.Chat | None:
    """The configured writer; a bare "openai" names the proxy's upstream, with the key from
    `[cases] key_env` read now, at start (never a client's key). None without a writer, or
    with `[cases] fill = false` (nothing would use what it wrote)."""
    spec = cfg.cases.writer
    if spec is None:
        return None
    if not cfg.cases.fill:
        log.warning("cases: [cases] writer is set but fill = false: nothing is written")
        return None
    if spec in ("openai", "openai:") and upstream:
        spec = f"openai:{upstream}"
    return writer_mod.open_chat(spec, cfg.cases.writer_model, cfg.cases.key_env, cfg.cases.timeout_s)


class CaseWriting:
    """One thread that writes cases for the engine's uncovered tools, batch by batch."""

    def __init__(self, engine: Sidecar, chat: writer_mod.Chat, reindex: Callable[[], Awaitable[None]],
                 loop: asyncio.AbstractEventLoop, batch: int = BATCH):  # fmt: skip
        self.engine, self.chat, self.reindex, self.loop, self.batch = engine, chat, reindex, loop, batch
        self.written = self.failed = 0
        self.done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sidecar-cases", daemon=True)

    def start(self) -> CaseWriting:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        try:
            pipe = self.engine.pipeline
            book = pipe.casebook
            todo = writer_mod.lacking(self.engine.catalog, lambda t: book is not None and book.get(t) is not None, MIN_OWN_CASES)
            if todo:
                log.info("cases: %s writes for %d tools without cases; served on their descriptions meanwhile", self.chat.spec, len(todo))
            for lo in range(0, len(todo), self.batch):
                if self._stop.is_set():
                    return
                report = writer_mod.write_cases(todo[lo : lo + self.batch], self.chat)
                for tool, error in report.failed:
                    log.warning("cases: %s", error)
                self.failed += len(report.failed)
                if not report.written or pipe.store is None:
                    continue
                keep(pipe.store, report.written)
                self.written += len(report.written)
                pipe.casebook = book_for(pipe.store, self.engine.cfg.cases.packs)
                asyncio.run_coroutine_threadsafe(self.reindex(), self.loop).result()
                log.info("cases: %d of %d tools written (%.1f s a tool), reindexed", self.written, len(todo),
                         report.seconds / max(1, len(report.written) + len(report.failed)))  # fmt: skip
        except Exception:
            log.exception("cases: writing stopped; the tools not written keep their descriptions")
        finally:
            self.done.set()


def start_case_writing(engine: Sidecar, cfg: Config, worker: Executor, indexer: Executor | None, *,
                       upstream: str | None = None) -> CaseWriting | None:  # fmt: skip
    """Start writing, if a writer is configured, with a reindex that embeds the new cases on
    `indexer` (beside the judging; None: on `worker` too) and swaps the index on `worker`, the
    model thread. A writer that cannot be opened is logged; serving goes on without it."""
    try:
        chat = chat_for(cfg, upstream)
    except writer_mod.WriterError as e:
        log.error("cases: no writer: %s", e)
        return None
    if chat is None:
        return None
    loop = asyncio.get_running_loop()

    async def reindex() -> None:
        pipe = engine.pipeline
        catalog = pipe.catalog
        if indexer is not None:  # embedded first into the store: the swap below embeds nothing
            await loop.run_in_executor(indexer, pipe.with_catalog, catalog, True, True)
        await loop.run_in_executor(worker, pipe.reindex, catalog)

    return CaseWriting(engine, chat, reindex, loop).start()
