"""Recommendation at 100, 1,000 and 10,000 tools: index build (cold), start from the store
(warm), recommendation latency; and ranking quality with and without a failure history.

    .venv/bin/python bench/recommend_latency.py [--model all-minilm-l6-v2] [--sizes 100,1000,10000] [--warm-runs 3]
                                                [--bulk-threads N] [--json]

Scale: catalogs are synthesised from the real tools of fixtures/catalogs/ALL.json. The
first copy is the real catalog; every further copy of a tool lives on its own server
(github2, github3, ...) and is a variant of it: a qualifier word in its name, title and
description ("search_notes_billing": "Search billing notes ..."), so none of its texts is
another tool's and a cold build embeds all of them, as a catalog of 10,000 distinct tools
would.

Per size, each in a fresh store file:
  build_cold_s  `pipeline.from_config` on an empty store: model load, every text embedded
                (index_cold_s: the semantic index's part, texts: how many it embedded);
  load_warm_s   the same again on the reopened store, as a restart: every vector from the store;
                the median of --warm-runs restarts (all of them in load_warm_runs_s; index_warm_s,
                lexical_warm_s: the semantic index's part, and a BM25 build of the catalog, what a
                start pays without a stored BM25 index; medians too);
  first_recommend_ms  the first `Recommender.recommend` after the last restart, default mode:
                what the first query pays for state built on demand;
  recommend     p50 / p99 ms of `Recommender.recommend` (cache off, so every query is
                embedded and ranked) over 24 queries x --rounds, per mode; the JSON's
                recommend_p50_ms / recommend_p99_ms are the default mode's; rank_p50_ms /
                rank_p99_ms the same given the query's vector (what serve pays: its gate
                embedded the text already);
--json prints a JSON list, one object per size, and skips the quality part.

Quality: labelled queries over the real catalog (each with the tools that answer it), split
into a dev half and a held-out half that was written apart and never used to set a
parameter. Scenarios: no history; 20% of the other tools failing (90% failures); the
expected tools themselves failing (the recommender should demote them).
"""

from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import sys
import tempfile
import time

import msgspec
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sidecar.core import catalog as catalog_mod  # noqa: E402
from sidecar import config as config_mod  # noqa: E402
from sidecar.core import models, pipeline  # noqa: E402
from sidecar.core.catalog import Catalog, Tool  # noqa: E402
from sidecar.config import RecommendConfig  # noqa: E402
from sidecar.core.lexical import LexicalIndex  # noqa: E402
from sidecar.store.metrics import MetricsStore, key_of  # noqa: E402
from sidecar.recommend import Recommender  # noqa: E402
from sidecar.store import open_store, Store  # noqa: E402

ALL = ROOT / "fixtures" / "catalogs" / "ALL.json"

