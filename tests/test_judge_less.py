"""Judging less without judging differently (issue 12, part 2): the query cache gives the
decisions an uncached pipeline gives, stays within its bound and embeds nothing it holds; a
growing clause that gained no content word is not judged again, by the segmenter and on a
real server (decisions counted, and `/metrics`). Real MiniLM, real SQLite, real websockets."""

from __future__ import annotations

import asyncio

import pytest

from sidecar import config as config_mod
from sidecar.core import models
from sidecar import protocol as p
from sidecar.client import SidecarClient
from sidecar.core.pipeline import QueryCache, Request
from sidecar.core.stream import Segmenter

from .test_pipeline import _pipeline
from .test_server import serving

BOUND_S = 180  # an overall bound against hangs, never a speed assertion
TEXTS = [
    "let me search my notes for the kubernetes setup",
    "I should call create_note to save this meeting summary.",
    "the search algorithm is quadratic",
    "thanks, that was helpful",
    "let me search my notes for the kubernetes setup",  # a repeat within one batch
    "Could you find my notes about the deployment?",
]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return _pipeline(models.SMALL_MODEL, tmp_path_factory.mktemp("judge-less") / "sidecar.db")


def same(a, b) -> None:
    assert (a.fired, a.tier, a.path, a.tool, a.case) == (b.fired, b.tier, b.path, b.tool, b.case)
    assert [c.tool for c in a.candidates] == [c.tool for c in b.candidates]
    if a.score is not None:
        assert a.score == pytest.approx(b.score, abs=1e-3)


def test_cached_decisions_are_the_uncached_ones_and_a_hit_embeds_nothing(small):
    requests = [Request(t, s) for t in TEXTS for s in ("user", "llm")]
    shipped = small.queries
    try:
        small.queries = QueryCache(0)
        uncached = small.detect_batch(requests).decisions
        assert small.queries.hits == 0
        small.queries = QueryCache(64)
        first = small.detect_batch(requests).decisions
        embedded = small.queries.misses
        # distinct texts embedded once, whatever their source or repeats (negatives are never embedded)
        assert embedded == len({r.text for r, d in zip(requests, first) if d.kind != "negative"})
        again = small.detect_batch(requests).decisions
        assert small.queries.misses == embedded  # nothing embedded the second time
        assert small.queries.hits >= len([d for d in again if d.kind != "negative"])
    finally:
        small.queries = shipped
    assert any(d.fired for d in uncached) and any(not d.fired for d in uncached)  # the set decides both ways
    for u, f, a in zip(uncached, first, again):
        same(u, f)
        same(f, a)
        assert a.score == f.score  # a hit is the very vector the first pass cached


def test_the_cache_is_bounded_and_keeps_the_most_recent(small):
    cache = QueryCache(3)
    texts = [f"please look up note number {i} about the cluster" for i in range(8)]
    for t in texts:
        cache.embed(small.embedder, [t])
    assert len(cache) == 3 and cache.misses == 8
    out = cache.embed(small.embedder, texts[-3:])
    assert cache.hits == 3 and cache.misses == 8
    assert out.vectors.shape == (3, small.embedder.dim)
    cache.embed(small.embedder, texts[:1])  # long evicted: embedded again
    assert cache.misses == 9 and len(cache) == 3


def test_a_bad_cache_size_is_one_line():
    with pytest.raises(config_mod.ConfigError, match=r"index.query_cache=-1 must be within 0..1000000"):
        config_mod.load(env={}, overrides={("index", "query_cache"): -1})


def feed(seg: Segmenter, text: str) -> list[str]:
    out = []
    for ch in text:
        out += [s.text for s in seg.feed(ch)]
    return out + [s.text for s in seg.end()]


def test_a_clause_is_judged_again_only_when_it_gained_content_words():
    seg = Segmenter(span_words=4)
    # cut at 4 words, then the clause gains only a comma, "please" and a full stop
    assert feed(seg, "search my kubernetes notes, please.\nok") == ["search my kubernetes notes,"]
    assert seg.unchanged == 1
    # a content word (a negation too) is news
    assert feed(Segmenter(span_words=4), "search my kubernetes notes, tonight.") == [
        "search my kubernetes notes,", "search my kubernetes notes, tonight"]  # fmt: skip
    assert feed(Segmenter(span_words=3), "I will search, not.") == ["I will search,", "I will search, not"]
    # the baseline behaviour, on request
    every = Segmenter(span_words=4, rejudge_unchanged=True)
    assert feed(every, "search my kubernetes notes, please.") == ["search my kubernetes notes,", "search my kubernetes notes, please"]
    assert every.unchanged == 0


async def stream_counting(url: str, first: str, rest: str) -> int:
    """Stream `first`, wait for its decision (so nothing queued can supersede it), then
    `rest` and `end`: the number of `decision` messages up to `ended`."""
    async with await SidecarClient.connect(url, session="judge-less", decisions=True) as sc:
        for piece in first:
            await sc.token("a", piece)
        seen = [await sc.recv(60)]
        assert isinstance(seen[0], p.DecisionReport | p.Inject), seen
        for piece in rest:
            await sc.token("a", piece)
        await sc.end("a")
        while not isinstance(seen[-1], p.Ended):
            seen.append(await sc.recv(60))
        return sum(isinstance(m, p.DecisionReport) for m in seen)


def test_the_server_does_not_judge_a_clause_that_only_gained_punctuation(small):
    async def main():
        async with serving(small, span_words=4) as srv:
            assert await stream_counting(srv.url, "search my kubernetes notes, ", "please.\n") == 1
            assert srv.metrics.value("sidecar_spans_unchanged_total") == 1
            assert await stream_counting(srv.url, "search my kubernetes notes, ", "tonight.\n") == 2  # gained a word
        async with serving(small, span_words=4, rejudge_unchanged=True) as srv:
            assert await stream_counting(srv.url, "search my kubernetes notes, ", "please.\n") == 2
            assert srv.metrics.value("sidecar_spans_unchanged_total") == 0
            assert b"sidecar_query_cache_misses_total" in srv.metrics.render()

    asyncio.run(asyncio.wait_for(main(), BOUND_S))
