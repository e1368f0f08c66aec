"""Fitting the ranker's views added after a calibration was fitted, its own weights held.

A new view (the action views, `sidecar/core/actions.py`; the argument view, `sidecar/core/arguments.py`) gets weight 0 from a calibration fitted
before it. Refitting the whole calibration moves everything at once (the adapter, the gate
head, the thresholds: every table that rests on the built-in calibration must be measured
again; the fit itself is about 3 minutes a model on two cores with the corpus' vectors in the
store); this fits only the added weights, by the same listwise softmax (`RankerFit`, `fixed`), on
the built-in ranker's views of the same fit set (adapter applied, as the ranker sees them).
It reports the fit set's top-1 out of fold (whole servers held out, as `tune` folds them)
before and after, so a view that does not carry to servers it was not fitted on shows.

    python -m sidecar.lab.extend --model M [--write]   # fixtures/corpus/fit.jsonl, fit-catalog.json
"""

from __future__ import annotations

import argparse
import pathlib
import re
from collections.abc import Sequence

import msgspec
import numpy as np

from ..core import catalog as catalog_mod
from .. import config as config_mod
from ..config import Config
from ..learn.learned import RANK_FEATURES, RankerFit
from ..core.pipeline import Request, from_config
from .evaluate import Labeled, read_labeled
from .tune import FOLDS, _folds, query_vectors

ROOT = pathlib.Path(__file__).resolve().parents[2]


class AddedFit(msgspec.Struct, frozen=True):
    """The ranker's weights with the added views', and the fit set's top-1 out of fold."""

    weights: tuple[float, ...]
    top1_before: float  # the held weights alone (added views at 0)
    top1_after: float  # added views fitted without the texts' servers
    fold_weights: list[tuple[float, ...]]
    n: int


def hits(features: np.ndarray, targets: Sequence[Sequence[int]], weights: Sequence[float]) -> np.ndarray:
    """Per text, whether `weights` rank one of its expected tools first (missing weights 0)."""
    w = np.zeros(features.shape[-1])
    w[: len(weights)] = weights
    best = np.argmax(features @ w, axis=1)
    return np.array([b in t for b, t in zip(best, targets)], bool)


def top1(features: np.ndarray, targets: Sequence[Sequence[int]], weights: Sequence[float]) -> float:
    return float(hits(features, targets, weights).mean()) if len(targets) else float("nan")


def fit_added(features: np.ndarray, targets: Sequence[Sequence[int]], base: Sequence[float], folds: np.ndarray) -> AddedFit:
    """`features` (n, tools, views) of tool requests, `base` the weights held (the first views')."""
    oof = np.zeros(len(targets), bool)
    fold_weights = []
    for f in range(FOLDS):
        train, test = np.flatnonzero(folds != f), np.flatnonzero(folds == f)
        if not len(test) or not len(train):
            continue
        w = RankerFit().weights(features[train], [targets[k] for k in train], fixed=base)
        fold_weights.append(w)
        oof[test] = hits(features[test], [targets[k] for k in test], w)
    weights = RankerFit().weights(features, targets, fixed=base)
    return AddedFit(weights, top1(features, targets, base), float(oof.mean()), fold_weights, len(targets))


ADDED = ("sure_lexical",)  # the views added since the built-in calibrations' weights were last fitted (action, clash, argument, server: before)


def fit_on(items: Sequence[Labeled], cfg: Config, catalog: catalog_mod.Catalog, added: Sequence[str] = ADDED) -> AddedFit:
    """The built-in calibration's views of `items`' tool requests, and the `added` views (the
    last of RANK_FEATURES) fitted, the weights before them held (refitted if already there)."""
    pipe = from_config(cfg, catalog=catalog, progress=False)
    if any(i.offered is not None for i in items):
        raise ValueError("fit_on judges every text against the whole catalog")
    positives = [i for i in items if i.positive]
    q = query_vectors(pipe, [i.text for i in positives])
    views = pipe.views([Request(i.text, i.source) for i in positives], q)
    features = np.stack([v.features[:, : len(RANK_FEATURES)] for v in views])
    column = {n: j for j, n in enumerate(pipe.index_for("user").names)}
    targets = [[column[t] for t in i.expected] for i in positives]
    folds = _folds(positives, [""] * len(positives), 0)
    held = len(RANK_FEATURES) - len(added)
    if tuple(RANK_FEATURES[held:]) != tuple(added):
        raise ValueError(f"{list(added)} are not the last views of {list(RANK_FEATURES)}")
    base = (*pipe.ranker.weights, *[0.0] * held)[:held]
    return fit_added(features, targets, base, folds)


def write_weights(path: pathlib.Path, weights: Sequence[float]) -> None:
    """Replace the ranker's weights in a calibration file, leaving every other byte as it is."""
    text = path.read_text(encoding="utf-8")
    new, n = re.subn(r'"ranker":\{"weights":\[[^\]]*\]', '"ranker":{"weights":[' + ",".join(repr(float(w)) for w in weights) + "]", text, count=1)
    if n != 1:
        raise ValueError(f"{path}: no ranker weights to replace")
    path.write_text(new, encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="nomic-embed-text-v1.5")
    ap.add_argument("--labeled", default=str(ROOT / "fixtures/corpus/fit.jsonl"))
    ap.add_argument("--catalog", default=str(ROOT / "fixtures/corpus/fit-catalog.json"))
    ap.add_argument("--write", action="store_true", help="write the weights into the model's built-in calibration")
    args = ap.parse_args(argv)
    cfg = config_mod.load(overrides={("model", "name"): args.model})
    catalog = catalog_mod.load([args.catalog])
    fitted = fit_on(read_labeled(args.labeled, catalog), cfg, catalog)
    print(msgspec.json.encode(fitted).decode())
    if args.write:
        write_weights(ROOT / "sidecar/core/calibrations" / f"{args.model}.json", fitted.weights)


if __name__ == "__main__":
    main()