DEV = [
    ("save a text file", ["filesystem__write_file", "filesystem__edit_file", "desktop-commander__write_file"]),
    ("fetch the web page at https://example.com and give me its text", ["fetch__fetch", "duckduckgo__fetch_content", "firecrawl__firecrawl_scrape"]),
    ("what time is it in Tokyo right now", ["time__get_current_time"]),
    ("open a pull request for my branch on github", ["github__create_pull_request"]),
    ("show the staged changes in git", ["git__git_diff_staged"]),
    ("post a message to the #general slack channel", ["slack__slack_post_message"]),
    ("remember that Alice works at Acme", ["memory__create_entities", "memory__add_observations"]),
    ("take a screenshot of the current browser page", ["playwright__browser_take_screenshot", "puppeteer__puppeteer_screenshot", "chrome-devtools__take_screenshot"]),
    ("get driving directions from Paris to Lyon", ["google-maps__maps_directions"]),
    ("find papers about diffusion models on arxiv", ["arxiv__search_papers"]),
    ("run this SQL query against the sqlite database", ["sqlite__read_query", "sqlite__write_query"]),
    ("generate an image of a cat in a spaceship", ["everart__generate_image"]),
]
HELDOUT = [
    ("list every file in the project folder", ["filesystem__list_directory", "desktop-commander__list_directory", "filesystem__directory_tree"]),
    ("commit my changes with the message fix typo", ["git__git_commit"]),
    ("create a new jira ticket for the login bug", ["atlassian__jira_create_issue"]),
    ("convert 3pm New York time to Berlin time", ["time__convert_time"]),
    ("look up the latest docs for the react library", ["context7__query-docs", "context7__resolve-library-id"]),
    ("click the submit button on the page", ["playwright__browser_click", "puppeteer__puppeteer_click", "chrome-devtools__click"]),
    ("delete the cached key user:42 from redis", ["redis__delete"]),
    ("search the web for the best hiking boots", ["brave-search__brave_web_search", "duckduckgo__search", "firecrawl__firecrawl_search"]),
    ("read the contents of config.yaml", ["filesystem__read_text_file", "filesystem__read_file", "desktop-commander__read_file"]),
    ("find coffee shops near the Eiffel Tower", ["google-maps__maps_search_places", "brave-search__brave_local_search"]),
    ("count documents in the orders collection in mongo", ["mongodb__count"]),
    ("reply to that thread in slack saying thanks", ["slack__slack_reply_to_thread"]),
]
LATENCY_QUERIES = [q for q, _ in DEV + HELDOUT]


QUALIFIERS = ("billing", "staging", "archive", "team", "legacy", "sandbox", "customer", "partner", "internal",
              "regional", "backup", "finance", "marketing", "support", "research", "mobile", "vendor", "audit",
              "training", "hr", "sales", "ops", "security", "design", "lab")  # fmt: skip


def variant(t: Tool, k: int) -> Tool:
    """The k-th copy of a real tool (k >= 1): its own server, a qualifier in its texts."""
    q = QUALIFIERS[(k - 1) % len(QUALIFIERS)] + ("" if k <= len(QUALIFIERS) else str(k))
    server = f"{t.server}{k + 1}"
    head, _, rest = (t.description or "").partition(" ")
    return msgspec.structs.replace(
        t, name=f"{server}__{t.bare_name}_{q}", server=server,
        title=f"{q.title()} {t.title}" if t.title else None, description=f"{head} {q} {rest}".strip(),
        cases=[f"{c} ({q})" for c in t.cases] if t.cases else t.cases)  # fmt: skip


def synthesise(base: Catalog, size: int) -> Catalog:
    tools = list(base)[:size]
    k = 1
    while len(tools) < size:
        tools.extend(variant(t, k) for t in list(base)[: size - len(tools)])
        k += 1
    return Catalog(tools, [f"synthetic:{size}"])


BULK_THREADS: int | None = None  # --bulk-threads: llama.cpp threads of a cold build (default: every core)


def load_pipeline(model: str, catalog: Catalog, store: Store) -> pipeline.Pipeline:
    cfg = config_mod.load(env={}, overrides={("model", "name"): model, ("model", "bulk_threads"): BULK_THREADS})
    return pipeline.from_config(cfg, catalog=catalog, store=store, progress=False)


class Latency(msgspec.Struct):
    p50_ms: float  # the query embedded, then ranked
    p99_ms: float
    n: int
    rank_p50_ms: float = 0.0  # ranked on the query's vector given, as serve does after its gate embedded it
    rank_p99_ms: float = 0.0


class SizeResult(msgspec.Struct):
    tools: int
    model: str
    texts: int  # distinct texts the cold build embedded
    build_cold_s: float
    index_cold_s: float
    load_warm_s: float  # median of the restarts
    index_warm_s: float
    lexical_warm_s: float
    load_warm_runs_s: list[float]
    first_recommend_ms: float
    recommend_p50_ms: float  # the default mode's
    recommend_p99_ms: float
    mode: str
    by_mode: dict[str, Latency]


