"""An outside multi-turn agent set, replayed (issue 31): BFCL v4's `multi_turn_base`, 200
conversations of 3-5 user turns each over eight APIs (file system, vehicle, trading, travel,
messages, posts, tickets, maths: 128 functions), with the calls the model made after each
turn. A third of the turns call two tools or more ("move final_report.pdf into a new temp
folder": cd, mkdir, mv).

The data comes from PyPI's `bfcl-eval` wheel (Apache-2.0, downloaded once with pip into
--cache, or --wheel FILE), converted to what `sidecar replay` and `sidecar learn --from` read:
OpenAI chat logs (each turn's calls as an assistant message's `tool_calls`) and one MCP
catalog of the eight APIs (BFCL's types mapped to JSON Schema as in ../shared/data).
Conversations are shuffled (--seed), then split: the first part is the log learned from
(`learn`: the traffic lesson and the tools that go together), the rest is replayed before and
after learning. Beside them, plain cosine's and BM25's top-k of the same turns (k = the tools
called, and k = 3). --out DIR keeps the converted files.

    python bench/multi_turn.py [--model all-minilm-l6-v2] [--json] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import zipfile

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from sidecar import config as config_mod  # noqa: E402
from sidecar.core.lexical import LexicalIndex  # noqa: E402
from sidecar.engine import Sidecar  # noqa: E402
from sidecar.serve.learner import apply_learned, traffic_log  # noqa: E402
from sidecar.replay import replay  # noqa: E402
from sidecar.store import open_store  # noqa: E402
from sidecar.learn.traffic import log_examples  # noqa: E402
from sidecar.transcripts import read_transcripts  # noqa: E402

WHEEL = "bfcl-eval==2026.3.23"
DATA = "bfcl_eval/data/"
APIS = {"GorillaFileSystem": "gorilla_file_system", "MathAPI": "math_api", "MessageAPI": "message_api", "TwitterAPI": "posting_api",
        "TicketAPI": "ticket_api", "TradingBot": "trading_bot", "TravelAPI": "travel_booking", "VehicleControlAPI": "vehicle_control"}  # fmt: skip
TYPES = {"dict": "object", "float": "number", "tuple": "array"}


def fetch(cache: pathlib.Path) -> pathlib.Path:
    found = sorted(cache.glob("bfcl_eval-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(cache), WHEEL], check=True)
        found = sorted(cache.glob("bfcl_eval-*.whl"))
    return found[-1]


def _schema(node):
    """BFCL's parameter types as JSON Schema: dict -> object, float -> number, tuple -> array, no `any`."""
    if isinstance(node, dict):
        out = {k: _schema(v) for k, v in node.items() if not (k == "type" and v == "any")}
        if isinstance(out.get("type"), str):
            out["type"] = TYPES.get(out["type"], out["type"])
        return out
    return [_schema(v) for v in node] if isinstance(node, list) else node


def convert(wheel: pathlib.Path) -> tuple[dict, list[dict]]:
    """The catalog of the eight APIs and one OpenAI chat log per conversation."""
    with zipfile.ZipFile(wheel) as z:
        def lines(name: str) -> list[dict]:
            return [json.loads(line) for line in z.read(DATA + name).decode().splitlines() if line.strip()]

        tools = [{"name": f["name"], "description": f["description"], "inputSchema": _schema(f["parameters"])}
                 for api in APIS.values() for f in lines(f"multi_turn_func_doc/{api}.json")]  # fmt: skip
        questions = lines("BFCL_v4_multi_turn_base.json")
        answers = {a["id"]: a["ground_truth"] for a in lines("possible_answer/BFCL_v4_multi_turn_base.json")}
    convs = []
    for q in questions:
        messages = []
        for turn, calls in zip(q["question"], answers[q["id"]]):
            messages += [{"role": m["role"], "content": m["content"]} for m in turn if m["role"] == "user"]
            names = [re.match(r"\s*(\w+)\(", c).group(1) for c in calls]
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{k}", "type": "function", "function": {"name": n, "arguments": "{}"}} for k, n in enumerate(names)]})
        convs.append({"id": q["id"], "messages": messages})
    return {"server": "bfcl-multi-turn", "tools": tools}, convs


