"""Learning from traffic, measured (issue 30 item 2): a labelled set is played as a chat log in
a seeded order; the first part is what the server saw (each turn with the tool called after it,
or none), the rest is judged before and after learning from it.

    python bench/learn_from_traffic.py --catalog ../shared/data/bfcl-live.catalog.json \
        --labeled ../shared/data/bfcl-live.jsonl [--model all-minilm-l6-v2] [--json]

Recall: the share of turns that called a tool whose inject holds it. Precision: the share of
injects (turns that fired) holding a tool the turn called. Both beside plain cosine with one
threshold fitted on the same first part (the simplest learner from the same examples).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import msgspec
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from sidecar.core import catalog as catalog_mod  # noqa: E402
from sidecar import config as config_mod  # noqa: E402
from sidecar.engine import Sidecar  # noqa: E402
from sidecar.lab.evaluate import read_labeled  # noqa: E402
from sidecar.core.pipeline import Request  # noqa: E402
from sidecar.store import open_store  # noqa: E402
from sidecar.learn.traffic import Example, TrafficFit, best_bar  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--catalog", required=True)
    ap.add_argument("--labeled", required=True)
    ap.add_argument("--model")
    ap.add_argument("--learn-fraction", type=float, default=0.5, help="the first part of the log learned from")
    ap.add_argument("--seed", type=int, default=0, help="the order the turns are played in")
    ap.add_argument("--limit", type=int, help="play at most this many turns")
    ap.add_argument("--store", help="embedding cache (default: the user's store)")
    ap.add_argument("--objective", choices=("recall", "f1"), default="recall", help="what the lesson's bar is chosen for ([learn] objective)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    cfg = config_mod.load(None, overrides={("index", "query_cache"): 100_000, ("model", "name"): args.model})
    cat = catalog_mod.load([args.catalog])
    items = read_labeled(args.labeled, cat)
    order = np.random.default_rng(args.seed).permutation(len(items))
    items = [items[i] for i in order][: args.limit]
    cut = int(len(items) * args.learn_fraction)
    learn, test = items[:cut], items[cut:]

    engine = Sidecar.open(cfg, catalog=cat, store=open_store(args.store or cfg.store), progress=False, history=False)
    pipe = engine.pipeline
    vectors = pipe.queries.embed(pipe.embedder, [it.text for it in items]).vectors
    examples = [Example(it.text, first_tool(it), vectors[i]) for i, it in enumerate(learn)]
    lesson, outcome = TrafficFit(objective=args.objective).fit(pipe, examples)

    before = judged(engine, test)
    pipe.learned = lesson
    after = judged(engine, test)
    pipe.learned = None
    cosine = cosine_baseline(pipe, vectors[:cut], learn, vectors[cut:], test, outcome.calibration.precision, args.objective)
    out = {
        "catalog": args.catalog, "labeled": args.labeled, "model": pipe.embedder.name, "seed": args.seed,
        "learned_from": {"turns": len(learn), "called": sum(it.positive for it in learn)},
        "reported_on": {"turns": len(test), "called": sum(it.positive for it in test)},
        "fit": msgspec.to_builtins(outcome),
        "before": before, "after": after if lesson is not None else before, "plain_cosine_fitted_bar": cosine,
    }  # fmt: skip
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{out['model']}: learned from {len(learn)} turns, reported on {len(test)}; fit: {outcome.reason or 'swapped in'} "
              f"(out of fold on the learned part: recall/precision {outcome.calibration.recall:.3f}/{outcome.calibration.precision:.3f} "
              f"-> {outcome.learned.recall:.3f}/{outcome.learned.precision:.3f}, bar {outcome.bar})")  # fmt: skip
        for name in ("before", "after", "plain_cosine_fitted_bar"):
            r = out[name]
            print(f"  {name:24s} recall {r['recall']:.1%}  precision {r['precision']:.1%}  top-1 {r['top1']:.1%}  silent on none {r['silent']:.1%}")
    return 0


def first_tool(item) -> str | None:
    if item.expect is None:
        return None
    return item.expect if isinstance(item.expect, str) else item.expect[0]


def judged(engine: Sidecar, items) -> dict[str, float]:
    js = engine.judge([Request(it.text, it.source) for it in items], rank_silent=True)
    injects = [{r.tool for r in j.inject(engine.cfg.server.inject_margin)} for j in js]
    firsts = [j.ranked.results[0].tool if j.ranked and j.ranked.results else None for j in js]
    return rates(items, injects, firsts)


def rates(items, injects: list[set[str]], firsts: list[str | None]) -> dict[str, float]:
    pos = [i for i, it in enumerate(items) if it.positive]
    neg = [i for i, it in enumerate(items) if not it.positive]
    fired = [i for i, s in enumerate(injects) if s]
    hit = lambda i: bool(injects[i] & items[i].expected)  # noqa: E731
    return {
        "recall": sum(hit(i) for i in pos) / max(len(pos), 1),
        "precision": sum(hit(i) for i in fired) / max(len(fired), 1),
        "top1": sum(firsts[i] in items[i].expected for i in pos) / max(len(pos), 1),
        "silent": sum(not injects[i] for i in neg) / max(len(neg), 1),
        "fired": len(fired) / max(len(items), 1),
    }


def cosine_baseline(pipe, learn_vectors, learn, test_vectors, test, precision: float, objective: str = "recall") -> dict[str, float]:
    """Plain cosine to each tool's description, its single best tool injected, one bar fitted
    on the learned part as the lesson's is: the best `objective` at no less than `precision` (the
    calibration's there); with none, the best balanced score of right-tool-fired and none-silent."""
    index = pipe.index_for("user")

    def best(v):
        cos = v @ index.primary.T
        return cos.max(axis=1), [index.names[j] for j in cos.argmax(axis=1)]

    s, first = best(learn_vectors)
    truth = [first_tool(it) for it in learn]
    bar = best_bar(s, first, truth, precision, objective=objective)
    if bar is None:
        cuts = np.unique(np.round(s, 4))
        bar = float(cuts[int(np.argmax([balanced(s, first, truth, c) for c in cuts]))])
    s, first = best(test_vectors)
    injects = [{t} if x >= bar else set() for x, t in zip(s, first)]
    return {**rates(test, injects, first), "bar": bar}


def balanced(s, first, truth, bar) -> float:
    """The mean of the called turns' share with their tool fired and the silent turns' share left silent."""
    fired = s >= bar
    called = [f and t == g for f, t, g in zip(fired, first, truth) if g is not None]
    silent = [not f for f, g in zip(fired, truth) if g is None]
    return float(np.mean([np.mean(x) for x in (called, silent) if x]))


if __name__ == "__main__":
    raise SystemExit(main())