def latency(pipe: pipeline.Pipeline, metrics: MetricsStore, mode: str, rounds: int) -> Latency:
    rec = Recommender(pipe, metrics, RecommendConfig(cache_ttl_s=0))
    rec.recommend("warm up", mode=mode)
    vectors = pipe.embedder.embed(LATENCY_QUERIES, "query").vectors
    times, ranks = [], []
    for _ in range(rounds):
        for q, v in zip(LATENCY_QUERIES, vectors):
            t0 = time.perf_counter()
            rec.recommend(q, mode=mode)
            t1 = time.perf_counter()
            rec.recommend(q, mode=mode, query_vector=v)
            ranks.append((time.perf_counter() - t1) * 1000)
            times.append((t1 - t0) * 1000)
    a, r = np.asarray(times), np.asarray(ranks)
    return Latency(float(np.percentile(a, 50)), float(np.percentile(a, 99)), len(a),
                   float(np.percentile(r, 50)), float(np.percentile(r, 99)))  # fmt: skip


def measure_size(model: str, base: Catalog, size: int, tmp: pathlib.Path, rounds: int, warm_runs: int) -> SizeResult:
    """Cold build, warm starts and recommendation latency at one catalog size, in a fresh store."""
    cat = synthesise(base, size)
    path = tmp / f"index-{size}.db"
    store = open_store(path)
    t0 = time.perf_counter()
    cold = load_pipeline(model, cat, store)
    build_cold = time.perf_counter() - t0
    cold_stats = next(iter(cold.indexes.values())).stats
    del cold
    store.close()
    warm, index_s, lexical_s = [], [], []
    pipe = None
    for _ in range(warm_runs):
        if pipe is not None:
            pipe.store.close()
            pipe = None  # one pipeline in memory at a time, as after a restart
        store = open_store(path)  # a restart: a new connection to the same file
        t0 = time.perf_counter()
        pipe = load_pipeline(model, cat, store)
        warm.append(time.perf_counter() - t0)
        warm_stats = next(iter(pipe.indexes.values())).stats
        assert warm_stats.embedded == 0, warm_stats
        index_s.append(warm_stats.seconds)
        t0 = time.perf_counter()
        LexicalIndex(cat, "bm25")  # what the start spent on it (timed apart: from_config does not say)
        lexical_s.append(time.perf_counter() - t0)
    metrics = MetricsStore(open_store(tmp / f"m{size}.db"))
    fail(metrics, cat, random.Random(size).sample(cat.names(), max(1, size // 10)), time.time())  # a history to read
    default = RecommendConfig().mode
    t0 = time.perf_counter()
    Recommender(pipe, metrics, RecommendConfig(cache_ttl_s=0)).recommend(LATENCY_QUERIES[0], mode=default)
    first = (time.perf_counter() - t0) * 1000
    by_mode = {mode: latency(pipe, metrics, mode, rounds) for mode in ("semantic", "hybrid", "lexical")}
    med = statistics.median
    return SizeResult(size, pipe.embedder.name, cold_stats.embedded, build_cold, cold_stats.seconds, med(warm), med(index_s),
                      med(lexical_s), warm, first, by_mode[default].p50_ms, by_mode[default].p99_ms, default, by_mode)  # fmt: skip


def quality(rec: Recommender, items, mode: str) -> dict:
    rr, top1 = [], 0
    for q, expect in items:
        names = [r.tool for r in rec.recommend(q, top=10, mode=mode).results]
        rank = next((i + 1 for i, n in enumerate(names) if n in expect), None)
        rr.append(1 / rank if rank else 0.0)
        top1 += rank == 1
    return {"top1": top1 / len(items), "mrr": float(np.mean(rr))}


def fail(metrics: MetricsStore, catalog: Catalog, names, now: float) -> None:
    """20 calls, 18 failed, an hour ago (outside the availability window: tools fail, servers stay up)."""
    for name in names:
        server, tool = key_of(catalog, name)
        for i in range(20):
            metrics.record_call(server, tool, i >= 18, 400.0, None if i >= 18 else "synthetic failure", ts=now - 3600 - i)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=models.SMALL_MODEL, help="NAME or NAME:QUANT")
    ap.add_argument("--quality-model", action="append", help="models for the quality part (default: small and default)")
    ap.add_argument("--sizes", default="100,1000,10000")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bulk-threads", type=int, help="threads of a cold build ([model] bulk_threads; default every core)")
    ap.add_argument("--warm-runs", type=int, default=3, help="restarts measured per size (the median is reported)")
    ap.add_argument("--json", action="store_true", help="print a JSON list, one object per size; no quality part")
    args = ap.parse_args()
    global BULK_THREADS
    BULK_THREADS = args.bulk_threads
    base = catalog_mod.load([ALL])
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="sidecar-bench-"))
    results = []
    if not args.json:
        print(f"{args.model}: index and start in s, recommendation in ms (cache off, {len(LATENCY_QUERIES)} queries x {args.rounds} rounds)")
        print(f"{'tools':>7} {'texts':>7} {'cold':>8} {'(index)':>8} {'warm':>7} {'(index)':>8} {'(bm25)':>7} {'1st ms':>7}   {'mode':>8} {'p50':>7} {'p99':>7} {'rank50':>7} {'rank99':>7}")
    for size in map(int, args.sizes.split(",")):
        r = measure_size(args.model, base, size, tmp, args.rounds, args.warm_runs)
        results.append(r)
        if not args.json:
            for i, (mode, lat) in enumerate(r.by_mode.items()):
                head = (f"{r.tools:>7} {r.texts:>7} {r.build_cold_s:>8.1f} {r.index_cold_s:>8.1f} {r.load_warm_s:>7.2f} {r.index_warm_s:>8.2f}"
                        f" {r.lexical_warm_s:>7.2f} {r.first_recommend_ms:>7.1f}" if i == 0 else " " * 68)  # fmt: skip
                print(f"{head}   {mode:>8} {lat.p50_ms:>7.2f} {lat.p99_ms:>7.2f} {lat.rank_p50_ms:>7.2f} {lat.rank_p99_ms:>7.2f}", flush=True)
    if args.json:
        sys.stdout.buffer.write(msgspec.json.encode(results) + b"\n")
        return

    print(f"\nranking quality on the real catalog ({len(base)} tools), expected tool's rank in the top 10")
    print(f"{'model':<24} {'scenario':<28} {'set':<8} {'mode':<8} {'top1':>6} {'MRR':>6}")
    store = open_store(tmp / "bench.db")
    for model in args.quality_model or [models.SMALL_MODEL, models.DEFAULT_MODEL]:
        pipe = load_pipeline(model, base, store)
        expected = {n for _, e in DEV + HELDOUT for n in e}
        others = [n for n in base.names() if n not in expected]
        scenarios = {
            "no history": [],
            "20% of other tools failing": random.Random(0).sample(others, len(others) // 5),
            "expected tools failing": sorted(expected),
        }
        for label, failing in scenarios.items():
            metrics = MetricsStore(open_store(tmp / f"q-{model}-{len(failing)}.db"))
            fail(metrics, base, failing, time.time())
            rec = Recommender(pipe, metrics, RecommendConfig(cache_ttl_s=0))
            for set_name, items in (("dev", DEV), ("heldout", HELDOUT)):
                for mode in ("hybrid", "semantic", "lexical"):
                    q = quality(rec, items, mode)
                    print(f"{model:<24} {label:<28} {set_name:<8} {mode:<8} {q['top1']:>6.2f} {q['mrr']:>6.3f}", flush=True)
        del pipe


if __name__ == "__main__":
    main()
