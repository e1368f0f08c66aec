"""Learning from traffic (issue 30): every user turn the server judges is followed either by
the tools the LLM called (`tool_result` frames) or by none. Those are free labels, in the
user's own words, over the user's own catalog: what the built-in calibration, fitted on this
project's corpus, never saw.

Three parts, each small:

* `Turns` (sans-I/O, one per connection, or per conversation of a chat log): pairs each user
  turn with the tools called before the next one. A turn followed by no call is a "no tool" example only
  once the connection has reported at least one call: a client that never sends `tool_result`
  says nothing about what needed a tool.
* `TrafficLog`: the examples in the store (text, tool or none, the turn's query vector),
  bounded in all and per session, so no one client can steer what is learned.
* `Learned` and `TrafficFit`: what a catalog learned, as an overlay the pipeline applies (the
  called turns as extra cases of their tools, both kinds as the gate head's neighbours, and a
  bar of its own), and the estimator that fits it and swaps it in only when it judges the
  examples better out of fold than what is in force.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import msgspec
import numpy as np

from ..core.gate import Request, Thresholds
from ..core.stream import Segmenter
from .learned import RankerFit, fit_logistic, held_views, logit

if TYPE_CHECKING:
    from ..core.pipeline import Pipeline
    from ..transcripts import Conversation
    from ..store import Store


# --- the examples --------------------------------------------------------------------------


class Example(msgspec.Struct, frozen=True):
    """A user turn and the tool called after it (None: no tool was called before the next turn),
    or (`source` "llm") a span of the model's reply that committed to an action and the tool the
    reply then called."""

    text: str
    tool: str | None
    vector: np.ndarray | None = None  # the turn's query vector, when the engine embedded it
    session: str = ""
    source: str = "user"


@dataclass
class Turn:
    """A user turn and the distinct tools called after it, in the order first called."""

    text: str
    vector: np.ndarray | None = None
    calls: list[str] = field(default_factory=list)
    ref: str = ""  # where it came from (a transcript's conversation:message)

    def examples(self, session: str = "") -> list[Example]:
        """One example per tool called, or one "no tool" example."""
        return [Example(self.text, tool, self.vector, session) for tool in self.calls or [None]]


class Turns:
    """User turns and the calls after each, in the order they come (sans-I/O): `turn` opens a
    turn and returns the one it resolves, `called` adds a tool to the open turn, `close`
    resolves it. The one pairing rule of a live connection and of a chat log.

    `silent_needs_call`: a turn followed by no call is returned only once some call was
    reported (a live client that never sends `tool_result` says nothing about what needed a
    tool; a chat log holds every call). `max_calls`: distinct tools one turn can name."""

    def __init__(self, silent_needs_call: bool = True, max_calls: int = 8):
        self.silent_needs_call = silent_needs_call
        self.max_calls = max_calls
        self.reports_calls = False
        self._open: Turn | None = None

    def turn(self, text: str, vector: np.ndarray | None = None, ref: str = "") -> Turn | None:
        done = self.close()
        self._open = Turn(text, vector, ref=ref) if text.strip() else None
        return done

    def embedded(self, text: str, vector: np.ndarray | None) -> None:
        """The open turn's query vector, once the engine has judged it."""
        if self._open is not None and self._open.text == text and vector is not None:
            self._open.vector = vector

    def called(self, tool: str) -> None:
        self.reports_calls = True
        t = self._open
        if t is not None and tool not in t.calls and len(t.calls) < self.max_calls:
            t.calls.append(tool)

    def close(self) -> Turn | None:
        t, self._open = self._open, None
        if t is None or (not t.calls and self.silent_needs_call and not self.reports_calls):
            return None
        return t


def turns_of(examples: Sequence[Example]) -> list[list[int]]:
    """The examples of each turn (same session, same text), in the order first seen."""
    turns: dict[tuple[str, str], list[int]] = {}
    for i, e in enumerate(examples):
        turns.setdefault((e.session, e.text), []).append(i)
    return list(turns.values())


