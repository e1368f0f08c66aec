"""The sans-I/O parts of streaming: the segmenter, the pending queue, per-connection sessions."""

from __future__ import annotations

import random

import msgspec
import pytest

from sidecar.core import catalog as catalog_mod
from sidecar.core import stream
from sidecar.config import ServerConfig
from sidecar.engine import Judgement
from sidecar.core.gate import Candidate, Decision, Timing, Trigger
from sidecar.serve.pending import Pending
from sidecar.protocol import Hello, ProtocolError
from sidecar.recommend.filters import Context
from sidecar.recommend.recommender import Factors, Recommendation, Recommendations
from sidecar.serve.session import Scope, Session, Verdict, context_of, inject_for, session_catalog
from sidecar.core.stream import Segmenter

from .conftest import CATALOGS

REPLY = "Let me search my notes for the kubernetes setup. Then I will summarise it: briefly!\nDone"


def run(seg: Segmenter, deltas) -> list:
    out = []
    for d in deltas:
        out += seg.feed(d)
    return out + seg.end()


def test_clause_boundaries_split_a_reply_and_offsets_index_the_stream():
    spans = run(Segmenter(), REPLY)  # one character at a time
    assert [s.text for s in spans] == [
        "Let me search my notes for the kubernetes setup",
        "Then I will summarise it",
        "briefly",
        "Done",
    ]
    assert [s.reason for s in spans] == ["boundary", "boundary", "boundary", "end"]
    for s in spans:
        assert REPLY[s.start:s.end] == s.text


def test_delta_size_does_not_change_the_spans():
    whole = run(Segmenter(), [REPLY])
    rng = random.Random(7)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(REPLY)), 12))
        deltas = [REPLY[a:b] for a, b in zip([0, *cuts], [*cuts, len(REPLY)])]
        assert run(Segmenter(), deltas) == whole


def test_a_boundary_waits_for_whitespace_so_numbers_and_urls_stay_whole():
    seg = Segmenter()
    assert seg.feed("Version 3.14 lives at http://example.org/a.b today") == []
    assert seg.feed(".") == []  # not yet: "." then whitespace ends a clause
    [span] = seg.feed(" ")
    assert span.text == "Version 3.14 lives at http://example.org/a.b today"


def test_newline_is_a_boundary_at_once():
    seg = Segmenter()
    [span] = seg.feed("first line of text\n")
    assert span.text == "first line of text" and span.reason == "boundary"


def test_a_clause_without_boundary_is_judged_every_n_words_as_it_grows():
    seg = Segmenter(span_words=4)
    spans = run(seg, "one two three four five six seven eight nine")
    assert [s.text for s in spans] == ["one two three four", "one two three four five six seven eight", "one two three four five six seven eight nine"]
    assert [s.reason for s in spans] == ["words", "words", "end"]
    assert all(s.start == 0 for s in spans)


def test_memory_is_bounded_and_long_clauses_are_cut():
    seg = Segmenter(span_words=1000, max_chars=64)
    text = " ".join(f"word{i}" for i in range(400))  # no boundary at all
    spans = []
    for ch in text:
        spans += seg.feed(ch)
        assert seg.buffered <= 64
    spans += seg.end()
    assert all(s.reason in ("limit", "end") for s in spans)
    assert all(len(s.text) <= 64 for s in spans)
    assert " ".join(s.text for s in spans) == text  # cut between words, nothing lost
    blob = run(Segmenter(max_chars=32), ["x" * 1000])  # one huge word in one delta
    assert sum(len(s.text) for s in blob) == 1000


def test_trivial_spans_and_repeats_are_not_emitted():
    assert run(Segmenter(), "1. ok. ... !!\n\n") == []
    seg = Segmenter(span_words=3)
    spans = run(seg, "alpha beta gamma.")  # the words span and the boundary span are the same text
    assert [s.text for s in spans] == ["alpha beta gamma"]


def test_end_flushes_a_pending_terminator_and_is_final():
    seg = Segmenter()
    assert seg.feed("Let me read the note.") == []
    [span] = seg.end()
    assert span.text == "Let me read the note" and span.reason == "end"
    assert seg.end() == []
    with pytest.raises(ValueError):
        seg.feed("more")


# Pending ---------------------------------------------------------------------------


class Ev:
    def __init__(self, key, received, name="", owner=None, stream=None, cost=1.0):
        self.key, self.received, self.name = key, received, name
        self.owner, self.stream, self.cost = owner, stream, cost


