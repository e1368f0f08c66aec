"""Write a "should a tool fire" set from an outside labelled set: its tool requests (a seeded
sample) beside the corpus' held-out "no tool" talk (`fixtures/corpus/heldout.jsonl` lines of
no server; never seen in fitting the built-in calibrations).

Outside sets' own "no tool" labels are loose (BFCL's irrelevance items are often requests that
another function of the catalog serves; Banking77's out-of-scope queries are banking
requests), so their gate figures mix two questions. This set asks one: real requests over a
catalog nobody here wrote, against talk that needs no tool.

    python bench/notool_mix.py ../shared/data/bfcl-live.jsonl --n 700 --out live-mix.jsonl
    sidecar eval --catalog ../shared/data/bfcl-live.catalog.json --labeled live-mix.jsonl
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTOOL = ROOT / "fixtures" / "corpus" / "heldout.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("labeled", help="an outside labelled set (JSONL: text, expect, source)")
    ap.add_argument("--n", type=int, help="requests sampled from it (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    keep = ("text", "expect", "source")
    requests = [{k: v for k, v in json.loads(line).items() if k in keep}
                for line in open(args.labeled, encoding="utf-8") if line.strip()]  # fmt: skip
    requests = [r for r in requests if r["expect"] is not None]
    random.Random(args.seed).shuffle(requests)
    requests = requests[: args.n] if args.n else requests
    talk = [{k: v for k, v in d.items() if k in keep} for d in map(json.loads, NOTOOL.read_text().splitlines()) if "group" not in d]
    with open(args.out, "w", encoding="utf-8") as f:
        for row in requests + talk:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"{args.out}: {len(requests)} requests, {len(talk)} texts needing none")


if __name__ == "__main__":
    main()