LOG_SESSION = "log:"  # the session of a chat log's conversation: "log:" + its id (a live one is a connection id)


def log_examples(pipeline: Pipeline, conversations: Sequence[Conversation], span_words: int = 12,
                 max_chars: int = 512) -> tuple[list[Turn], list[Example]]:  # fmt: skip
    """Chat logs' user turns, embedded, and their examples, one session per conversation; then
    the spans of replies that commit and are followed by a call (`reply_spans`), as the
    replies' examples. `span_words`, `max_chars`: the stream rules the server cuts spans by."""
    turns = transcript_turns(conversations)
    replies = reply_spans(pipeline, conversations, span_words, max_chars)
    vectors = pipeline.queries.embed(pipeline.embedder, [t.text for t in turns] + [text for text, _, _ in replies]).vectors
    for t, v in zip(turns, vectors):
        t.vector = v
    examples = [e for t in turns for e in t.examples(LOG_SESSION + t.ref.rsplit(":", 1)[0])]
    examples += [Example(text, tool, v, LOG_SESSION + conv, "llm") for (text, tool, conv), v in zip(replies, vectors[len(turns):])]
    return turns, examples


def reply_spans(pipeline: Pipeline, conversations: Sequence[Conversation], span_words: int = 12,
                max_chars: int = 512) -> list[tuple[str, str, str]]:  # fmt: skip
    """(span, tool, conversation id) for each span of a reply that commits to an action (on a
    high pattern's path, as a reply fires) when the reply, or the calls right after it before
    any other text, called a tool: the first one called. What such a span means in this agent's
    words ("let me retrieve that" for its user lookup) is what a catalog's descriptions lack."""
    out: list[tuple[str, str, str]] = []
    for conv in conversations:
        msgs = conv.messages
        for k, m in enumerate(msgs):
            if m.role != "assistant" or not (m.content or "").strip():
                continue
            calls = [c.name for c in m.tool_calls or ()]
            j = k + 1
            while not calls and j < len(msgs) and msgs[j].role in ("assistant", "tool") and not (msgs[j].content or "").strip():
                calls = [c.name for c in msgs[j].tool_calls or ()]
                j += 1
            if not calls:
                continue
            seg = Segmenter(span_words, max_chars)
            for span in seg.feed(m.content) + seg.end():
                if pipeline.route(Request(span.text, "llm")).path.startswith("high"):
                    out.append((span.text, calls[0], conv.id))
    return out


def transcript_turns(conversations: Sequence[Conversation]) -> list[Turn]:
    """Chat logs' user turns, each with the tools the model called before the next user turn."""
    out: list[Turn] = []
    for conv in conversations:
        turns = Turns(silent_needs_call=False, max_calls=1_000)
        for k, m in enumerate(conv.messages):
            if m.role == "user":
                out += filter(None, [turns.turn(m.content, ref=f"{conv.id}:{k}")])
            elif m.role == "assistant":
                for c in m.tool_calls or ():
                    turns.called(c.name)
        out += filter(None, [turns.close()])
    return out


SCHEMA = """
CREATE TABLE IF NOT EXISTS traffic_examples (
    id       INTEGER PRIMARY KEY AUTOINCREMENT,
    ts       REAL NOT NULL,
    model    TEXT NOT NULL,      -- the identity of the model the vector came from
    session  TEXT NOT NULL,      -- the server's connection id (never a client-chosen name)
    text     TEXT NOT NULL,
    tool     TEXT,               -- NULL: no tool was called after the turn
    vector   BLOB NOT NULL,      -- float16, unit length
    source   TEXT NOT NULL DEFAULT 'user'  -- 'llm': a span of a reply, and the tool the reply called
);
CREATE INDEX IF NOT EXISTS traffic_examples_session ON traffic_examples (session, id);
"""