def test_pending_supersedes_per_stream_and_counts_every_drop():
    q = Pending(max_pending=3, stale_s=1.0)
    a, b = object(), object()
    q.put(Ev(a, 0.0, "a1"))
    q.put(Ev(b, 0.0, "b1"))
    q.put(Ev(a, 0.1, "a2"))  # supersedes a1
    assert q.dropped["superseded"] == 1 and len(q) == 2
    for i in range(3):
        q.put(Ev(object(), 0.2, f"u{i}"))
    assert q.dropped["overflow"] == 2 and len(q) == 3  # b1 and a2, the oldest, went first
    q.put(Ev(object(), -5.0, "old"))  # dropped as overflow (u0 goes) ...
    taken = q.take(now=0.5)
    assert q.dropped["stale"] == 1  # ... and "old" waited too long
    assert [e.name for e in taken] == ["u1", "u2"] and len(q) == 0


def test_overload_sheds_whole_streams_of_the_most_loaded_connection_first():
    """Issue 33 overload policy: past the budget, whole streams go, the most loaded connection's
    biggest first, until the rest fits; a connection with one span waiting keeps it, and each
    shed span is counted."""
    q = Pending(max_pending=1000, stale_s=10.0, weight=lambda ev: ev.cost)
    for s in range(4):  # the flooder: 4 streams of 5 spans
        for k in range(5):
            q.put(Ev(object(), 0.0, f"f{s}-{k}", owner="flood", stream=f"s{s}"))
    q.put(Ev(object(), 0.0, "v", owner="victim", stream="v"))
    for s in range(2):  # a busy one: 2 streams of 3 spans
        for k in range(3):
            q.put(Ev(object(), 0.0, f"b{s}-{k}", owner="busy", stream=f"s{s}"))
    assert q.shed(budget=30.0) == 0  # 27 spans of cost 1 fit
    assert q.shed(budget=12.0) == 15  # flood 20 -> 15 -> 10 -> 5 (busy 6, tied at 10 first)
    assert q.take_shed() == {"flood": 15.0} and q.take_shed() == {}  # what its sender is held for, once
    left = [e.name for e in q.take(0.0)]
    assert q.dropped["shed"] == 15 and len(left) == 12
    assert "v" in left and sum(n.startswith("b") for n in left) == 6
    assert len({n.split("-")[0] for n in left if n.startswith("f")}) == 1  # the flooder kept one whole stream
    for s in range(3):
        q.put(Ev(object(), 0.0, f"x{s}", owner="x", stream=f"s{s}"))
    assert q.shed(budget=0.5) == 2 and len(q) == 1 and q.weight_total == 1.0  # the last span waiting holds no one up
    assert q.shed(budget=0.5) == 0
    q.take(0.0)
    for k in range(10):  # one stream alone over the budget keeps its newest spans
        q.put(Ev(object(), 0.0, f"t{k}", owner="turns", stream="t"))
    assert q.shed(budget=4.0) == 6
    assert [e.name for e in q.take(0.0)] == ["t6", "t7", "t8", "t9"]


def test_overload_sheds_every_reply_span_before_a_user_turn():
    """A 1,000-connection soak shed one probe turn in seven: the probe's one turn outweighed
    the one-clause replies of the connections beside it. Replies go first, heaviest first;
    user turns only once no reply span is left, by the same rule."""
    q = Pending(max_pending=1000, stale_s=10.0, weight=lambda ev: ev.cost)
    for c in range(5):  # five connections, each a clause of a reply waiting
        q.put(Ev(object(), 0.0, f"r{c}", owner=f"c{c}", stream="reply", cost=2.0))
    turn = Ev(object(), 0.0, "turn", owner="probe", stream="p1", cost=6.0)
    turn.source = "user"
    q.put(turn)
    for c in range(2):  # two connections' turns beside a reply of their own
        t = Ev(object(), 0.0, f"t{c}", owner=f"u{c}", stream="t", cost=3.0)
        t.source = "user"
        q.put(t)
        q.put(Ev(object(), 0.0, f"ur{c}", owner=f"u{c}", stream="r", cost=1.0))
    assert q.shed(budget=12.0) == 7  # every reply span (weight 12) goes, not the heavy turn
    assert sorted(e.name for e in q.take(0.0)) == ["t0", "t1", "turn"]
    for name, cost in (("a", 6.0), ("b", 3.0)):
        t = Ev(object(), 0.0, name, owner=name, stream="t", cost=cost)
        t.source = "user"
        q.put(t)
    assert q.shed(budget=4.0) == 1 and [e.name for e in q.take(0.0)] == ["b"]  # turns alone: the heaviest goes
    for name, cost in (("a", 6.0), ("b", 3.0)):
        t = Ev(object(), 0.0, name, owner=name, stream="t", cost=cost)
        t.source = "user"
        q.put(t)
    q.put(Ev(object(), 0.0, "r", owner="r", stream="r", cost=2.0))
    assert q.shed(budget=4.0, turns=9.0) == 1 and sorted(e.name for e in q.take(0.0)) == ["a", "b"]  # the reply goes; the turns (9) fit theirs


