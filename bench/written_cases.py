"""What written cases buy a catalog that ships descriptions only, untuned, beside descriptions
alone, plain cosine and BM25 of the same run (issue 48).

    python bench/written_cases.py intents [--model M]   # Banking77, HWU64: no cases / written / their own (human)
    python bench/written_cases.py tau                    # tau-bench airline: each real user turn, the tools the agent then called
    python bench/written_cases.py bfcl                   # BFCL live's real users against its 739 functions
    python bench/written_cases.py servers                # the corpus's held-out servers against ALL.json: packs off / on
    python bench/written_cases.py standin --set seal-tools|bfcl-live   # one split's requests as the tools' cases, the other judged
    python bench/written_cases.py tau --also gemma-270m --also gemma-270m-raw   # + rows for sets/<set>.LABEL.json
    python bench/written_cases.py intents --only banking77 --also gemma-270m --limit 1000

Every row is one `sidecar eval --json` in its own process on the same store (the embedding
cache is shared, so a later row embeds only what is new). Written cases come from
fixtures/cases/ (sets/ for the outside sets, the shipped packs for the servers); outside data
from ../shared/data/ (`--data`). `--limit N` judges a hash-picked N texts of each set.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
CASES = ROOT / "fixtures" / "cases"


def _picked(lines: list[dict], limit: int | None) -> list[dict]:
    if not limit or len(lines) <= limit:
        return lines
    return sorted(lines, key=lambda x: hashlib.sha256(x["text"].encode()).hexdigest())[:limit]


def _write_jsonl(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _catalog(path: pathlib.Path, tools: list[dict], server: str | None = None) -> pathlib.Path:
    path.write_text(json.dumps({"server": server, "tools": tools} if server else {"tools": tools}))
    return path


def _eval(catalogs: list[pathlib.Path], labeled: pathlib.Path, store: pathlib.Path, model: str | None, fill: bool, work: pathlib.Path) -> dict:
    cfg = work / ("fill.toml" if fill else "nofill.toml")
    cfg.write_text(f"[cases]\nfill = {'true' if fill else 'false'}\n")
    cmd = [sys.executable, "-m", "sidecar", "eval", "--config", str(cfg), "--store", str(store), "--labeled", str(labeled), "--json", "-q"]
    for c in catalogs:
        cmd += ["--catalog", str(c)]
    if model:
        cmd += ["--model", model]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)}\n{out.stderr[-2000:]}")
    report = json.loads(out.stdout)
    report["wall_s"] = time.perf_counter() - t0
    return report


HEADER = ("| set | cases | gate TP / FP | balanced accuracy | AUROC | right tool first | MRR | injected set recall / precision "
          "| plain cosine: top-1, gate AUROC | BM25 top-1 | wall |\n|---|---|---|---|---|---|---|---|---|---|---|")


def _row(name: str, variant: str, r: dict) -> str:
    g, k = r["gate"], r["ranking"]
    base = {b["kind"]: b["ranking"] for b in r.get("baselines", [])}
    gb = r.get("gate_baseline") or {}
    sets = r.get("sets")
    s = f"{sets['recall']:.2f} / {sets['precision']:.2f}" if sets else "–"
    auroc = f"{g['auroc']:.3f}" if g["negatives"] else "–"
    bal = f"{g['balanced_accuracy']:.3f}" if g["negatives"] else "–"
    return (f"| {name} | {variant} | {g['tp_rate']:.1%} / {g['fp_rate']:.1%} | {bal} | {auroc} | {k['top1']:.1%} | {k['mrr']:.3f} | {s} "
            f"| {base.get('cosine', {}).get('top1', float('nan')):.1%}, {gb.get('auroc', float('nan')):.3f} "
            f"| {base.get('bm25', {}).get('top1', float('nan')):.1%} | {r['wall_s']:.0f} s |")


def _tools(path: pathlib.Path) -> list[dict]:
    data = json.loads(path.read_text())
    return data["tools"] if isinstance(data, dict) else data


def _written(name: str) -> dict:
    return json.loads((CASES / "sets" / f"{name}.json").read_text())["tools"]


def _with(tools: list[dict], written: dict) -> list[dict]:
    """The tools with their written requests; a tool the writer left out keeps its description alone."""
    return [{**t, "cases": written[t["name"]]["requests"]} if t["name"] in written else t for t in tools]


def _also(args, name: str, tools: list[dict]) -> dict[str, list[dict]]:
    """Rows for the other written sets asked for (`--also LABEL`: fixtures/cases/sets/NAME.LABEL.json)."""
    out = {}
    for label in args.also or ():
        written = _written(f"{name}.{label}")
        out[f"written: {label} ({len(written)} of {len(tools)} tools)"] = _with(tools, written)
    return out


def intents(args, work: pathlib.Path, store: pathlib.Path) -> None:
    print(HEADER)
    for name in args.only or ("banking77", "hwu64"):
        tools = _tools(args.data / f"{name}.catalog.json")
        written = _written(name)
        labeled = _write_jsonl(work / f"{name}.jsonl", _picked([json.loads(x) for x in (args.data / f"{name}.test.jsonl").open()], args.limit))
        bare = [{k: v for k, v in t.items() if k != "cases"} for t in tools]
        variants = {
            "descriptions only": bare,
            "written (no human cases)": _with(bare, written),
            **_also(args, name, bare),
            "their own (30 human cases a tool)": tools,
        }
        for i, (variant, ts) in enumerate(variants.items()):
            cat = _catalog(work / f"{name}-{i}.json", ts)
            print(_row(name, variant, _eval([cat], labeled, store, args.model, True, work)), flush=True)


def tau_items(data: pathlib.Path) -> list[dict]:
    """Each user turn of the real conversations, with the tools the agent called before the
    next user turn (`calls`, in order; `expect` any of them), or null when it called none."""
    rows = [json.loads(x) for x in (data / "tau-airline.transcript.jsonl").open()]
    items: list[dict] = []
    current: dict | None = None
    for r in rows:
        if r["role"] == "user":
            current = {"text": r["content"], "calls": [], "conversation": r["conversation"]}
            items.append(current)
        elif current is not None and r["conversation"] == current["conversation"]:
            current["calls"].extend(c["name"] for c in r.get("tool_calls") or ())
    out = []
    for it in items:
        if not it["text"].strip():
            continue
        calls = it["calls"]
        uniq = list(dict.fromkeys(calls))
        row = {"text": it["text"], "expect": (uniq[0] if len(uniq) == 1 else uniq) if uniq else None, "source": "user"}
        if calls:
            row["calls"] = calls
        out.append(row)
    return out


def _descriptions_vs_written(args, work: pathlib.Path, store: pathlib.Path, name: str, label: str, lines: list[dict]) -> None:
    print(HEADER)
    tools = _tools(args.data / f"{name}.catalog.json")
    written = _written(args.written or name)
    labeled = _write_jsonl(work / f"{name}.jsonl", _picked(lines, args.limit))
    variants = {"descriptions only": tools, "written by Claude": _with(tools, written), **_also(args, args.written or name, tools)}
    for i, (variant, ts) in enumerate(variants.items()):
        cat = _catalog(work / f"{name}-{i}.json", ts, name)
        print(_row(label, variant, _eval([cat], labeled, store, args.model, True, work)), flush=True)


def tau(args, work: pathlib.Path, store: pathlib.Path) -> None:
    _descriptions_vs_written(args, work, store, "tau-airline", "tau-airline user turns", tau_items(args.data))


def bfcl(args, work: pathlib.Path, store: pathlib.Path) -> None:
    """BFCL live's real users against its whole catalog of 739 functions."""
    lines = [json.loads(x) for x in (args.data / "bfcl-live.jsonl").open()]
    _descriptions_vs_written(args, work, store, "bfcl-live", "BFCL live, whole catalog", lines)


