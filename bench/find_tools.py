"""`find_tools` in `sidecar proxy`: is the needed tool offered by the inject, or found by the
model's own search, and at what cost in schema tokens?

    python bench/find_tools.py [--model NAME] [--catalog FILE...] [--labeled FILE] [--queries FILE...]
                               [--top K] [--json]

1. Offered or found: every user turn of the labelled set is judged as the proxy judges a request
   (offer.Judge.offer, the default tier policy) under each `find_tools` policy. On a turn needing
   a tool whose inject lacks it, the model is taken to search once (an ideal caller: it searches
   exactly when its tool is missing, and never on a turn needing none), through the proxy's own
   answer (Judge.find: Sidecar.rank, the best `--top` added). Covered = the expected tool is in
   the inject or among those found. Tokens (cl100k_base, OpenAI function shape): the tools of the
   request the model answers from (the re-asked one after a search), per request, against
   sending every catalog tool; and the first request's alone.
   The search query is a stand-in, as no model-written searches over this catalog exist here:
   `turn`, the user's turn itself (the model passing the request on), and `named`, the turn
   behind the server the corpus labels it with ("server: google-maps; tool: <turn>": a model
   that names the right server). Both are held out (fixtures/corpus/heldout.jsonl: servers
   never seen in any fit).
2. Ranking of search queries: right tool first and in the top K for the proxy's search (the
   engine's ranking of `search.query_text`), beside plain cosine (the same model, query against
   each tool's description) and BM25 (name, description, parameter names) of the same run. On
   the two stand-in styles, on the labelled set's reply clauses (a model's own words before its
   call), and on each `--queries` file (JSONL {"text", "expect"}: model-written tool searches,
   e.g. "server: maps; tool: find parking near a landmark", when such a set is at hand).

Defaults: the default model, fixtures/catalogs/ALL.json, fixtures/corpus/heldout.jsonl, K = the
config's proxy.find_tools_top (5).
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor

import msgspec
import numpy as np
import orjson

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sidecar import config as config_mod  # noqa: E402
from sidecar.core import catalog as catalog_mod  # noqa: E402
from sidecar.core.lexical import LexicalIndex  # noqa: E402
from sidecar.core.pipeline import Request  # noqa: E402
from sidecar.engine import Sidecar  # noqa: E402
from sidecar.lab.evaluate import Labeled, description_vectors, read_labeled  # noqa: E402
from sidecar.proxy import search, shapes  # noqa: E402
from sidecar.proxy.offer import Judge  # noqa: E402
from bench.proxy_latency import tokens  # noqa: E402

POLICIES = ("never", "when_none", "always")
STYLES = {"turn": lambda i: i.text, "named": lambda i: f"server: {i.group}; tool: {i.text}"}


def rate(n: int, d: int) -> float | None:
    return round(n / d, 4) if d else None


async def coverage(cfg, engine: Sidecar, executor, items: list[Labeled], style: str) -> dict:
    every = tokens([shapes.function_tool(t.definition()) for t in engine.catalog])
    out = {}
    for policy in POLICIES:
        pcfg = msgspec.structs.replace(cfg, proxy=msgspec.structs.replace(cfg.proxy, find_tools=policy))
        first, final, need, injected, covered, searched = [], [], 0, 0, 0, 0
        for it in items:
            judge = Judge(pcfg, engine, None, executor)
            offer = await judge.offer({"model": "m", "messages": [{"role": "user", "content": it.text}]})
            first.append(tokens(offer.tools))
            if it.positive:
                need += 1
                hit = bool(it.expected & set(offer.names.values()))
                injected += hit
                if not hit and offer.searchable:
                    searched += 1
                    await judge.find(offer, STYLES[style](it), set())
                    hit = bool(it.expected & set(offer.names.values()))
                covered += hit
            final.append(tokens(offer.tools))
        out[policy] = {"covered": rate(covered, need), "injected": rate(injected, need), "searches": searched,
                       "tokens_per_request": round(statistics.fmean(final), 1), "share_of_catalog": round(statistics.fmean(final) / every, 5),
                       "first_request_tokens": round(statistics.fmean(first), 1), "p99_tokens": float(np.percentile(final, 99))}  # fmt: skip
    return {"catalog_tokens": every, "turns": len(items), "turns_needing_a_tool": sum(i.positive for i in items),
            "find_tools_tokens": tokens([shapes.function_tool(search.DEFINITION)]), "policies": out}  # fmt: skip


def ranked_at(rankings: list[list[str]], items: list[Labeled], k: int) -> float:
    return round(sum(bool(set(r[:k]) & i.expected) for r, i in zip(rankings, items)) / len(items), 4)


def ranking(engine: Sidecar, items: list[Labeled], queries: list[str], k: int, docs: np.ndarray, lexical: LexicalIndex) -> dict:
    """Right tool first / in the top k: the proxy's search, plain cosine and BM25, same queries."""
    pipe = engine.pipeline
    texts = [search.query_text(q) for q in queries]
    names = np.asarray([t.name for t in pipe.catalog])
    ours = [[r.tool for r in engine.rank(Request(t), k).results] for t in texts]
    vectors = pipe.queries.embed(pipe.embedder, texts).vectors
    cosine = [list(names[np.argsort(-(docs @ v), kind="stable")[:k]]) for v in vectors]
    bm25 = [[n for n, _ in lexical.rank(t, k)] for t in texts]
    return {"n": len(items), **{name: {"first": ranked_at(r, items, 1), f"top{k}": ranked_at(r, items, k)}
                                for name, r in (("find_tools", ours), ("cosine", cosine), ("bm25", bm25))}}  # fmt: skip


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="embedding model (default: the config's default)")
    ap.add_argument("--catalog", nargs="+", default=[str(ROOT / "fixtures/catalogs/ALL.json")])
    ap.add_argument("--labeled", default=str(ROOT / "fixtures/corpus/heldout.jsonl"))
    ap.add_argument("--queries", nargs="*", default=[], help="JSONL {text, expect}: model-written tool searches, ranked")
    ap.add_argument("--store", default=None, help="store (default: the config's; tool embeddings cached there)")
    ap.add_argument("--top", type=int, default=None, help="tools one search adds (default: proxy.find_tools_top)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    overrides = {("catalogs",): args.catalog, ("model", "name"): args.model, ("store",): args.store, ("proxy", "find_tools_top"): args.top}
    cfg = config_mod.load(overrides=overrides)
    k = cfg.proxy.find_tools_top
    catalog = catalog_mod.load(cfg.catalogs)
    engine = Sidecar.open(cfg, catalog=catalog, progress=False, history=False)
    items = [i for i in read_labeled(args.labeled, catalog) if i.source == "user"]
    replies = [i for i in read_labeled(args.labeled, catalog) if i.source == "llm" and i.positive]
    report: dict = {"model": engine.pipeline.embedder.name, "catalog": [pathlib.Path(c).name for c in args.catalog],
                    "labeled": pathlib.Path(args.labeled).name, "top": k, "coverage": {}, "ranking": {}}  # fmt: skip
    with ThreadPoolExecutor(1) as executor:
        for style in STYLES:
            report["coverage"][style] = await coverage(cfg, engine, executor, items, style)
    docs = description_vectors(engine.pipeline)
    lexical = LexicalIndex(engine.catalog, "bm25")
    asks = [i for i in items if i.positive]
    sets = {f"{style} (held-out user turns)": (asks, [STYLES[style](i) for i in asks]) for style in STYLES}
    sets["reply clauses (held-out, the model's words before its call)"] = (replies, [i.text for i in replies])
    for path in args.queries:
        own = [i for i in read_labeled(path, catalog) if i.positive]
        sets[pathlib.Path(path).name] = (own, [i.text for i in own])
    for name, (its, queries) in sets.items():
        report["ranking"][name] = ranking(engine, its, queries, k, docs, lexical)
    engine.close()
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
        return
    print(f"{report['model']}, {', '.join(report['catalog'])}, {report['labeled']}, top {k}")
    for style, c in report["coverage"].items():
        print(f"search query = {style}: {c['turns_needing_a_tool']} of {c['turns']} turns need a tool; catalog {c['catalog_tokens']:,} tokens; "
              f"find_tools {c['find_tools_tokens']} tokens")  # fmt: skip
        for policy, p in c["policies"].items():
            print(f"  find_tools={policy:<9} offered or found {p['covered']:.1%} (inject {p['injected']:.1%}, {p['searches']} searches); "
                  f"{p['tokens_per_request']} tokens per request ({p['share_of_catalog']:.2%}), first request {p['first_request_tokens']}")  # fmt: skip
    for name, r in report["ranking"].items():
        cells = "; ".join(f"{m} {r[m]['first']:.1%} / {r[m][f'top{k}']:.1%}" for m in ("find_tools", "cosine", "bm25"))
        print(f"{name} (n={r['n']}), first / top {k}: {cells}")


if __name__ == "__main__":
    asyncio.run(main())
