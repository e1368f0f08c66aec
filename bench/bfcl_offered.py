"""Write the README's `tune` example: real users' BFCL live questions, each judged against the
functions offered with it (fixtures/labeled/bfcl-live-offered.jsonl), and the catalog of those
functions (fixtures/labeled/bfcl-live-offered.catalog.json).

BFCL (ShishirPatil/gorilla, Apache License 2.0) offers each question a few functions; its
irrelevance items offer functions none of which answers the question (`expect: null`). The
sample takes whole offered sets: an item is kept when a hash of its set's sorted function
names falls under SHARE, so every set comes with all its items, the null ones included, and
the catalog is just the functions of the kept sets (in the group catalog's order). Questions
longer than MAX_CHARS (7 of them, pasted documents of up to 10,759 characters) are left out:
with nomic they cost a third of the embedding time of all the others. Lines keep
`id` and `offered` (`tune` and `eval` judge each text against only its own functions). Reads
the project's converted copy of the leaderboard's live files (see ../shared/data/README.md);
re-running gives the same files byte for byte.

    python bench/bfcl_offered.py [DATA_DIR [OUT_DIR]]   (default: ../shared/data, fixtures/labeled)
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHARE = 0.34  # of the offered sets: ~750 questions, ~340 functions
MAX_CHARS = 1000


def share(key: str) -> float:
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 2**32


def main(data: pathlib.Path, out: pathlib.Path) -> None:
    items = [json.loads(line) for line in (data / "bfcl-live.items.jsonl").read_text().splitlines() if line.strip()]
    group = json.loads((data / "bfcl-live.catalog.json").read_text())
    kept = [i for i in items if share(json.dumps(sorted(i["offered"]))) < SHARE and len(i["text"]) <= MAX_CHARS]
    names = {n for i in kept for n in i["offered"]}
    tools = [t for t in group["tools"] if t["name"] in names]
    missing = names - {t["name"] for t in tools}
    if missing:
        raise SystemExit(f"offered functions not in the group catalog: {sorted(missing)[:5]}")
    (out / "bfcl-live-offered.catalog.json").write_text(json.dumps({"server": group["server"], "tools": tools}, indent=1, ensure_ascii=False) + "\n")
    lines = [{"id": i["id"], "text": i["text"], "expect": i["expect"], "source": i["source"], "offered": i["offered"]} for i in kept]
    (out / "bfcl-live-offered.jsonl").write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))
    nulls = sum(i["expect"] is None for i in kept)
    sets = len({json.dumps(sorted(i["offered"])) for i in kept})
    print(f"{len(kept)} of {len(items)} items ({len(kept) - nulls} asking for a function, {nulls} for none), {sets} offered sets, {len(tools)} functions")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(pathlib.Path(args[0]) if args else ROOT.parent / "shared" / "data", pathlib.Path(args[1]) if len(args) > 1 else ROOT / "fixtures" / "labeled")
