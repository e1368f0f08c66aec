"""What `serve` and `proxy` add to their catalog after they are ready, in the background.

They answer as soon as the model is loaded: a first start on a large catalog embeds for a
minute or more, and written cases a dozen texts a tool. So the engine starts on what the store
already holds, and one thread completes it, each step landing through the caller's `reindex`
(embedded beside the judging on the model's second context, then swapped in on the model
thread, as a live catalog's change is):

1. the tools no vector was stored for, in batches that double (16, 32, 64 ... tools: the first
   lands in seconds), logged as "indexed N of M tools";
2. with `[cases] fill`, the written cases the packs and the store hold ("written cases added");
3. with `[cases] writer` too, cases written for the tools nothing covers, batch by batch, kept
   in the store by tool content (a restart asks for nothing again); a tool whose reply is
   refused keeps its description alone and is asked again on the next start.
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
from ..core.catalog import Catalog
from ..core.index import MIN_OWN_CASES
from ..engine import Sidecar
from ..learn import writer as writer_mod

log = logging.getLogger("sidecar.cases")
log.setLevel(logging.INFO)  # what completes the catalog is news to the operator: serve and proxy log WARNING and up otherwise

BATCH = 16  # tools written between two reindexes
FIRST_TOOLS = 16  # tools embedded in the first step of a completion; each next step doubles it


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


class Completion:
    """One thread that indexes the engine's pending tools, adds the cases on hand, then (with a
    writer) writes the uncovered tools' cases, batch by batch."""

    def __init__(self, engine: Sidecar, chat: writer_mod.Chat | None, reindex: Callable[[Catalog, bool], Awaitable[None]],
                 loop: asyncio.AbstractEventLoop, *, cases: bool, batch: int = BATCH):  # fmt: skip
        self.engine, self.chat, self.reindex, self.loop, self.cases, self.batch = engine, chat, reindex, loop, cases, batch
        self.written = self.failed = 0
        self.filled = False  # the cases on hand are in the index
        self.done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sidecar-completion", daemon=True)

    def start(self) -> Completion:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()

    def _swap(self, catalog: Catalog, partial: bool) -> None:
        asyncio.run_coroutine_threadsafe(self.reindex(catalog, partial), self.loop).result()

    def _run(self) -> None:
        try:
            self._index_pending()
            if self.cases and not self._stop.is_set():
                self._add_cases()
            if self.chat is not None and not self._stop.is_set():
                self._write()
        except Exception:
            if self._stop.is_set():  # a shutdown cancelled the step under way: nothing went wrong
                log.info("completion stopped at shutdown: %d of %d tools indexed", len(self.engine.pipeline.catalog),
                         len(self.engine.pipeline.whole))  # fmt: skip
            else:
                log.exception("completion stopped: the catalog is served as indexed so far")
        finally:
            self.done.set()

    def _index_pending(self) -> None:
        pipe = self.engine.pipeline
        total, step, t0 = len(pipe.whole), FIRST_TOOLS, time.perf_counter()
        if pipe.pending:
            log.info("indexing %d of %d tools in the background; answering on the %d stored meanwhile", len(pipe.pending), total,
                     len(pipe.catalog))  # fmt: skip
        while (pending := pipe.pending) and not self._stop.is_set():
            adding = {t.name for t in pending[:step]}
            whole = pipe.whole
            self._swap(Catalog([t for t in whole if t.name in adding or pipe.catalog.get(t.name) is not None], whole.sources),
                       len(adding) < len(pending))  # fmt: skip
            log.info("indexed %d of %d tools (%.1f s)", len(pipe.catalog), total, time.perf_counter() - t0)
            step *= 2

    def _add_cases(self) -> None:
        pipe = self.engine.pipeline
        book = pipe.casebook = book_for(pipe.store, self.engine.cfg.cases.packs)
        if any(book.get(t) is not None for t in writer_mod.lacking(pipe.whole, lambda t: False, MIN_OWN_CASES)):
            t0 = time.perf_counter()
            self._swap(pipe.whole, False)
            self.filled = True
            log.info("cases: written cases added to the catalog (%.1f s)", time.perf_counter() - t0)

    def _write(self) -> None:
        pipe = self.engine.pipeline
        book = pipe.casebook
        todo = writer_mod.lacking(pipe.whole, lambda t: book is not None and book.get(t) is not None, MIN_OWN_CASES)
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
            self._swap(pipe.whole, False)
            log.info("cases: %d of %d tools written (%.1f s a tool), reindexed", self.written, len(todo),
                     report.seconds / max(1, len(report.written) + len(report.failed)))  # fmt: skip


def health(engine: Sidecar) -> str:
    """/healthz's body once ready: "ok", and while a completion indexes, how much is in."""
    pipe = engine.pipeline
    if len(pipe.catalog) < len(pipe.whole):
        return f"ok, indexed {len(pipe.catalog)} of {len(pipe.whole)} tools\n"
    return "ok\n"


def start_completion(engine: Sidecar, cfg: Config, worker: Executor, indexer: Executor | None, *,
                     upstream: str | None = None) -> Completion | None:  # fmt: skip
    """Complete the engine's catalog in the background (module docstring), through a reindex
    that embeds beside the judging, on `indexer` (None: the loop's default pool), and swaps
    on `worker`, the model thread. None when there is nothing to do. A writer that cannot be
    opened is logged; serving goes on without it."""
    chat = None
    if cfg.cases.writer is not None:
        try:
            chat = chat_for(cfg, upstream)
        except writer_mod.WriterError as e:
            log.error("cases: no writer: %s", e)
    if not engine.pipeline.pending and not cfg.cases.fill:
        return None
    loop = asyncio.get_running_loop()

    async def reindex(catalog: Catalog, partial: bool) -> None:
        pipe = engine.pipeline
        # embedded first into the store, on the model's second context: the swap below on the
        # model thread embeds nothing
        await loop.run_in_executor(indexer, lambda: pipe.with_catalog(catalog, True, True, partial))
        await loop.run_in_executor(worker, lambda: pipe.reindex(catalog, partial=partial))

    return Completion(engine, chat, reindex, loop, cases=cfg.cases.fill).start()
