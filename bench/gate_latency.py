"""Per-phrase gate latency for each model: median and p99, split into regex, embedding
and cosine time. One phrase at a time, as a user turn or a clause of LLM output arrives.

    python bench/gate_latency.py [--catalog FILE...] [--models NAME...] [--repeat N]

Phrases are the labelled dev set's texts; the catalog defaults to all 32 real servers.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import msgspec
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sidecar import config
from sidecar.core import pipeline  # noqa: E402


class Item(msgspec.Struct):
    text: str
    expect: str | list[str] | None = None
    source: str = "user"


def load_items(path: pathlib.Path) -> list[Item]:
    return [msgspec.json.decode(line, type=Item) for line in path.read_bytes().splitlines() if line.strip()]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--catalog", nargs="+", default=[str(ROOT / "fixtures/catalogs/ALL.json")])
    ap.add_argument("--models", nargs="+", default=["all-minilm-l6-v2", "nomic-embed-text-v1.5"])
    ap.add_argument("--phrases", default=str(ROOT / "fixtures/labeled/dev.jsonl"))
    ap.add_argument("--repeat", type=int, default=2, help="passes over the phrases (the first warms caches)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    items = load_items(pathlib.Path(args.phrases))
    print(f"{len(items)} phrases, catalog {', '.join(pathlib.Path(c).name for c in args.catalog)}, repeat {args.repeat}")
    header = f"{'model':<24}{'stage':<8}{'p50 ms':>9}{'p99 ms':>9}{'mean ms':>9}"
    for name in args.models:
        cfg = config.load(None, overrides={("catalogs",): args.catalog, ("model", "name"): name, ("model", "threads"): args.threads})
        pipe = pipeline.from_config(cfg, progress=False)
        idx = pipe.index_for("user")
        print(f"\n{name}: dim {pipe.embedder.dim}, {len(idx)} tools, {len(idx.texts)} user rows, "
              f"{len(pipe.index_for('llm').texts)} llm rows, threads {pipe.embedder.threads}")
        stages: dict[str, list[float]] = {"regex": [], "embed": [], "cosine": [], "total": []}
        for r in range(args.repeat):
            for it in items:
                d = pipe.detect(it.text, it.source)
                if r == 0:
                    continue  # warm-up pass
                stages["regex"].append(d.timing_ms.regex)
                if d.timing_ms.embed:  # blocked phrases never reach the model
                    stages["embed"].append(d.timing_ms.embed)
                    stages["cosine"].append(d.timing_ms.cosine)
                stages["total"].append(d.timing_ms.total)
        print(header)
        for stage, vals in stages.items():
            print(f"{name:<24}{stage:<8}{pct(vals, 50):>9.3f}{pct(vals, 99):>9.3f}{statistics.fmean(vals) if vals else 0:>9.3f}")
        print(f"{'':<24}({len(stages['total'])} decisions, {len(stages['embed'])} embedded)")


if __name__ == "__main__":
    main()
