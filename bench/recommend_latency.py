"""Recommendation latency at 100, 1,000 and 10,000 tools, and ranking quality with and
without a synthetic failure history.

    .venv/bin/python bench/recommend_latency.py [--model all-minilm-l6-v2] [--sizes 100,1000,10000]

Scale: catalogs are synthesised from the 462 real tools of fixtures/catalogs/ALL.json,
replicated under distinct server names (server2__read_file, ...) until the size is reached.
The index strategy renders the server name into the texts, so every replica is embedded
(about 35 s per 1,000 tools with the small model on 2 busy cores; 10,000 takes well over
10 minutes): the small model is the default because the latency measured is the
recommender's (query embedding + retrieval + scoring), not indexing. The recommendation
cache is off: every query is computed.

Quality: labelled queries over the real catalog (each with the tools that answer it), split
into a dev half and a held-out half that was written apart and never used to set a
parameter. Scenarios: no history; 20% of the other tools failing (90% failures); the
expected tools themselves failing (the recommender should demote them).
"""

from __future__ import annotations

import argparse
import pathlib
import random
import sys
import tempfile
import time

import msgspec
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sidecar import catalog as catalog_mod  # noqa: E402
from sidecar import config as config_mod  # noqa: E402
from sidecar import models, pipeline  # noqa: E402
from sidecar.catalog import Catalog  # noqa: E402
from sidecar.config import RecommendConfig  # noqa: E402
from sidecar.metrics import MetricsStore, key_of  # noqa: E402
from sidecar.recommend import Recommender  # noqa: E402
from sidecar.store import Store  # noqa: E402

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


def synthesise(base: Catalog, size: int) -> Catalog:
    tools = []
    k = 0
    while len(tools) < size:
        for t in base:
            if len(tools) >= size:
                break
            server = t.server if k == 0 else f"{t.server}{k + 1}"
            tools.append(msgspec.structs.replace(t, name=f"{server}__{t.bare_name}", server=server))
        k += 1
    return Catalog(tools, [f"synthetic:{size}"])


def load_pipeline(model: str, catalog: Catalog, store: Store) -> pipeline.Pipeline:
    cfg = config_mod.load(env={}, overrides={("model", "name"): model})
    return pipeline.from_config(cfg, catalog=catalog, store=store, progress=False)


def latency(pipe: pipeline.Pipeline, metrics: MetricsStore, mode: str, rounds: int) -> dict:
    rec = Recommender(pipe, metrics, RecommendConfig(cache_ttl_s=0))
    rec.recommend("warm up", mode=mode)
    times = []
    for _ in range(rounds):
        for q in LATENCY_QUERIES:
            t0 = time.perf_counter()
            rec.recommend(q, mode=mode)
            times.append((time.perf_counter() - t0) * 1000)
    a = np.asarray(times)
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "n": len(a)}


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
    ap.add_argument("--model", default=models.SMALL_MODEL)
    ap.add_argument("--quality-model", action="append", help="models for the quality part (default: small and default)")
    ap.add_argument("--sizes", default="100,1000,10000")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    base = catalog_mod.load([ALL])
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="sidecar-bench-"))
    store = Store(tmp / "bench.db")
    print(f"latency ({args.model}, cache off, {len(LATENCY_QUERIES)} queries x {args.rounds} rounds, ms)")
    print(f"{'tools':>7} {'mode':>8} {'p50':>8} {'p99':>8}   index build")
    for size in map(int, args.sizes.split(",")):
        cat = synthesise(base, size)
        t0 = time.perf_counter()
        pipe = load_pipeline(args.model, cat, store)
        built = time.perf_counter() - t0
        metrics = MetricsStore(Store(tmp / f"m{size}.db"))
        fail(metrics, cat, random.Random(size).sample(cat.names(), max(1, size // 10)), time.time())  # a history to read
        for mode in ("hybrid", "semantic", "lexical"):
            r = latency(pipe, metrics, mode, args.rounds)
            print(f"{size:>7} {mode:>8} {r['p50']:>8.2f} {r['p99']:>8.2f}   {built:.1f} s", flush=True)
        del pipe

    print("\nranking quality on the real catalog (462 tools), expected tool's rank in the top 10")
    print(f"{'model':<24} {'scenario':<28} {'set':<8} {'mode':<8} {'top1':>6} {'MRR':>6}")
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
            metrics = MetricsStore(Store(tmp / f"q-{model}-{len(failing)}.db"))
            fail(metrics, base, failing, time.time())
            rec = Recommender(pipe, metrics, RecommendConfig(cache_ttl_s=0))
            for set_name, items in (("dev", DEV), ("heldout", HELDOUT)):
                for mode in ("hybrid", "semantic", "lexical"):
                    q = quality(rec, items, mode)
                    print(f"{model:<24} {label:<28} {set_name:<8} {mode:<8} {q['top1']:>6.2f} {q['mrr']:>6.3f}", flush=True)
        del pipe


if __name__ == "__main__":
    main()
