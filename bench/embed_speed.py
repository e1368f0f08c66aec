"""Embedding speed of a model's variants (f16, q8_0, q4_k_m), side by side in one run.

    .venv/bin/python bench/embed_speed.py [--model all-minilm-l6-v2] [--variants f16,q8_0,q4_k_m]
                                          [--texts 96] [--rounds 3] [--no-flash-attn] [--json]

Texts are the first --texts of fixtures/corpus/heldout.jsonl (short chat texts, as the gate
judges them). Each round measures every variant in turn, so a load change on the shared
machine hits all of them alike: "single" embeds the texts one call each (the gate's case),
"batch" in calls of 64 (index builds, the server's batches). Reported per variant: texts/s
by wall clock and by this process's CPU time (the latter is what the model costs, whatever
else runs), the median over rounds, and the lowest cosine of its vectors to the f16 ones.
One llama.cpp thread each (embed.default_threads on these 2 cores).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import msgspec
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sidecar.core import models  # noqa: E402
from sidecar.core.embed import Embedder  # noqa: E402


class Speed(msgspec.Struct):
    model: str
    variant: str
    size_mb: float
    single_per_s: float  # wall clock
    single_per_cpu_s: float  # per second of this process's CPU time
    batch_per_s: float
    batch_per_cpu_s: float
    min_cosine_to_f16: float


def rate(fn, n: int) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return n / (time.perf_counter() - w), n / max(time.process_time() - c, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=models.SMALL_MODEL)
    ap.add_argument("--variants", default=",".join(models.VARIANTS))
    ap.add_argument("--texts", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--no-flash-attn", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    lines = (ROOT / "fixtures" / "corpus" / "heldout.jsonl").read_bytes().splitlines()
    texts = [msgspec.json.decode(ln)["text"] for ln in lines[: args.texts]]
    loaded: dict[str, Embedder] = {}
    for v in args.variants.split(","):
        r = models.resolve(f"{args.model}:{v}", progress=False)  # NAME:f16 is the f16 file; a plain NAME may load bf16
        loaded[v] = Embedder(r.path, name=r.name, identity=r.spec.sha256 or r.name, threads=1, prefixes=r.spec.task_prefixes,
                             max_tokens=r.spec.n_ctx, flash_attn=not args.no_flash_attn)  # fmt: skip
        loaded[v].embed(texts[:8])  # warm up
    runs: dict[str, list[tuple[float, float, float, float]]] = {v: [] for v in loaded}
    vectors: dict[str, np.ndarray] = {}
    for _ in range(args.rounds):
        for v, emb in loaded.items():
            single = rate(lambda e=emb: [e.embed([t]) for t in texts], len(texts))
            out: list[np.ndarray] = []
            batch = rate(lambda e=emb, o=out: o.extend(e.embed(texts[i : i + args.batch]).vectors for i in range(0, len(texts), args.batch)),
                         len(texts))  # fmt: skip
            vectors[v] = np.vstack(out)
            runs[v].append((*single, *batch))
    ref = vectors.get("f16")
    rows = []
    for v, emb in loaded.items():
        med = [statistics.median(col) for col in zip(*runs[v])]
        cos = float(np.min(np.sum(vectors[v] * ref, axis=1))) if ref is not None else float("nan")
        rows.append(Speed(args.model, v, pathlib.Path(emb.path).stat().st_size / 1e6, *med, cos))
    if args.json:
        sys.stdout.buffer.write(msgspec.json.encode(rows) + b"\n")
        return
    fa = "off" if args.no_flash_attn else "on"
    print(f"{args.model}, {len(texts)} texts, {args.rounds} rounds, flash attention {fa}; texts/s (wall | per CPU s)")
    print(f"{'variant':<8} {'MB':>6} {'single':>16} {'batch of ' + str(args.batch):>16} {'min cos to f16':>15}")
    for r in rows:
        print(f"{r.variant:<8} {r.size_mb:>6.0f} {r.single_per_s:>7.1f} | {r.single_per_cpu_s:>6.1f} {r.batch_per_s:>7.1f} | {r.batch_per_cpu_s:>6.1f} {r.min_cosine_to_f16:>15.5f}")


if __name__ == "__main__":
    main()