def test_user_turns_are_taken_first_one_per_connection():
    """A turn is what its chat app waits on before the model answers: each connection's
    oldest turn goes before any reply's clause, in the connections' round-robin order, one
    each (a connection sending turns as fast as it can gets one a batch before the replies,
    like everyone else); the rest as before, oldest first, within the budget."""
    q = Pending(max_pending=1000, stale_s=10.0)

    def turn(name, owner, received=0.0):
        t = Ev(object(), received, name, owner=owner, stream=f"t-{name}")
        t.source = "user"
        return t

    for k in range(4):
        q.put(Ev(object(), 0.0, f"r{k}", owner="replies", stream="r"))
    q.put(Ev(object(), 0.0, "a-reply", owner="a", stream="r"))
    q.put(turn("a1", "a"))
    q.put(turn("a2", "a"))
    q.put(turn("b1", "b"))
    q.put(turn("stale", "c", received=-20.0))
    assert [e.name for e in q.take(0.0, limit=3)] == ["a1", "b1", "r0"]  # c's turn was stale
    assert q.dropped["stale"] == 1
    assert [e.name for e in q.take(0.0, limit=2)] == ["a2", "r1"]
    assert [e.name for e in q.take(0.0)] == ["a-reply", "r2", "r3"]
    q.put(turn("long", "a"))
    q.put(turn("short", "b"))
    cost = {"long": 3.0, "short": 1.0}
    assert [e.name for e in q.take(0.0, budget=2.0, cost=lambda ev: cost[ev.name])] == ["long"]  # the first always goes
    assert [e.name for e in q.take(0.0, budget=2.0, cost=lambda ev: cost[ev.name])] == ["short"]


def test_staleness_counts_from_when_the_wait_for_the_model_began():
    """A long user turn is embedded beside the model thread before it is queued (2 s and more
    with nomic under load): stale_ms is for waiting on the model, so it counts from `queued`."""
    q = Pending(max_pending=10, stale_s=2.0)
    late = Ev(object(), 0.0, "embedded beside first")
    late.queued = 2.5
    q.put(late)
    q.put(Ev(object(), 0.0, "waited"))
    assert [e.name for e in q.take(3.0)] == ["embedded beside first"] and q.dropped["stale"] == 1


def test_a_lone_span_over_the_budget_is_not_shed():
    """Shedding is for the spans behind: a span alone (a long user turn whose estimate passes
    shed_ms, on an idle model) was dropped unanswered. Beside another, the heavier goes."""
    q = Pending(max_pending=10, stale_s=10.0, weight=lambda ev: ev.cost)
    q.put(Ev(object(), 0.0, "long", owner="a", stream="a", cost=50.0))
    assert q.shed(budget=10.0) == 0 and [e.name for e in q.take(0.0)] == ["long"]
    q.put(Ev(object(), 0.0, "long", owner="a", stream="a", cost=50.0))
    q.put(Ev(object(), 0.0, "short", owner="b", stream="b", cost=1.0))
    assert q.shed(budget=10.0) == 1 and [e.name for e in q.take(0.0)] == ["short"]


