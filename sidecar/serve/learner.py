"""The server's side of learning from traffic (sidecar/learn/traffic.py holds the rules): resolved
turns go to the store, and every `refit_every` new examples the catalog's lesson is refitted
(numpy only: the model thread keeps judging) and swapped into the engine's pipeline when it
passes (`TrafficFit`), or every tenth of the log when that is more (a refit costs in
proportion to the log); every `refit_every` recorded calls, the tools that go together are
learned again from the call log (`SequenceFit`).

Learning must never starve serving, so it is bounded three ways:
- one thread of its own does all of it (writes and refits), so it holds at most one core and
  one malloc arena, never the default executor's threads;
- examples wait for that thread in one list of at most `max_examples` (what the log keeps
  anyway), written in one transaction a batch; past it the oldest waiting are dropped and
  counted, where one thread hop per turn queued without bound;
- a refit that took T seconds is followed by none for T * (1 / refit_share - 1): a refit holds
  the GIL for much of its time, and every other thread (the event loop, the model thread
  between llama.cpp calls) waits for it at each switch, so under load back-to-back refits cost
  every decision; paced, they cost at most `refit_share` of the time. What arrives meanwhile
  counts towards the next refit, which runs when its time comes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ..config import LearnConfig
from ..recommend.sequences import SequenceFit
from ..learn.traffic import Example, Learned, Outcome, TrafficFit, TrafficLog, Turn

if TYPE_CHECKING:
    from ..engine import Sidecar
    from .telemetry import Metrics

log = logging.getLogger("sidecar.server")


def learn(engine: Sidecar, tlog: TrafficLog, fit: TrafficFit | None = None, sequences: SequenceFit = SequenceFit()) -> tuple[Learned | None, Outcome]:
    """What `engine` learns from what it saw: the tools that go together, from each recorded
    turn's calls (and the call log of connections that report no turns), set on the engine at
    once, and the catalog's lesson from the turns (returned with how it judged; the caller swaps
    it in)."""
    learn_sequences(engine, tlog, sequences)
    fit = fit or fit_of(engine.cfg.learn)
    return fit.fit(engine.pipeline, tlog.examples(), source=f"traffic: {engine.store.location}")


def learn_sequences(engine: Sidecar, tlog: TrafficLog, sequences: SequenceFit = SequenceFit()) -> None:
    """The tools that go together, set on `engine`: they need no catalog's definitions, only
    the names each recorded turn called (and the call log's, of `engine`'s catalog)."""
    turns, seen = tlog.turn_calls()
    calls = engine.history.call_sequences(engine.catalog, skip=seen) if engine.history is not None else []
    engine.sequences.update(sequences.fit(turns + calls, "turns" if turns else "sessions"))


def fit_of(cfg: LearnConfig) -> TrafficFit:
    """The lesson's estimator with what the config sets of it."""
    return TrafficFit(objective=cfg.objective)


def traffic_log(engine: Sidecar, cfg: LearnConfig | None = None) -> TrafficLog:
    """The store's traffic examples for `engine`'s model, bounded as `cfg` says (default: the engine's `[learn]`)."""
    lc = cfg or engine.cfg.learn
    return TrafficLog(engine.store, engine.pipeline.embedder.identity, lc.max_examples, lc.session_share)


def apply_learned(engine: Sidecar) -> Outcome | None:
    """What `serve` does when it starts, for an engine used in-process (`replay`): learn from
    what its store recorded (turns, chat logs read by `learn --from`, the call log) and apply
    it. None when `[learn] traffic` is off or there is no store."""
    if not engine.cfg.learn.traffic or engine.store is None:
        return None
    lesson, outcome = learn(engine, traffic_log(engine))
    engine.pipeline.learned = lesson
    return outcome


