"""Would a lesson from traffic help replies? (issue 49, item 1: learn which reply sentences
precede which calls.) Measured before building it into the server: one chat log is replayed
as it is (untuned, the defaults), and each span of a reply that injected is kept with what
followed it: the tools that reply called, or none. The spans of the first log are the
lesson; each inject of the second log is then judged by its nearest spans of the first
(cosine of the pipeline's own query vectors) in three ways:

* `silent neighbours`: dropped when most of its k nearest learned spans called nothing;
* `tool of the neighbours`: its tool replaced by the one the nearest called spans called,
  when that span is nearer than `--near`;
* both.

Beside them the replies as shipped. Precision: injected tools the reply called; recall: the
replies' calls injected by the reply itself (`replay`'s `by_role`).

    python bench/reply_lesson.py --catalog ../shared/data/tau-airline.catalog.json \\
        --learn first.jsonl --judge second.jsonl [--model NAME] [--json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from sidecar import config as config_mod  # noqa: E402
from sidecar.core import catalog as catalog_mod  # noqa: E402
from sidecar.core.stream import Segmenter  # noqa: E402
from sidecar.engine import Sidecar  # noqa: E402
from sidecar.replay import replay  # noqa: E402
from sidecar.store import open_store  # noqa: E402
from sidecar.transcripts import read_transcripts  # noqa: E402


def reply_spans(engine: Sidecar, path: str) -> tuple[list[dict], int]:
    """Each inject a reply made, with the span that made it and what the reply called; and how
    many distinct calls the replies made (recall's denominator)."""
    convs = read_transcripts([path], engine.catalog)
    detections, summary = replay(engine, convs)
    by_id = {c.id: c for c in convs}
    limits = engine.cfg.server
    out = []
    for d in detections:
        if d.role != "assistant":
            continue
        text = by_id[d.conversation].messages[d.message].content or ""
        seg = Segmenter(limits.span_words, limits.max_stream_chars, rejudge_unchanged=limits.rejudge_unchanged)
        spans = seg.feed(text) + seg.end()
        span = min(spans, key=lambda s: (abs(s.end - d.at_char), -s.end)) if spans else None
        out.append({"span": span.text if span else text[: d.at_char], "tools": d.tools, "truth": d.truth})
    calls = sum(len({c.name for c in m.tool_calls or ()}) for c in convs for m in c.messages if m.role == "assistant")
    return out, calls


def figures(injects: list[tuple[list[str], list[str]]], calls: int) -> dict[str, float]:
    tools = sum(len(t) for t, _ in injects)
    right = sum(sum(x in truth for x in t) for t, truth in injects)
    return {"tools": tools, "precision": round(right / tools, 3) if tools else float("nan"), "recall": round(right / calls, 3) if calls else float("nan")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--catalog", required=True)
    ap.add_argument("--learn", required=True, help="chat log the lesson is taken from")
    ap.add_argument("--judge", required=True, help="chat log judged")
    ap.add_argument("--model")
    ap.add_argument("-k", type=int, default=3, help="neighbours that vote on silence")
    ap.add_argument("--near", type=float, default=0.85, help="cosine past which the nearest called span's tool is taken")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    cfg = config_mod.load(None, overrides={("model", "name"): args.model})
    cat = catalog_mod.load([args.catalog])
    with tempfile.TemporaryDirectory() as tmp:
        engine = Sidecar.open(cfg, catalog=cat, store=open_store(str(pathlib.Path(tmp) / "s.db")), progress=False)
        learned, _ = reply_spans(engine, args.learn)
        judged, calls = reply_spans(engine, args.judge)
        pipe = engine.pipeline
        embed = lambda rows: pipe.queries.embed(pipe.embedder, [r["span"] for r in rows]).vectors  # noqa: E731
        lv, jv = embed(learned), embed(judged)
    called = np.array([bool(r["truth"]) for r in learned])
    sims = jv @ lv.T
    k = min(args.k, len(learned))
    nearest = np.argsort(-sims, axis=1)[:, :k]
    silent_vote = (~called[nearest]).sum(axis=1) > k / 2
    shipped = [(r["tools"], r["truth"]) for r in judged]
    quiet = [(r["tools"], r["truth"]) for r, s in zip(judged, silent_vote) if not s]

    def retooled(rows):
        out = []
        for i, r in rows:
            c = np.where(called, sims[i], -1.0)
            j = int(c.argmax())
            tool = learned[j]["truth"][0] if c[j] >= args.near else r["tools"][0]
            out.append(([tool], r["truth"]))
        return out

    result = {
        "model": pipe.embedder.name, "learned_spans": len(learned), "learned_called": int(called.sum()), "judged_spans": len(judged),
        "replies_calls": calls, "k": k, "near": args.near,
        "shipped": figures(shipped, calls),
        "silent_neighbours": figures(quiet, calls),
        "tool_of_the_neighbours": figures(retooled(list(enumerate(judged))), calls),
        "both": figures(retooled([(i, r) for i, (r, s) in enumerate(zip(judged, silent_vote)) if not s]), calls),
    }  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{result['model']}: {len(learned)} reply spans learned from ({int(called.sum())} followed by a call), {len(judged)} judged")
        for name in ("shipped", "silent_neighbours", "tool_of_the_neighbours", "both"):
            f = result[name]
            print(f"  {name:24s} tools {f['tools']:4d}  precision {f['precision']:.3f}  recall {f['recall']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