class TrafficLog:
    """The examples, in the store, bounded: at most `limit` in all (the oldest go first) and at
    most `share` of them from one session, so one client's turns cannot outweigh the rest."""

    def __init__(self, store: Store, model: str, limit: int = 5000, share: float = 0.1, max_text_chars: int = 2000):
        self.store, self.model = store, model
        self.limit, self.per_session = limit, max(1, int(limit * share))
        self.max_text_chars = max_text_chars
        store.ensure_schema(SCHEMA)
        if "source" not in store.columns("traffic_examples"):  # a store from before replies were learned from
            store.ensure_schema("ALTER TABLE traffic_examples ADD COLUMN source TEXT NOT NULL DEFAULT 'user'")

    def add(self, examples: Sequence[Example], now: float | None = None) -> int:
        """Keep the examples that have a vector; returns how many were kept."""
        ts = time.time() if now is None else now
        rows = [(ts, self.model, e.session, e.text[: self.max_text_chars], e.tool, np.asarray(e.vector, np.float16).tobytes(), e.source)
                for e in examples if e.vector is not None]  # fmt: skip
        if not rows:
            return 0
        sessions = sorted({r[2] for r in rows})

        def write(tx) -> None:
            tx.executemany("INSERT INTO traffic_examples (ts, model, session, text, tool, vector, source) VALUES (?,?,?,?,?,?,?)", rows)
            for s in sessions:
                tx.execute("""DELETE FROM traffic_examples WHERE session = ? AND id NOT IN
                              (SELECT id FROM traffic_examples WHERE session = ? ORDER BY id DESC LIMIT ?)""", (s, s, self.per_session))  # fmt: skip
            tx.execute("DELETE FROM traffic_examples WHERE id NOT IN (SELECT id FROM traffic_examples ORDER BY id DESC LIMIT ?)", (self.limit,))

        self.store.write(write)
        return len(rows)

    def count(self) -> int:
        return int(self.store.query("SELECT COUNT(*) FROM traffic_examples WHERE model = ?", (self.model,))[0][0])

    def examples(self) -> list[Example]:
        """This model's examples, oldest first."""
        rows = self.store.query("SELECT text, tool, vector, session, source FROM traffic_examples WHERE model = ? ORDER BY id", (self.model,))
        return [Example(t, tool, np.frombuffer(v, np.float16).astype(np.float32), s, src) for t, tool, v, s, src in rows]

    def turn_calls(self) -> tuple[list[list[str]], set[str]]:
        """Each recorded user turn's tools in the order called (a turn is one example per tool,
        in a row), live and chat logs' alike, and the sessions they came from: what the tools
        that go together are learned from."""
        rows = self.store.query("SELECT session, text, tool FROM traffic_examples WHERE model = ? AND tool IS NOT NULL AND source = 'user' ORDER BY id",
                                (self.model,))  # fmt: skip
        turns: list[list[str]] = []
        last = None
        for session, text, tool in rows:
            if (session, text) != last:
                turns.append([])
                last = (session, text)
            turns[-1].append(tool)
        return turns, {session for session, _, _ in rows}

    def summary(self) -> dict[str, object]:
        rows = self.store.query("SELECT tool, COUNT(*), COUNT(DISTINCT session) FROM traffic_examples WHERE model = ? AND source = 'user' GROUP BY tool",
                                (self.model,))  # fmt: skip
        called = {t: n for t, n, _ in rows if t is not None}
        silent = next((n for t, n, _ in rows if t is None), 0)
        sessions = self.store.query("SELECT COUNT(DISTINCT session) FROM traffic_examples WHERE model = ?", (self.model,))[0][0]
        replies = self.store.query("SELECT COUNT(*) FROM traffic_examples WHERE model = ? AND source = 'llm'", (self.model,))[0][0]
        return {"called": sum(called.values()), "silent": silent, "sessions": sessions, "replies": int(replies),
                "tools": dict(sorted(called.items(), key=lambda kv: -kv[1]))}  # fmt: skip

    def reset(self) -> int:
        """Forget every example (of every model); returns how many there were."""
        return int(self.store.write(lambda tx: tx.execute("DELETE FROM traffic_examples").rowcount))