def test_one_round_keeps_a_lone_span_from_sharing_its_batch_with_a_flood():
    """Issue 33: a victim's span that waited behind a flooding connection's batch was then
    judged beside a budget's worth more of the flood's spans. In one round, once two
    connections are in the batch, none gets a second span; a lone connection still fills the
    budget, and rounds over many connections take one span of each."""
    q = Pending(max_pending=1000, stale_s=10.0)
    for k in range(20):
        q.put(Ev(object(), 0.0, f"f{k}", owner="flood", stream="s"))
    assert [e.name for e in q.take(0.0, budget=5.0, cost=lambda ev: 1.0, one_round=True)] == ["f0", "f1", "f2", "f3", "f4"]
    q.put(Ev(object(), 0.0, "v", owner="victim", stream="v"))
    taken = [e.name for e in q.take(0.0, budget=5.0, cost=lambda ev: 1.0, one_round=True)]
    assert sorted(taken) == ["f5", "v"]
    q.put(Ev(object(), 0.0, "v2", owner="victim", stream="v"))
    taken = [e.name for e in q.take(0.0, budget=5.0, cost=lambda ev: 1.0)]  # without: the budget's worth
    assert len(taken) == 5 and "v2" in taken
    for c in range(8):
        q.put(Ev(object(), 0.0, f"c{c}", owner=f"c{c}", stream="s"))
    taken = [e.name for e in q.take(0.0, budget=100.0, cost=lambda ev: 1.0, one_round=True)]
    assert len(taken) == 9 and sum(n.startswith("c") for n in taken) == 8


def test_a_short_span_taken_first_is_not_held_behind_a_long_one_past_the_budget():
    """Issue 33: the victim's short turn taken first shared its batch with a neighbour's
    4,000-character turn (100-130 ms of MiniLM against a budget of 40): a span that would
    pass the budget ends the batch, and goes first (alone, if need be) in the next one."""
    q = Pending(max_pending=1000, stale_s=10.0)
    q.put(Ev(object(), 0.0, "v", owner="victim", stream="v", cost=0.012))
    q.put(Ev(object(), 0.0, "long", owner="flood", stream="s", cost=0.12))
    q.put(Ev(object(), 0.0, "v2", owner="victim", stream="w", cost=0.012))
    cost = lambda ev: ev.cost  # noqa: E731
    assert [e.name for e in q.take(0.0, budget=0.04, cost=cost, one_round=True)] == ["v"]
    assert [e.name for e in q.take(0.0, budget=0.04, cost=cost, one_round=True)] == ["long"]  # the first span always goes
    assert [e.name for e in q.take(0.0, budget=0.04, cost=cost, one_round=True)] == ["v2"]


def test_pending_tells_one_flooding_connection_from_load_spread_over_many():
    """What the server's batch size rests on: a queue one connection holds most of keeps the
    batches short for the others; one spread over many gets big, efficient batches."""
    q = Pending(max_pending=1000, stale_s=10.0, weight=lambda ev: ev.cost)
    assert q.heaviest_share() == 0.0
    for k in range(9):
        q.put(Ev(object(), 0.0, f"f{k}", owner="flood", stream="s"))
    q.put(Ev(object(), 0.0, "v", owner="victim", stream="v"))
    assert q.owners() == {"flood", "victim"} and q.heaviest_share() == 0.9
    q.take(0.0)
    assert q.heaviest_share() == 0.0 and q.weight_total == 0
    for c in range(10):
        q.put(Ev(object(), 0.0, f"c{c}", owner=f"c{c}", stream="s"))
    assert q.heaviest_share() == 0.1


# Session -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def notes():
    return catalog_mod.load([CATALOGS / "notes.json"])


def started(limits: ServerConfig, catalog) -> Session:
    """A session after its hello. Its scope has no engine: these tests never judge a span."""
    s = Session(limits)
    hello = Hello(session="s")
    s.start(hello, Scope(catalog, context_of(hello), engine=None))
    return s


def fired(tool: str, score: float, others=()) -> Decision:
    cands = [Candidate(tool, score, "case")] + [Candidate(t, s, "case") for t, s in others]
    return Decision(True, "auto", "high:x", tool, score, "case", 0.35, cands, Timing(), "llm", Trigger("call it", 2, 9))


def test_session_needs_hello_and_enforces_stream_limits(notes):
    s = Session(ServerConfig(max_streams=2))
    with pytest.raises(ProtocolError) as e:
        s.on_token("a", "hi", 0.0)
    assert e.value.code == "no_hello"
    s.start(Hello(session="s"), Scope(notes, Context(), engine=None))
    with pytest.raises(ProtocolError) as e:
        s.start(Hello(session="s"), Scope(notes, Context(), engine=None))
    assert e.value.code == "hello_again"
    s.on_token("a", "x", 0.0)
    s.on_token("b", "y", 0.0)
    with pytest.raises(ProtocolError) as e:
        s.on_token("c", "z", 0.0)
    assert e.value.code == "too_many_streams"
    s.on_end("a", 0.0)
    s.on_token("c", "z", 0.0)  # a slot freed
    with pytest.raises(ProtocolError) as e:
        s.on_token("a", "more", 0.0)
    assert e.value.code == "stream_ended"
    with pytest.raises(ProtocolError) as e:
        s.on_end("nope", 0.0)
    assert e.value.code == "unknown_stream"


