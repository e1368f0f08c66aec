"""The picture `sidecar tune --plot` writes: can a newcomer see where the gate cuts, and what
each threshold costs? Left: score distributions of texts that need a tool and texts that do
not, per gate path, with the fitted thresholds. Right: TP and FP rates as one threshold sweeps.

matplotlib is an optional extra (`pip install -e '.[plot]'` from the clone), imported only here.
"""

from __future__ import annotations

import pathlib

import numpy as np

from .tune import Fitted


def require_matplotlib() -> None:
    """Fail before any work is done, not after it (`tune --plot`)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install -e '.[plot]' (from the clone)") from None


def gate_plot(fitted: Fitted, out: str | pathlib.Path) -> None:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = fitted.gate_scores
    t = fitted.calibration.thresholds
    path, score, pos = np.asarray(s.path), np.asarray(s.score), np.asarray(s.positive)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), constrained_layout=True)
    bins = np.linspace(min(-0.05, score[path != "negative"].min(initial=0)), 1.0, 41)
    for ax, kind, cut, title in (
        (axes[0], "high", t.high, "after a high-confidence pattern (\"let me…\", \"please…\")"),
        (axes[1], "fallback", t.fallback, "no pattern: the fallback threshold"),
    ):
        m = path == kind
        ax.hist(score[m & pos], bins=bins, alpha=0.6, color="tab:green", label=f"needs a tool ({(m & pos).sum()})")
        ax.hist(score[m & ~pos], bins=bins, alpha=0.6, color="tab:red", label=f"needs none ({(m & ~pos).sum()})")
        ax.axvline(cut, color="black", lw=2, label=f"fires at ≥ {cut:.3f}")
        ax.axvline(t.auto, color="tab:blue", ls="--", label=f"auto-inject at ≥ {t.auto:.3f}")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("probability that the text needs a tool (out of fold)")
        ax.set_ylabel("texts")
        ax.legend(fontsize=8, loc="upper left")
    live = path != "negative"
    sweep = np.linspace(bins[0], 1.0, 200)
    tp = [(live & pos & (score >= x)).sum() / max(pos.sum(), 1) for x in sweep]
    fp = [(live & ~pos & (score >= x)).sum() / max((~pos).sum(), 1) for x in sweep]
    ax = axes[2]
    ax.plot(sweep, tp, color="tab:green", label="TP rate (needs a tool, fired)")
    ax.plot(sweep, fp, color="tab:red", label="FP rate (needs none, fired)")
    ax.axhline(0.05, color="grey", ls=":", label="5% FP budget")
    fit = fitted.fit
    ax.set_title(f"one threshold for every text; the tiered gate gets TP {fit.tp_rate:.0%} at FP {fit.fp_rate:.0%}", fontsize=10)
    ax.set_xlabel("threshold")
    ax.set_ylabel("rate")
    ax.legend(fontsize=8)
    blocked = (path == "negative").sum()
    fig.suptitle(
        f"{fitted.calibration.model}: gate head fitted on {len(s.path)} labelled texts ({blocked} blocked by negative patterns, not shown)",
        fontsize=11,
    )
    fig.savefig(out, dpi=110)
    plt.close(fig)