# --- what is learned -----------------------------------------------------------------------


class TrafficGate(msgspec.Struct, frozen=True):
    """The gate's probability recalibrated on the user's own turns: sigmoid of a linear map of
    its logit and of the text's nearest called and nearest silent turn (cosines, 0 with none).
    Whatever gave the probability (the gate head, or a catalog's own gate from its cases), the
    turns say how far to trust it here."""

    coef: tuple[float, float, float]
    bias: float

    def probability(self, p: np.ndarray, near_called: np.ndarray, near_silent: np.ndarray) -> np.ndarray:
        x = np.stack([logit(p), near_called, near_silent], axis=1)
        return 1.0 / (1.0 + np.exp(-(x @ np.asarray(self.coef) + self.bias)))

    @classmethod
    def fit(cls, p: np.ndarray, near_called: np.ndarray, near_silent: np.ndarray, called: np.ndarray) -> TrafficGate:
        x = np.stack([logit(p), near_called, near_silent], axis=1)
        mu, sd = x.mean(axis=0), x.std(axis=0) + 1e-9
        w, b = fit_logistic((x - mu) / sd, called.astype(float), np.full(3, 1.0))
        coef = w / sd
        return cls(tuple(round(float(c), 6) for c in coef), round(float(b - (w * mu / sd).sum()), 6))  # type: ignore[arg-type]