def verdict(ev, d: Decision, ranked: Recommendations | None) -> Verdict:
    return Verdict(ev, Judgement(d, ranked))


def ranked(*scored: tuple[str, float]) -> Recommendations:
    factors = Factors(0.5, 0.5, 0.5, 0.5, 0.5, 0.5, None, 1.0, 0)
    return Recommendations("q", [Recommendation(t, s, f"why {t}", factors) for t, s in scored])


def test_a_tool_is_injected_once_per_stream_with_close_runners_up(notes):
    s = started(ServerConfig(inject_margin=0.05), notes)
    [ev] = s.on_user("u1", "  please note this", 0.0)
    assert (ev.start, ev.end, ev.source) == (2, 18, "user")
    d = fired("create_note", 0.70)
    inj = inject_for(verdict(ev, d, ranked(("create_note", 0.70), ("update_note", 0.67), ("read_note", 0.50))), 0.05)
    assert [t.definition["name"] for t in inj.tools] == ["create_note", "update_note"]
    assert [t.why for t in inj.tools] == ["why create_note", "why update_note"]  # the recommender's
    assert inj.tools[0].definition == notes.get("create_note").definition()
    assert inj.tier == d.tier and (inj.trigger.start, inj.trigger.end, inj.trigger.path) == (4, 11, "high:x")
    [ev2] = s.on_user("u1", "again please note this", 0.0)
    assert inject_for(verdict(ev2, d, ranked(("create_note", 0.9))), 0.05) is None  # already injected in u1
    assert inject_for(verdict(ev2, d, None), 0.05) is None  # nothing ranked
    [ev3] = s.on_user("u2", "please note this", 0.0)
    silent = msgspec.structs.replace(d, fired=False)
    assert inject_for(verdict(ev3, silent, ranked(("create_note", 0.9))), 0.05) is None  # the gate decides
    assert inject_for(verdict(ev3, d, ranked(("create_note", 0.9))), 0.05) is not None  # another stream
    [ev4] = s.on_user("u3", "please note this", 0.0)
    assert inject_for(verdict(ev4, d, ranked(("not_in_this_catalog", 0.9), ("read_note", 0.89))), 0.05).tools[0].definition["name"] == "read_note"


def test_a_reply_span_injects_its_best_tool_alone_where_a_user_turn_takes_its_runners_up(notes):
    limits = ServerConfig()
    assert (limits.margin_for("user"), limits.margin_for("llm")) == (limits.inject_margin, limits.reply_margin) == (0.03, 0.0)
    s = started(limits, notes)
    close = ranked(("create_note", 0.70), ("update_note", 0.69), ("read_note", 0.50))
    [turn] = s.on_user("u", "please note this", 0.0)
    [span] = s.on_token("r", "I will note this down now.", 0.0) + s.on_end("r", 0.0)
    assert span.source == "llm"
    names = lambda ev: [t.definition["name"] for t in inject_for(verdict(ev, fired("create_note", 0.70), close), limits.margin_for(ev.source)).tools]  # noqa: E731
    assert names(turn) == ["create_note", "update_note"]
    assert names(span) == ["create_note"]
    with pytest.raises(ValueError, match="reply_margin"):
        ServerConfig(reply_margin=1.5).validate()


def test_hello_becomes_the_recommenders_context():
    hello = Hello(session="s", agent="bot", permissions=["*_note"], project="infra")
    ctx = context_of(hello)
    assert (ctx.agent, ctx.permissions.allow, ctx.project_tags) == ("bot", ["*_note"], ["infra"])
    assert context_of(Hello(session="s")).permissions is None  # no permissions: every tool


