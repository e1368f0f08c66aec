"""What `sidecar proxy` costs and saves, on one catalog and a labelled set's user turns.

    python bench/proxy_latency.py [--model NAME] [--catalog FILE...] [--labeled FILE] [--requests N]
                                  [--api chat|messages|both] [--json]

1. Latency added before the first upstream byte: each text is sent as a chat completion
   request twice, straight to a local scripted upstream (tests/openai_upstream.py, on
   127.0.0.1) and through an in-process proxy in front of it; the upstream notes when it has
   read each request. Added = through the proxy minus straight, per text. Beside it, one
   `detect` of the same text on the same engine (`Sidecar.judge`, what `sidecar detect` runs),
   and one embedding of the same text by the same model (what a turn cannot cost less than):
   `ratio_p50` is added over detect, `embed_ratio_p50` added over the embedding.
   The query cache is off, so no text is served from an earlier embedding; measured once the
   written cases (`[cases] fill`) are in the index, as the proxy serves from then on. `--api messages`
   sends each text as an Anthropic Messages request (/v1/messages) instead, `--api both` as
   both, in turn, in alternating order (`latency_messages`, and `messages_over_chat`: the ratio
   of the two added p50s).
2. Tool-schema tokens per request: every user turn of the labelled set is judged as the proxy
   judges a request (offer.Judge, the configured tier policy and both policies), and the tools
   it would add (find_tools too, as `proxy.find_tools` offers it) are counted (cl100k_base,
   OpenAI function shape) against sending every catalog tool; recall is the share of turns needing a tool whose expected tool is among those added.

Defaults: the default model, fixtures/catalogs/ALL.json, fixtures/corpus/heldout.jsonl (held out
of every fit), 200 latency requests.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import sys
import time

import httpx2
import msgspec
import orjson

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sidecar.core import catalog as catalog_mod  # noqa: E402
from sidecar import config as config_mod  # noqa: E402
from sidecar.mcp.savings import count_tokens  # noqa: E402
from sidecar.core.pipeline import Request  # noqa: E402
from sidecar.proxy import shapes  # noqa: E402
from sidecar.proxy.app import ProxyServer  # noqa: E402
from sidecar.proxy.offer import Judge  # noqa: E402
from sidecar.serve.telemetry import limit_blas_threads  # noqa: E402
from bench.gate_latency import load_items  # noqa: E402
from bench.gate_latency import pct as percentile  # noqa: E402
from tests.openai_upstream import Scripted, Upstream  # noqa: E402


def pct(values: list[float], q: float) -> float:
    return round(percentile(values, q), 2)


def tokens(tools: list[dict]) -> int:
    return count_tokens(orjson.dumps(tools).decode()) if tools else 0


CASES_WAIT_S = 600  # at most, for the written cases to be added before measuring

REQUESTS = {  # the API -> its path and a request of one user turn
    "chat": ("/chat/completions", lambda text: {"model": "scripted", "messages": [{"role": "user", "content": text}]}),
    "messages": ("/messages", lambda text: {"model": "scripted", "max_tokens": 64, "messages": [{"role": "user", "content": text}]}),
}


async def latency(server: ProxyServer, up: Upstream, texts: list[str], apis: tuple[str, ...] = ("chat",)) -> dict[str, dict]:
    """Per API, the latency the proxy adds on each text; with several APIs each text goes
    through each in turn, the order alternating from one text to the next."""
    added: dict[str, list[float]] = {api: [] for api in apis}
    straight: dict[str, list[float]] = {api: [] for api in apis}
    detect: list[float] = []
    embed: list[float] = []
    engine = server.engine
    gate = server.app.metrics
    judged0, n0 = gate.value("sidecar_proxy_judge_seconds_sum"), gate.value("sidecar_proxy_judge_seconds_count")
    async with httpx2.AsyncClient(timeout=60) as http:
        for i, text in enumerate(texts):
            for api in apis if i % 2 else apis[::-1]:
                path, body = REQUESTS[api]
                ms = {}
                for where, base in (("straight", up.url), ("proxy", server.url)) if i % 2 else (("proxy", server.url), ("straight", up.url)):
                    t0 = time.perf_counter()
                    resp = await http.post(base + path, json=body(text))
                    resp.raise_for_status()
                    ms[where] = (up.requests[-1].at - t0) * 1000
                straight[api].append(ms["straight"])
                added[api].append(ms["proxy"] - ms["straight"])
            t0 = time.perf_counter()
            await asyncio.get_running_loop().run_in_executor(server.executor, engine.judge, [Request(text, "user")])
            detect.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            await asyncio.get_running_loop().run_in_executor(server.executor, engine.pipeline.embedder.embed, [text], "query")
            embed.append((time.perf_counter() - t0) * 1000)
    judge_mean = round((gate.value("sidecar_proxy_judge_seconds_sum") - judged0) * 1000 / max(1, gate.value("sidecar_proxy_judge_seconds_count") - n0), 2)
    return {api: {"requests": len(texts), "added_ms": {"p50": pct(added[api], 50), "p90": pct(added[api], 90), "p99": pct(added[api], 99)},
                  "straight_ms": {"p50": pct(straight[api], 50)}, "proxy_judge_mean_ms": judge_mean,
                  "detect_ms": {"p50": pct(detect, 50), "p90": pct(detect, 90), "p99": pct(detect, 99)},
                  "embed_ms": {"p50": pct(embed, 50), "p90": pct(embed, 90), "p99": pct(embed, 99)},
                  "ratio_p50": round(pct(added[api], 50) / pct(detect, 50), 3) if pct(detect, 50) else None,
                  "embed_ratio_p50": round(pct(added[api], 50) / pct(embed, 50), 3) if pct(embed, 50) else None} for api in apis}  # fmt: skip


async def schema_tokens(server: ProxyServer, items: list) -> dict:
    engine = server.engine
    every = tokens([shapes.function_tool(t.definition()) for t in engine.catalog])
    out = {"catalog_tools": len(engine.catalog), "catalog_tokens": every, "turns": len(items),
           "turns_needing_a_tool": sum(bool(i.expect) for i in items), "policies": {}}  # fmt: skip
    for policy in ("exclude", "include"):
        cfg = msgspec.structs.replace(server.cfg, proxy=msgspec.structs.replace(server.cfg.proxy, confirm_tools=policy))
        sent, added, hit, need, fired_none = [], [], 0, 0, 0
        for it in items:
            offer = await Judge(cfg, engine, None, server.executor).offer({"model": "m", "messages": [{"role": "user", "content": it.text}]})
            sent.append(tokens(offer.tools))
            added.append(len(offer.names))  # catalog tools (find_tools, when offered, is in the tokens, not here)
            expected = [it.expect] if isinstance(it.expect, str) else list(it.expect or ())
            if expected:
                need += 1
                hit += any(name in offer.names.values() for name in expected)
            elif offer.names:
                fired_none += 1
        mean = statistics.fmean(sent)
        out["policies"][policy] = {
            "mean_tokens_per_request": round(mean, 1), "share_of_catalog": round(mean / every, 5),
            "mean_tools_added": round(statistics.fmean(added), 3), "recall": round(hit / need, 4) if need else None,
            "tools_added_to_turns_needing_none": round(fired_none / max(1, len(items) - need), 4),
            "p99_tokens": pct([float(s) for s in sent], 99),
        }  # fmt: skip
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="embedding model (default: the config's default)")
    ap.add_argument("--catalog", nargs="+", default=[str(ROOT / "fixtures/catalogs/ALL.json")])
    ap.add_argument("--labeled", default=str(ROOT / "fixtures/corpus/heldout.jsonl"))
    ap.add_argument("--store", default=None, help="store (default: the config's; tool embeddings cached there)")
    ap.add_argument("--requests", type=int, default=200, help="latency requests (user turns of the labelled set, in order)")
    ap.add_argument("--api", choices=("chat", "messages", "both"), default="chat",
                    help="the requests' API: chat completions (default), Anthropic messages, or both in turn")
    ap.add_argument("--no-tokens", action="store_true", help="skip the tokens figure")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    items = [i for i in load_items(pathlib.Path(args.labeled)) if i.source == "user"]
    with Upstream([Scripted(text="ok")]) as up:
        overrides = {("catalogs",): args.catalog, ("model", "name"): args.model, ("store",): args.store, ("index", "query_cache"): 0,
                     ("proxy", "upstream"): up.url, ("proxy", "port"): 0}  # fmt: skip
        cfg = config_mod.load(overrides=overrides)
        limit_blas_threads(cfg.model.blas_threads)  # as `sidecar proxy` does (proxy/app.py `run`)
        server = ProxyServer(cfg, catalog=catalog_mod.load(cfg.catalogs))
        await server.start()
        try:
            t0 = time.perf_counter()
            writing = server.completion  # the rest of the catalog and [cases] fill: measured on the index it serves once they are in
            while writing is not None and not writing.done.is_set() and time.perf_counter() - t0 < CASES_WAIT_S:
                await asyncio.sleep(0.5)
            cases_s = round(time.perf_counter() - t0, 1)
            texts = [i.text for i in items[: args.requests]]
            apis = ("chat", "messages") if args.api == "both" else (args.api,)
            await latency(server, up, texts[:10], apis)  # warm-up: connections, caches, the model's first calls
            measured = await latency(server, up, texts, apis)
            report = {"model": server.engine.pipeline.embedder.name, "catalog": [pathlib.Path(c).name for c in args.catalog],
                      "labeled": pathlib.Path(args.labeled).name, "cases_added_after_s": cases_s, "latency": measured[apis[0]]}  # fmt: skip
            if args.api == "both":
                report["latency_messages"] = measured["messages"]
                chat, messages = measured["chat"]["added_ms"]["p50"], measured["messages"]["added_ms"]["p50"]
                report["messages_over_chat"] = round(messages / chat, 3) if chat else None
            if not args.no_tokens:
                report["tokens"] = await schema_tokens(server, items)
        finally:
            await server.shutdown()
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
        return
    lat = report["latency"]
    print(f"{report['model']}, {', '.join(report['catalog'])}, {lat['requests']} requests of {report['labeled']}")
    print(f"added before the first upstream byte ({args.api if args.api != 'both' else 'chat'}): p50 {lat['added_ms']['p50']} ms "
          f"(p90 {lat['added_ms']['p90']}); one detect: p50 {lat['detect_ms']['p50']} ms; ratio {lat['ratio_p50']}; "
          f"one embedding: p50 {lat['embed_ms']['p50']} ms; ratio {lat['embed_ratio_p50']}")  # fmt: skip
    if "latency_messages" in report:
        m = report["latency_messages"]
        print(f"added before the first upstream byte (messages): p50 {m['added_ms']['p50']} ms (p90 {m['added_ms']['p90']}); "
              f"messages / chat: {report['messages_over_chat']}")  # fmt: skip
    if "tokens" in report:
        t = report["tokens"]
        for policy, p in t["policies"].items():
            print(f"confirm_tools={policy}: {p['mean_tokens_per_request']} schema tokens per request "
                  f"({p['share_of_catalog']:.2%} of {t['catalog_tokens']:,}), {p['mean_tools_added']} tools, recall {p['recall']}")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
