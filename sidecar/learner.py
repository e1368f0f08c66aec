"""The server's side of learning from traffic (sidecar/traffic.py holds the rules): resolved
turns go to the store on a store thread, and every `refit_every` new examples the catalog's
lesson is refitted on a worker thread (numpy only: the model thread keeps judging) and swapped
into the engine's pipeline when it passes (`TrafficFit`), or every tenth of the log when that
is more (a refit costs in proportion to the log); every `refit_every` recorded calls,
the tools that go together are learned again from the call log (`SequenceFit`). One refit at
a time; what arrives during one counts towards the next."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .config import LearnConfig
from .recommend.sequences import SequenceFit
from .traffic import Learned, Outcome, TrafficFit, TrafficLog, Turn

if TYPE_CHECKING:
    from .engine import Sidecar
    from .telemetry import Metrics

log = logging.getLogger("sidecar.server")


def learn(engine: Sidecar, tlog: TrafficLog, fit: TrafficFit = TrafficFit(), sequences: SequenceFit = SequenceFit()) -> tuple[Learned | None, Outcome]:
    """What `engine` learns from what it saw: the tools that go together, from each recorded
    turn's calls (and the call log of connections that report no turns), set on the engine at
    once, and the catalog's lesson from the turns (returned with how it judged; the caller swaps
    it in)."""
    learn_sequences(engine, tlog, sequences)
    return fit.fit(engine.pipeline, tlog.examples(), source=f"traffic: {engine.store.location}")


def learn_sequences(engine: Sidecar, tlog: TrafficLog, sequences: SequenceFit = SequenceFit()) -> None:
    """The tools that go together, set on `engine`: they need no catalog's definitions, only
    the names each recorded turn called (and the call log's, of `engine`'s catalog)."""
    turns, seen = tlog.turn_calls()
    calls = engine.history.call_sequences(engine.catalog, skip=seen) if engine.history is not None else []
    engine.sequences.update(sequences.fit(turns + calls, "turns" if turns else "sessions"))


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
    def __init__(self, engine: Sidecar, cfg: LearnConfig, metrics: Metrics | None = None, fit: TrafficFit = TrafficFit(),
                 sequences: SequenceFit = SequenceFit()):  # fmt: skip
        assert engine.store is not None
        self.engine = engine
        self.log = traffic_log(engine, cfg)
        self.fit = fit
        self.sequences = sequences
        self.every = cfg.refit_every
        self.metrics = metrics
        self.fresh = 0  # examples stored since the last refit began
        self.calls = 0  # tool_result frames recorded since then
        self.last: Outcome | None = None
        self._tasks: set[asyncio.Task] = set()
        self._refitting: asyncio.Task | None = None

    def add(self, turns: Sequence[Turn], session: str) -> None:
        """Record resolved turns (those with a vector: what the engine judged) in the background."""
        examples = [e for t in turns for e in t.examples(session) if e.vector is not None]
        if examples:
            self._spawn(self._add(examples))

    async def _add(self, examples) -> None:
        try:
            n, kept = await asyncio.to_thread(lambda: (self.log.add(examples), self.log.count()))
        except Exception:
            log.exception("recording %d traffic examples failed", len(examples))
            return
        if self.metrics is not None:
            for e in examples:
                self.metrics.traffic.labels("called" if e.tool is not None else "silent").inc()
        self.fresh += n
        if self.fresh >= max(self.every, kept // 10):  # a refit reads them all: a bigger log refits less often
            self.refit()

    def called(self) -> None:
        """A tool_result was recorded: the call log the sequences come from grew."""
        self.calls += 1
        if self.calls >= self.every:
            self.refit()

    def refit(self) -> asyncio.Task | None:
        """Start a refit unless one is running (None then)."""
        if self._refitting is not None and not self._refitting.done():
            return None
        self.fresh = self.calls = 0
        self._refitting = self._spawn(self._refit())
        return self._refitting

    async def _refit(self) -> Outcome | None:
        try:
            lesson, outcome = await asyncio.to_thread(self._fit)
        except Exception:
            log.exception("refitting from traffic failed")
            return None
        self.last = outcome
        # One attribute: the model thread sees the old lesson or the new. A refit that finds no
        # lesson worth using (the log was reset, or more turns undo what fewer taught) drops it.
        self.engine.pipeline.learned = lesson
        if self.metrics is not None:
            self.metrics.refits.labels("swapped" if lesson is not None else "kept").inc()
        log.info("refit from %d traffic examples: %s", outcome.examples, "in use" if lesson is not None else outcome.reason)
        return outcome

    def _fit(self):
        return learn(self.engine, self.log, self.fit, self.sequences)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain(self) -> None:
        """Wait for what is being recorded or refitted (shutdown, tests)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