def servers(args, work: pathlib.Path, store: pathlib.Path) -> None:
    print(HEADER)
    for labeled in args.labeled or [ROOT / "fixtures/corpus/heldout.jsonl"]:
        lab = _write_jsonl(work / "servers.jsonl", _picked([json.loads(x) for x in pathlib.Path(labeled).open()], args.limit))
        for variant, fill in (("descriptions only", False), ("shipped packs", True)):
            r = _eval([ROOT / "fixtures/catalogs/ALL.json"], lab, store, args.model, fill, work)
            print(_row(pathlib.Path(labeled).name, variant, r), flush=True)


def standin(args, work: pathlib.Path, store: pathlib.Path) -> None:
    """The ceiling a writer aims at: requests written for the same tools (Seal-Tools: its tune
    split, written by an LLM; BFCL live: half of its real users' requests, picked by hash) as
    the tools' cases, the other split judged."""
    print(HEADER)
    name = args.set
    tools = _tools(args.data / f"{name}.catalog.json")
    if name == "seal-tools":
        teach = [json.loads(x) for x in (args.data / "seal-tools.tune.jsonl").open()]
        judge = [json.loads(x) for x in (args.data / "seal-tools.test.jsonl").open()]
    else:
        lines = [json.loads(x) for x in (args.data / f"{name}.jsonl").open()]
        half = lambda x: int(hashlib.sha256(x["text"].encode()).hexdigest(), 16) % 2  # noqa: E731
        teach, judge = [x for x in lines if half(x) == 0], [x for x in lines if half(x) == 1]
    cases: dict[str, list[str]] = {}
    for x in teach:
        expect = x["expect"]
        for t in [expect] if isinstance(expect, str) else expect or ():
            cases.setdefault(t, []).append(x["text"])
    labeled = _write_jsonl(work / f"{name}-judge.jsonl", _picked(judge, args.limit))
    with_cases = sum(1 for t in tools if t["name"] in cases)
    for variant, ts in {"descriptions only": tools,
                        f"stand-in cases ({with_cases} of {len(tools)} tools)": [{**t, "cases": cases[t["name"]][:24]} if t["name"] in cases else t for t in tools]}.items():  # fmt: skip
        cat = _catalog(work / f"{name}-{len(variant)}.json", ts)
        print(_row(name, variant, _eval([cat], labeled, store, args.model, True, work)), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("intents", "tau", "bfcl", "servers", "standin"))
    ap.add_argument("--written", help="tau, bfcl: the written cases of fixtures/cases/sets/WRITTEN.json (default: the set's own name)")
    ap.add_argument("--also", action="append", help="a row more for fixtures/cases/sets/<set>.ALSO.json (repeatable)")
    ap.add_argument("--only", action="append", choices=("banking77", "hwu64"), help="intents: these sets only")
    ap.add_argument("--set", choices=("seal-tools", "bfcl-live"), default="seal-tools")
    ap.add_argument("--model")
    ap.add_argument("--data", type=pathlib.Path, default=ROOT.parent / "shared" / "data")
    ap.add_argument("--labeled", action="append", help="servers: labelled sets against ALL.json (default fixtures/corpus/heldout.jsonl)")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--store", type=pathlib.Path, help="the store every row shares (default: a temporary file)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        store = args.store or work / "store.db"
        {"intents": intents, "tau": tau, "bfcl": bfcl, "servers": servers, "standin": standin}[args.what](args, work, store)


if __name__ == "__main__":
    main()
