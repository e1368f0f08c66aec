"""Fitting the cascade's cutoff: under which screen-model probability a text is settled as
"no tool" without reaching the main model (the engine runs the cascade: `engine.settle`).

* `fit_reject_below` picks the cutoff from labelled data (pure numpy), and `outcome` reports
  what a cutoff does; `measure` feeds them both models' decisions on a labelled set, and
  `fit_out_of_fold` the out-of-fold ones `tune` computes on the set the calibrations were
  fitted on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from ..core.catalog import Catalog
from ..config import Config
from ..engine import settle
from .evaluate import GateReport, Labeled, gate_report, detected
from ..core.gate import PathKind

if TYPE_CHECKING:
    from ..engine import Sidecar
    from ..store import Store

class Outcome(msgspec.Struct):
    """What a cutoff does on a labelled set, against the main model judging every text."""

    reject_below: float
    texts: int
    positives: int
    negatives: int
    main_fired_positives: int  # positives the main model fires on
    lost_positives: int  # of those, settled by the screen (missed by the cascade)
    lost_share: float  # lost_positives / main_fired_positives
    main_fired_negatives: int  # false fires of the main model
    removed_false_fires: int  # of those, settled by the screen
    settled_share: float  # texts settled by the screen
    settled_negatives_share: float  # negatives settled by the screen
    reaching_main_share: float  # texts the main model embeds (neither settled nor blocked by a pattern)


def outcome(reject_below: float, screen_prob: Sequence[float], kinds: Sequence[PathKind], main_fired: Sequence[bool],
            positive: Sequence[bool]) -> Outcome:  # fmt: skip
    """Pure: which texts `reject_below` settles (fallback path, screen probability under it)
    and what that costs. `screen_prob` may be NaN where the screen gave none."""
    p, kind, fired, pos = _arrays(screen_prob, kinds, main_fired, positive)
    settled = (kind == "fallback") & (p < reject_below)  # NaN compares False: never settled
    n, npos = len(p), int(pos.sum())
    fired_pos = int((fired & pos).sum())
    lost = int((settled & fired & pos).sum())
    return Outcome(
        reject_below=float(reject_below),
        texts=n,
        positives=npos,
        negatives=n - npos,
        main_fired_positives=fired_pos,
        lost_positives=lost,
        lost_share=lost / fired_pos if fired_pos else 0.0,
        main_fired_negatives=int((fired & ~pos).sum()),
        removed_false_fires=int((settled & fired & ~pos).sum()),
        settled_share=float(settled.mean()) if n else 0.0,
        settled_negatives_share=float(settled[~pos].mean()) if n > npos else 0.0,
        reaching_main_share=float((~settled & (kind != "negative")).mean()) if n else 0.0,
    )


def fit_reject_below(screen_prob: Sequence[float], kinds: Sequence[PathKind], main_fired: Sequence[bool], positive: Sequence[bool],
                     max_loss: float = 0.01) -> Outcome:  # fmt: skip
    """Pure: the highest cutoff that settles at most `max_loss` (a share: 0.01 = one point) of
    the positives the main model fires on, with what it settles. A text is settled when its
    screen probability is strictly under the cutoff, so the cutoff is the probability of the
    first fired positive beyond the allowance (1.0 when the allowance covers them all)."""
    if not 0.0 <= max_loss < 1.0:
        raise ValueError(f"max_loss={max_loss} must be a share within [0, 1)")
    p, kind, fired, pos = _arrays(screen_prob, kinds, main_fired, positive)
    at_risk = np.sort(p[fired & pos & (kind == "fallback") & ~np.isnan(p)])
    allowed = math.floor(max_loss * int((fired & pos).sum()) + 1e-9)
    cut = float(at_risk[allowed]) if allowed < len(at_risk) else 1.0
    return outcome(cut, p, kind, fired, pos)


def _arrays(screen_prob, kinds, main_fired, positive) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    p = np.asarray(screen_prob, float)
    kind = np.asarray(kinds, dtype=object)
    fired, pos = np.asarray(main_fired, bool), np.asarray(positive, bool)
    if not len(p) == len(kind) == len(fired) == len(pos):
        raise ValueError("screen_prob, kinds, main_fired and positive must be as long as each other")
    return p, kind, fired, pos


def fit_out_of_fold(items: Sequence[Labeled], catalog: Catalog, cfg: Config, store: Store | None, max_loss: float = 0.01,
                    progress: Callable[[str], None] | None = None) -> Outcome:  # fmt: skip
    """The cutoff for the set the calibrations were fitted on (the built-in ones: the corpus's
    fit part). Judged by those calibrations, its texts look surer than new ones do (each model's
    gate head was fitted on them, and a third of them are its own nearest exemplars), so a
    cutoff fitted there settles too much elsewhere. Instead, each model's head is fitted again
    the way `tune` fits it, and the cutoff is fitted on the out-of-fold probabilities and fires
    `tune` chose the thresholds on (each text twice: against the whole catalog and against a
    part of it, so its `texts` count rows)."""
    from .tune import fired as tune_fired
    from .tune import fit as tune_fit

    def oof(name: str):
        own = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, name=name), calibration=None)
        # from the texts alone, as the built-ins are fitted: a start pulled toward a built-in
        # calibration fitted on these same texts sees them again (out of fold, nomic chose the
        # built-in head at 0.888 against 0.802 alone)
        fitted = tune_fit(items, catalog, own, heldout_fraction=0.0, store=store, progress=progress, start="none")
        return fitted.gate_scores, fitted.calibration.thresholds

    main, thresholds = oof(cfg.model.name)
    first, _ = oof(cfg.cascade.screen)
    prob = [p if k == "fallback" else math.nan for p, k in zip(first.score, first.path)]
    return fit_reject_below(prob, main.path, tune_fired(main, thresholds), main.positive, max_loss)


class Report(msgspec.Struct):
    """`sidecar cascade`: the cutoff (fitted, or the one given) on a labelled set, and the gate
    of the main model alone, of the cascade, and of the screen alone, on the same texts."""

    screen: str
    main: str
    fitted: bool  # False: the cutoff was given, not fitted
    max_loss: float
    cutoff: Outcome
    gate_main: GateReport
    gate_cascade: GateReport
    gate_screen: GateReport


def measure(engine: Sidecar, items: Sequence[Labeled], max_loss: float = 0.01, reject_below: float | None = None,
            on_batch: Callable[[int], None] | None = None) -> Report:  # fmt: skip
    """Judge every item with both models (the main one on every text: what the cascade is
    measured against), then fit the cutoff (or take `reject_below`) and report both gates."""
    if engine.screen is None:
        raise ValueError("no screen: set cascade.screen (or --screen) to a model other than the main one")
    main, _ = detected(engine.pipeline, items, on_batch=on_batch)
    first, _ = detected(engine.screen, items, on_batch=on_batch)
    prob = [d.score if d.score is not None else math.nan for d in first]
    kinds = [d.kind for d in main]
    fired = [d.fired for d in main]
    pos = [i.positive for i in items]
    if reject_below is None:
        cut = fit_reject_below(prob, kinds, fired, pos, max_loss)
    else:
        cut = outcome(reject_below, prob, kinds, fired, pos)
    chained = [settle(s, cut.reject_below) or m if m.kind == "fallback" else m for m, s in zip(main, first)]
    return Report(
        screen=engine.screen.embedder.name,
        main=engine.pipeline.embedder.name,
        fitted=reject_below is None,
        max_loss=max_loss,
        cutoff=cut,
        gate_main=gate_report(items, main),
        gate_cascade=gate_report(items, chained),
        gate_screen=gate_report(items, first),
    )


def describe_outcome(c: Outcome, how: str) -> str:
    settled = (f"settled by the screen: {c.settled_share:.1%} of texts, {c.settled_negatives_share:.1%} of those needing none; "
               f"{c.reaching_main_share:.1%} reach the main model")  # fmt: skip
    lost = (f"lost: {c.lost_positives} of the {c.main_fired_positives} positives the main model fires on ({c.lost_share:.1%}); "
            f"false fires removed: {c.removed_false_fires} of {c.main_fired_negatives}")  # fmt: skip
    head = f"{c.texts} texts ({c.positives} need a tool, {c.negatives} do not)"
    return "\n".join([head, f"reject_below = {c.reject_below:.4f}  ({how})", settled, lost])


def describe(r: Report) -> str:
    c = r.cutoff
    how = f"fitted: settles at most {r.max_loss:.1%} of the positives {r.main} fires on" if r.fitted else "given"
    lines = [f"screen {r.screen} · main {r.main}", describe_outcome(c, how)]
    for name, g in (("main alone", r.gate_main), ("cascade", r.gate_cascade), ("screen alone", r.gate_screen)):
        lines.append(f"{name:<13} TP {g.tp_rate:.1%}  FP {g.fp_rate:.1%}  AUROC {g.auroc:.3f}  fired with the right tool {g.correct_rate:.1%}")
    lines.append(f'[cascade]\nscreen = "{r.screen}"\nreject_below = {c.reject_below:.4f}')
    return "\n".join(lines)