class Learner:
    def __init__(self, engine: Sidecar, cfg: LearnConfig, metrics: Metrics | None = None, fit: TrafficFit | None = None,
                 sequences: SequenceFit = SequenceFit()):  # fmt: skip
        assert engine.store is not None
        self.engine = engine
        self.log = traffic_log(engine, cfg)
        self.fit = fit or fit_of(cfg)
        self.sequences = sequences
        self.every = cfg.refit_every
        self.share = cfg.refit_share
        self.most_waiting = cfg.max_examples
        self.metrics = metrics
        self.fresh = 0  # examples stored since the last refit began
        self.calls = 0  # tool_result frames recorded since then
        self.dropped = 0  # examples dropped while waiting to be written (the thread was behind)
        self.last: Outcome | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="sidecar-learn")
        self._waiting: list[Example] = []
        self._writing: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._refitting: asyncio.Task | None = None
        self._due: asyncio.Task | None = None  # a paced refit waiting for its time
        self._not_before = 0.0  # monotonic time before which no paced refit starts

    def add(self, turns: Sequence[Turn], session: str) -> None:
        """Record resolved turns (those with a vector: what the engine judged) in the background."""
        examples = [e for t in turns for e in t.examples(session) if e.vector is not None]
        if not examples:
            return
        self._waiting.extend(examples)
        over = len(self._waiting) - self.most_waiting
        if over > 0:
            del self._waiting[:over]
            self.dropped += over
            if self.metrics is not None:
                self.metrics.traffic_dropped.inc(over)
        if self._writing is None or self._writing.done():
            self._writing = self._spawn(self._write())

    async def _write(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting, []
            try:
                n, kept = await self._on_thread(lambda: (self.log.add(batch), self.log.count()))
            except Exception:
                log.exception("recording %d traffic examples failed", len(batch))
                continue
            if self.metrics is not None:
                for e in batch:
                    self.metrics.traffic.labels("called" if e.tool is not None else "silent").inc()
            self.fresh += n
            if self.fresh >= max(self.every, kept // 10):  # a refit reads them all: a bigger log refits less often
                self.request()

    def called(self) -> None:
        """A tool_result was recorded: the call log the sequences come from grew."""
        self.calls += 1
        if self.calls >= self.every:
            self.request()

    def request(self) -> None:
        """A refit is due: now, or when the pace allows (one waits at a time)."""
        if (self._refitting is not None and not self._refitting.done()) or (self._due is not None and not self._due.done()):
            return
        wait = self._not_before - time.monotonic()
        if wait <= 0:
            self.refit()
        else:
            self._due = self._spawn(self._refit_later(wait))

    async def _refit_later(self, wait: float) -> None:
        await asyncio.sleep(wait)
        self.refit()

    def refit(self) -> asyncio.Task | None:
        """Start a refit now unless one is running (None then): at start, and when one is due."""
        if self._refitting is not None and not self._refitting.done():
            return None
        self.fresh = self.calls = 0
        self._refitting = self._spawn(self._refit())
        return self._refitting

    async def _refit(self) -> Outcome | None:
        t0 = time.monotonic()
        try:
            lesson, outcome = await self._on_thread(self._fit)
        except Exception:
            log.exception("refitting from traffic failed")
            return None
        finally:
            took = time.monotonic() - t0
            self._not_before = time.monotonic() + took * (1 / self.share - 1)
        self.last = outcome
        # One attribute: the model thread sees the old lesson or the new. A refit that finds no
        # lesson worth using (the log was reset, or more turns undo what fewer taught) drops it.
        self.engine.pipeline.learned = lesson
        if self.metrics is not None:
            self.metrics.refits.labels("swapped" if lesson is not None else "kept").inc()
        log.info("refit from %d traffic examples in %.1f s: %s", outcome.examples, took, "in use" if lesson is not None else outcome.reason)
        return outcome

    def _fit(self):
        return learn(self.engine, self.log, self.fit, self.sequences)

    def _on_thread(self, fn):
        return asyncio.get_running_loop().run_in_executor(self._thread, fn)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain(self, due: bool = True) -> None:
        """Wait for what is being recorded or refitted (shutdown, tests); a refit waiting for
        its pace runs now (`due`), or is dropped (at shutdown: the next start refits anyway)."""
        while self._tasks:
            if self._due is not None and not self._due.done():
                self._due.cancel()
                self._due = None
                if due:
                    self.refit()
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def close(self) -> None:
        """Let the learning thread go once it is idle (after `drain`)."""
        self._thread.shutdown(wait=False, cancel_futures=True)