def baselines_top_k(engine: Sidecar, conversations) -> dict[str, dict[str, dict[str, float]]]:
    """The simplest rankers of each user turn, their top k (k = the tools the turn called, and
    3), scored as replay scores an inject: plain cosine to each tool's description (same model)
    and BM25 over each tool's text (name, description, parameters)."""
    pipe = engine.pipeline
    tools = list(engine.catalog)
    turns = [(m.content, [c.name for c in nxt.tool_calls or ()]) for conv in conversations
             for m, nxt in zip(conv.messages, conv.messages[1:]) if m.role == "user" and nxt.role == "assistant"]  # fmt: skip
    docs = pipe.embedder.embed([t.description or t.name for t in tools], "document").vectors
    qs = pipe.embedder.embed([t for t, _ in turns], "query").vectors
    bm25 = LexicalIndex(engine.catalog)
    scores = {"cosine": qs @ docs.T, "bm25": np.vstack([bm25.scores(t) for t, _ in turns])}
    return {kind: _top_k(tools, turns, np.argsort(-s, axis=1, kind="stable")) for kind, s in scores.items()}


def _top_k(tools, turns, order) -> dict[str, dict[str, float]]:
    out = {}
    for label, k_of in (("k = called", len), ("k = 3", lambda _: 3)):
        hits = injected = called = 0  # a called tool among the top k is both a right injection and one found
        for (_, truth), ranked in zip(turns, order):
            want = set(truth)
            if not want:
                continue
            top = {tools[i].name for i in ranked[: k_of(want)]}
            hits += len(top & want)
            injected += len(top)
            called += len(want)
        out[label] = {"precision": hits / injected, "recall": hits / called}
    return out


def figures(summary) -> dict[str, float]:
    return {"precision": summary.precision, "recall": summary.recall, "exact_set": summary.exact_set,
            "injections": summary.injections, "false_fires": summary.false_fires}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--wheel", type=pathlib.Path, help=f"the {WHEEL} wheel (default: downloaded into --cache)")
    ap.add_argument("--cache", type=pathlib.Path, default=pathlib.Path.home() / ".cache" / "sidecar" / "bench")
    ap.add_argument("--learn-fraction", type=float, default=0.5, help="the share of conversations learned from")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=pathlib.Path, help="keep the catalog and the two chat logs here")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    args.cache.mkdir(parents=True, exist_ok=True)
    catalog, convs = convert(args.wheel or fetch(args.cache))
    order = np.random.default_rng(args.seed).permutation(len(convs))
    cut = int(len(convs) * args.learn_fraction)
    first, rest = [convs[i] for i in order[:cut]], [convs[i] for i in order[cut:]]
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or pathlib.Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"catalog": out / "catalog.json", "first": out / "first.jsonl", "rest": out / "rest.jsonl"}
        paths["catalog"].write_text(json.dumps(catalog, indent=1) + "\n")
        for key, part in (("first", first), ("rest", rest)):
            paths[key].write_text("".join(json.dumps(c) + "\n" for c in part))
        overrides = {("catalogs",): [str(paths["catalog"])], ("store",): str(pathlib.Path(tmp) / "bench.db")}
        if args.model:
            overrides[("model", "name")] = args.model
        cfg = config_mod.load(env={}, overrides=overrides)
        engine = Sidecar.open(cfg, store=open_store(cfg.store), progress=False)
        played = read_transcripts([paths["rest"]], engine.catalog)
        before = figures(replay(engine, played)[1])
        turns, examples = log_examples(engine.pipeline, read_transcripts([paths["first"]], engine.catalog))
        traffic_log(engine).add(examples)  # what `sidecar learn --from` does
        outcome = apply_learned(engine)  # what `serve` and `replay` then do
        lesson = engine.pipeline.learned
        after = figures(replay(engine, played)[1])
        rules = len(engine.sequences)
        engine.pipeline.learned = None
        sequences_only = figures(replay(engine, played)[1])
        baselines = baselines_top_k(engine, played)
    result = {"model": engine.pipeline.embedder.name, "conversations": {"learned": len(first), "replayed": len(rest)},
              "turns_learned": len(turns), "untuned": before, "learned": after, "learned_sequences_only": sequences_only,
              "lesson_in_use": lesson is not None, "sequence_rules": rules, "plain_cosine_top_k": baselines["cosine"],
              "bm25_top_k": baselines["bm25"]}  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{result['model']}: learned from {len(first)} conversations ({len(turns)} user turns), replayed {len(rest)}")
    for label, f in (("untuned", before), ("learned (lesson + sequences)", after), ("learned sequences only", sequences_only)):
        print(f"  {label:30s} recall {f['recall']:.3f}  precision {f['precision']:.3f}  exact set {f['exact_set']:.3f}  "
              f"injected {f['injections']}  false fires {f['false_fires']}")  # fmt: skip
    print(f"  lesson in use: {lesson is not None} ({outcome.reason or 'passed'}); {rules} sequence rules")
    for kind, name in (("cosine", "plain cosine"), ("bm25", "BM25")):
        for label, f in baselines[kind].items():
            print(f"  {name} top-k, {label:10s} recall {f['recall']:.3f}  precision {f['precision']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
