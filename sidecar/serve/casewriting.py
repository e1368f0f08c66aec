"""Written cases added while serving. With `[cases] fill`, `serve` and `proxy` are ready on the
catalog's descriptions, then add the cases the packs and the store already hold (a reindex:
seconds when their vectors are in the store, a dozen embeddings a tool the first time); with
`[cases] writer` set too, they then ask it for the tools nothing covers, batch by batch.

Serving never waits for either: each step lands through the caller's `reindex` (which embeds
beside the judging and swaps the index on the model thread, as a live catalog's change does).
Written tools are kept in the store by tool content (a restart asks for nothing again); a tool
whose reply is refused keeps its description alone and is asked again on the next start.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
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
    """One thread that adds the cases on hand, then writes the engine's uncovered tools' cases
    (with a writer), batch by batch."""

    def __init__(self, engine: Sidecar, chat: writer_mod.Chat | None, reindex: Callable[[], Awaitable[None]],
                 loop: asyncio.AbstractEventLoop, batch: int = BATCH):  # fmt: skip
        self.engine, self.chat, self.reindex, self.loop, self.batch = engine, chat, reindex, loop, batch
        self.written = self.failed = 0
        self.filled = False  # the cases on hand are in the index
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
            book = pipe.casebook = book_for(pipe.store, self.engine.cfg.cases.packs)
            covered = lambda t: book.get(t) is not None  # noqa: E731
            if any(covered(t) for t in writer_mod.lacking(pipe.catalog, lambda t: False, MIN_OWN_CASES)):
                t0 = time.perf_counter()
                asyncio.run_coroutine_threadsafe(self.reindex(), self.loop).result()
                self.filled = True
                log.info("cases: written cases added to the catalog (%.1f s)", time.perf_counter() - t0)
            if self.chat is None:
                return
            todo = writer_mod.lacking(self.engine.catalog, covered, MIN_OWN_CASES)
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
    """With `[cases] fill`, add the cases on hand and write the rest (if a writer is
    configured), through a reindex that embeds the new cases beside the judging, on `indexer`
    (None: the loop's default pool), and swaps the index on `worker`, the model thread. A writer that
    cannot be opened is logged; serving goes on without it."""
    if not cfg.cases.fill:
        chat_for(cfg, upstream)  # warns that a writer set beside fill = false writes nothing
        return None
    try:
        chat = chat_for(cfg, upstream)
    except writer_mod.WriterError as e:
        log.error("cases: no writer: %s", e)
        chat = None
    loop = asyncio.get_running_loop()

    async def reindex() -> None:
        pipe = engine.pipeline
        catalog = pipe.catalog
        # embedded first into the store, on the model's second context (indexer None: a thread
        # of the loop's default pool): the swap below on the model thread embeds nothing
        await loop.run_in_executor(indexer, pipe.with_catalog, catalog, True, True)
        await loop.run_in_executor(worker, pipe.reindex, catalog)

    return CaseWriting(engine, chat, reindex, loop).start()