class Learned:
    """A catalog's lesson from its traffic, applied by the pipeline on top of its calibration:
    `called` (the turns followed by a call, as extra cases of the tool called: the cases view
    takes the nearer of the tool's own cases and these), both kinds as neighbours of the gate
    head (its near-tool / near-none features read the user's own turns beside the built-in
    exemplars), and `bar`, the probability bar fitted on them (None: the calibration's).
    `replies` / `reply_tools`: the reply spans that committed and the tool the reply then
    called, as extra cases for the model's replies (`cases(..., source="llm")`)."""

    def __init__(self, called: np.ndarray, tools: Sequence[str], silent: np.ndarray, bar: float | None = None,
                 weights: np.ndarray | None = None, gate: TrafficGate | None = None, source: str = "",
                 replies: np.ndarray | None = None, reply_tools: Sequence[str] = ()):  # fmt: skip
        self.called = np.asarray(called, np.float32)
        self.tools = list(tools)
        self.replies = np.asarray(replies if replies is not None else np.zeros((0, self.called.shape[-1])), np.float32)
        self.reply_tools = list(reply_tools)
        self.silent = np.asarray(silent, np.float32)
        self.bar = bar
        self.weights = None if weights is None else np.asarray(weights, np.float32)  # over RANK_FEATURES + the turns' view
        self.gate = gate  # the gate's probability recalibrated on the turns (None: as the calibration gives it)
        self.source = source  # what it was learned from, for `sidecar learn`

    @classmethod
    def of(cls, examples: Sequence[Example], names: Sequence[str], bar: float | None = None, weights: np.ndarray | None = None,
           gate: TrafficGate | None = None, source: str = "") -> Learned:  # fmt: skip
        """From examples: calls of tools the catalog no longer has are left out (the turn still
        asked for a tool: it is not a "no tool" either)."""
        known = set(names)
        called = [e for e in examples if e.tool is not None and e.tool in known and e.source == "user"]
        silent = [e for e in examples if e.tool is None and e.source == "user"]
        replies = [e for e in examples if e.tool is not None and e.tool in known and e.source == "llm"]
        dim = len(examples[0].vector) if examples else 0
        stack = lambda es: np.vstack([e.vector for e in es]) if es else np.zeros((0, dim), np.float32)  # noqa: E731
        return cls(stack(called), [e.tool for e in called], stack(silent), bar, weights, gate, source, stack(replies), [e.tool for e in replies])

    def __len__(self) -> int:
        return len(self.called) + len(self.silent)

    def cases(self, vectors: np.ndarray, names: Sequence[str], exclude_self: bool = False, source: str = "user") -> np.ndarray:
        """(n, tools): each tool's best cosine over the turns that called it (-1: none did), or
        for `source` "llm" over the reply spans that did. `exclude_self`: a text that is one of
        them does not count itself."""
        rows, tools = (self.replies, self.reply_tools) if source == "llm" else (self.called, self.tools)
        out = np.full((len(vectors), len(names)), -1.0, np.float32)
        if not len(rows):
            return out
        column = {n: j for j, n in enumerate(names)}
        cols = np.array([column.get(t, -1) for t in tools])
        keep = cols >= 0
        sims = vectors @ rows[keep].T
        if exclude_self:
            sims = np.where(sims > 0.9995, -1.0, sims)
        np.maximum.at(out.T, cols[keep], sims.T)  # out[:, col] = max over that tool's turns
        return out

    def near(self, vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each text's cosine to its nearest called turn and to its nearest silent turn (0: none)."""

        def best(rows: np.ndarray) -> np.ndarray:
            return np.maximum((vectors @ rows.T).max(axis=1), 0.0) if len(rows) else np.zeros(len(vectors))

        return best(self.called), best(self.silent)

    def thresholds(self, base: Thresholds) -> Thresholds:
        """`base` with this bar for texts on no pattern's path (a high pattern's bar is kept)."""
        if self.bar is None:
            return base
        return msgspec.structs.replace(base, fallback=self.bar, confirm=min(base.confirm, self.bar), auto=max(base.auto, self.bar))


class Outcome(msgspec.Struct):
    """One fit: the lesson's out-of-fold scores beside the calibration's alone, on the same examples."""

    examples: int
    called: int
    silent: int
    calibration: Rates  # the calibration's alone, on the examples
    learned: Rates  # the lesson's, out of fold
    bar: float | None
    swapped: bool
    seconds: float
    reason: str = ""
    recalibrated: bool = False  # the lesson recalibrates the gate's probability on the turns (TrafficGate)


class TrafficFit(msgspec.Struct, frozen=True):
    """Hyper-parameters of learning from traffic, in one place. `min_called` / `min_silent`:
    examples of each kind before a bar is fitted (fewer: the calibration's bar is kept, since
    a bar fitted on a handful of turns is noise); `margin`: how much more recall out of fold,
    at no less precision, a lesson must reach than the calibration alone to be used."""

    folds: int = 5
    min_examples: int = 20
    min_called: int = 10
    min_silent: int = 10
    margin: float = 0.005
    objective: Literal["recall", "f1"] = "recall"  # what the bar is chosen for (`[learn] objective`)
    max_rank_rows: int = 1000  # called turns the ranker's weights are fitted on (the latest; each is (tools, views) of floats)
    seed: int = 0

    def fit(self, pipeline: Pipeline, examples: Sequence[Example], source: str = "traffic") -> tuple[Learned | None, Outcome]:
        """The lesson of `examples` for `pipeline`'s catalog, or None when it would not judge
        them better than the calibration alone: the lesson is scored out of fold (each fold
        judged by a lesson fitted on the other folds), the calibration on all of them. A lesson
        in force is replaced by the next one that passes: it learned from more."""
        t0 = time.perf_counter()
        names = pipeline.catalog.names()
        base_bar = bar_without_lesson(pipeline)
        known = set(names)
        usable = [e for e in examples if e.source == "user" and e.vector is not None and (e.tool is None or e.tool in known)]
        replies = [e for e in examples if e.source == "llm" and e.vector is not None and e.tool in known]
        called = sum(e.tool is not None for e in usable)
        silent = len(usable) - called
        if len(usable) < self.min_examples or not called:
            why = f"{len(usable)} usable examples ({called} called): at least {self.min_examples}, some called, needed"
            nothing = Rates(math.nan, math.nan)
            return None, Outcome(len(usable), called, silent, nothing, nothing, None, False, round(time.perf_counter() - t0, 3), why)
        # One judged row per turn: a turn that called several tools is one example per tool,
        # right when its first tool is any of them, and never split between folds (its text
        # in training as a case of one tool would judge itself as another's).
        members = turns_of(usable)
        vectors = np.vstack([usable[ix[0]].vector for ix in members]).astype(np.float32)
        truth = [frozenset(usable[i].tool for i in ix if usable[i].tool is not None) for ix in members]
        texts = [usable[ix[0]].text for ix in members]
        folds = np.random.default_rng(self.seed).permutation(len(members)) % self.folds
        fold_of = np.empty(len(usable), np.int64)
        for f, ix in zip(folds, members):
            fold_of[ix] = f
        p_oof = np.zeros(len(members))
        near = np.zeros((len(members), 2))
        first_oof: list[str | None] = [None] * len(members)
        for f in range(self.folds):
            test = np.flatnonzero(folds == f)
            train = np.flatnonzero(folds != f)
            seen = Learned.of([usable[i] for i in np.flatnonzero(fold_of != f)], names)
            seen.weights = self._weights(pipeline, [texts[i] for i in train], vectors[train], [truth[i] for i in train], seen, names)
            p, first = judge_vectors(pipeline, [texts[i] for i in test], vectors[test], seen)
            p_oof[test] = p
            near[test] = np.stack(seen.near(vectors[test]), axis=1)
            for i, t in zip(test, first):
                first_oof[i] = t
        now = rates(*judge_vectors(pipeline, texts, vectors, None), truth, base_bar)
        bar = gate = None
        if called >= self.min_called and silent >= self.min_silent:
            bar, gate, p_oof = self._gate(p_oof, near, first_oof, truth, folds, now.precision)
        learned = rates(p_oof, first_oof, truth, bar if bar is not None else base_bar)
        better = learned.recall >= now.recall + self.margin and learned.precision >= now.precision
        lesson = None
        if better:
            lesson = Learned.of(usable + replies, names, bar, gate=gate, source=source)
            lesson.weights = self._weights(pipeline, texts, vectors, truth, lesson, names)
        outcome = Outcome(len(usable), called, silent, now, learned, bar, better, round(time.perf_counter() - t0, 3),
                          "" if better else "no more recall at the same precision out of fold than the calibration alone",
                          gate is not None)  # fmt: skip
        return lesson, outcome

    def _gate(self, p: np.ndarray, near: np.ndarray, first: Sequence[str | None], truth: Sequence[Called], folds: np.ndarray,
              precision: float) -> tuple[float | None, TrafficGate | None, np.ndarray]:  # fmt: skip
        """The lesson's bar, on the probability as it is or recalibrated on the turns (`TrafficGate`,
        judged out of fold too), whichever then has more recall at `precision`: (bar, gate or
        None, the out-of-fold probabilities the bar is on)."""
        y = np.array([bool(_accepted(t)) for t in truth])
        recal = np.zeros(len(p))
        for f in range(self.folds):
            test = folds == f
            recal[test] = TrafficGate.fit(p[~test], *near[~test].T, y[~test]).probability(p[test], *near[test].T)
        plain, tuned = (best_bar(q, first, truth, precision, objective=self.objective) for q in (p, recal))
        score = lambda q, b: -1.0 if b is None else rates(q, first, truth, b).score(self.objective)  # noqa: E731
        if score(recal, tuned) > score(p, plain):
            return tuned, TrafficGate.fit(p, *near.T, y), recal
        return plain, None, p

    def _weights(self, pipeline: Pipeline, texts: Sequence[str], vectors: np.ndarray, truth: Sequence[Called], seen: Learned,
                 names: Sequence[str]) -> np.ndarray | None:  # fmt: skip
        """The lesson's ranker: view weights (the calibration's views and the called turns')
        fitted on the called turns, each without itself among the turns; None with too few."""

        column = {n: j for j, n in enumerate(names)}
        rows = [i for i, t in enumerate(truth) if _accepted(t) & column.keys()][-self.max_rank_rows :]
        if len(rows) < self.min_called:
            return None
        views = with_lesson(pipeline, seen).views([Request(texts[i], "user") for i in rows], vectors[rows], exclude_self=True)
        features = np.stack([v.features for v in views])
        own = pipeline.own_for("user")  # the action views keep the weights of the ranker in force
        held = held_views(own.ranker if own else pipeline.ranker, features.shape[-1])
        w = RankerFit().weights(features, [sorted(column[t] for t in _accepted(truth[i]) if t in column) for i in rows], fixed=held)
        return np.asarray(w, np.float32)


def judge_vectors(pipeline: Pipeline, texts: Sequence[str], vectors: np.ndarray, learned: Learned | None) -> tuple[np.ndarray, list[str | None]]:
    """User turns' probabilities and best tools, judged by `pipeline` with `learned` applied."""

    return with_lesson(pipeline, learned).probabilities([Request(t, "user") for t in texts], vectors)


def bar_without_lesson(pipeline: Pipeline) -> float:
    """The bar of user turns with no lesson applied."""
    return pipeline.thresholds_without_lesson[0].fallback


def with_lesson(pipeline: Pipeline, learned: Learned | None) -> Pipeline:
    """A shallow copy of `pipeline` with `learned` applied: a fit judges on it from its own
    thread, and the pipeline in service is never touched."""
    work = copy.copy(pipeline)
    work.learned = learned
    return work


class Rates(msgspec.Struct):
    """Of the called turns, the share whose tool would be injected first (`recall`); of the turns
    that would fire, the share whose first tool is the one called (`precision`: a silent turn
    that fires is a miss; 0 when none fires)."""

    recall: float
    precision: float

    def score(self, objective: str) -> float:
        """What a bar is chosen for (`TrafficFit.objective`): recall, or its F1 with precision."""
        if objective == "recall":
            return self.recall
        return 2 * self.recall * self.precision / (self.recall + self.precision) if self.recall + self.precision else 0.0


Called = str | frozenset[str] | None  # what a turn called: a tool, any of several, or none


def _accepted(t: Called) -> frozenset[str]:
    return frozenset() if t is None else frozenset((t,)) if isinstance(t, str) else t


def rates(p: np.ndarray, first: Sequence[str | None], truth: Sequence[Called], bar: float) -> Rates:
    fired = p >= bar
    right = np.array([f is not None and f in _accepted(t) for f, t in zip(first, truth)]) & fired
    called = sum(bool(_accepted(t)) for t in truth)
    return Rates(round(float(right.sum() / max(called, 1)), 4), round(float(right.sum() / fired.sum()), 4) if fired.any() else 0.0)


def best_bar(p: np.ndarray, first: Sequence[str | None], truth: Sequence[Called], precision: float, z: float = 1.0,
             objective: str = "recall") -> float | None:  # fmt: skip
    """The bar with the best `objective` (`Rates.score`: recall, or F1) whose precision stays at
    `precision` or above with some confidence: its precision less `z` standard errors (of equal
    scores, the higher bar).
    None when no bar does. The standard error keeps a bar fitted on a few hundred turns from
    trading precision it only seemed to keep; on thousands it all but vanishes."""
    best: tuple[float, float] | None = None
    for c in np.unique(np.round(p, 4)):
        r = rates(p, first, truth, float(c))
        fired = int((p >= c).sum())
        low = r.precision - z * math.sqrt(max(r.precision * (1 - r.precision), 1e-9) / max(fired, 1))
        if low >= precision and (best is None or r.score(objective) >= best[0]):
            best = (r.score(objective), float(c))
    return None if best is None else best[1]