def test_session_catalog_narrows_and_extends(notes):
    assert session_catalog(notes, None) is notes
    narrowed = session_catalog(notes, ["create_note", "read_note"])
    assert narrowed.names() == ["create_note", "read_note"]
    extra = {"name": "get_weather", "description": "Current weather for a city", "inputSchema": {"type": "object"}}
    extended = session_catalog(notes, [extra])
    assert extended.names() == [*notes.names(), "get_weather"]
    assert session_catalog(notes, ["read_note", extra]).names() == ["read_note", "get_weather"]
    with pytest.raises(ProtocolError) as e:
        session_catalog(notes, ["no_such_tool"])
    assert e.value.code == "unknown_tool" and "no_such_tool" in e.value.message
    with pytest.raises(ProtocolError) as e:
        session_catalog(notes, [{"description": "nameless"}])
    assert e.value.code == "bad_catalog"


def test_a_run_of_terminators_cannot_grow_the_buffer():
    seg = Segmenter(max_chars=32)
    seg.feed("Wait")
    spans = []
    for _ in range(500):  # "....": each one a terminator still waiting for whitespace
        spans += seg.feed(".")
        assert seg.buffered <= 32
    assert spans and all(s.reason == "limit" for s in spans)


def test_clauses_of_a_stream_never_supersede_each_other_but_a_growing_clause_does(notes):
    s = started(ServerConfig(span_words=3), notes)
    q = Pending(max_pending=100, stale_s=10.0)
    for ev in s.on_token("a", "one two three four five six. seven eight nine ten.", 0.0) + s.on_end("a", 0.0):
        q.put(ev)
    assert [e.text for e in q.take(0.0)] == ["one two three four five six", "seven eight nine ten"]
    assert q.dropped["superseded"] == 2  # the 3-word spans of each clause, overtaken by longer ones


def test_a_long_user_turn_is_judged_on_its_head_and_tail(notes):
    """Issue 33: a 100,000-character turn held the model thread 490 ms (patterns, tokenizer),
    delaying every other session's decisions; now what is judged is bounded by max_turn_chars,
    and an ask at either end of a pasted document is still in it."""
    s = started(ServerConfig(max_turn_chars=200), notes)
    turn = "Please search my notes. " + "lorem ipsum " * 10_000 + "Then delete the old one."
    (ev,) = s.on_user("u", "  " + turn, 0.0)
    assert len(ev.text) <= 200 and ev.text.startswith("Please search my notes.") and ev.text.endswith("delete the old one.")
    assert (ev.start, ev.end, ev.turn_chars) == (2, 2 + len(turn), len(turn) + 2)  # where the turn was, as sent
    (short,) = s.on_user("v", "Please search my notes.", 0.0)
    assert short.text == "Please search my notes."


def test_a_session_remembers_a_bounded_number_of_ended_streams_and_offers(notes):
    """Issue 13: what a long-lived connection keeps is bounded by the config, not by its age."""
    from sidecar.serve.session import OFFERS_KEPT

    s = started(ServerConfig(max_streams=4, closed_streams=8), notes)
    for i in range(500):
        s.on_token(f"r{i}", "hello there", 0.0)
        s.on_end(f"r{i}", 0.0)
        s.remember_offer([f"tool{i}"], [f"tool{i}", "other"], f"span {i}")
    assert len(s._streams) == 8 and len(s.offered) == OFFERS_KEPT  # nothing open: closed_streams, not max_streams more
    with pytest.raises(ProtocolError) as e:
        s.on_token("r499", "more", 0.0)  # a recent ended stream is still known
    assert e.value.code == "stream_ended"
    s.on_token("r0", "more", 0.0)  # a forgotten one counts as new
    assert "tool499" in s.offered and "tool0" not in s.offered
    for i in range(3):  # open streams stay, beside closed_streams ended ones
        s.on_token(f"open{i}", "still talking", 0.0)
    for i in range(20):
        s.on_user(f"u{i}", "hi", 0.0)
    assert len(s._streams) == 4 + 8 and all(sid in s._streams for sid in ("r0", "open0", "open1", "open2"))  # r0 reopened above


def test_a_word_run_stops_at_every_character_the_segmenter_treats_as_space():
    """`stream._WORD_RUN` steps over a word at once; it must stop wherever `feed`'s own
    character test (str.isspace) sees a space, or words would merge."""
    spaces = "".join(chr(c) for c in range(0x110000) if chr(c).isspace())
    assert set(stream._SPACES) == set(spaces)
    assert all(stream._WORD_RUN.match("a" + c + "b").end() == 1 for c in spaces)
