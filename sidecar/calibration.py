"""Gate thresholds belong to a model: each model has its own cosine scale.

Built-in defaults come from measurements (see README); a calibration file written by
`sidecar tune` overrides them for the model it was fitted on, and explicit configuration
overrides both.
"""

from __future__ import annotations

import pathlib

import msgspec

from .config import GateConfig
from .gate import Thresholds


class CalibrationError(ValueError):
    pass


class Calibration(msgspec.Struct, forbid_unknown_fields=False):
    model: str  # the model name or identity it was fitted on
    thresholds: Thresholds
    task_prefixes: bool | None = None
    user_strategy: str | None = None
    llm_strategy: str | None = None


# What a model gets when nothing else is said: measured per known model (see README,
# "Choosing thresholds"). A calibration file replaces its model's entry; explicit
# configuration overrides single values of either.
BUILTIN: dict[str, Calibration] = {
    # Both fitted with `sidecar tune --model M --catalog fixtures/catalogs/ALL.json --labeled
    # fixtures/labeled/dev.jsonl` (objective max_tp:fp<=0.05) and checked on
    # fixtures/labeled/heldout.jsonl (README, "Choosing thresholds"). Against 462 real tools
    # the best cosine of talk that needs no tool is high, so the fallback path needs a high
    # bar: most tool requests get through on a high-confidence pattern. The design's nomic
    # numbers (0.50 / 0.68 / 0.70 / 0.55) fired on 9.9% of held-out negatives.
    "nomic-embed-text-v1.5": Calibration(
        "nomic-embed-text-v1.5",
        Thresholds(high=0.535, fallback=0.86, auto=0.78, confirm=0.535),
        task_prefixes=False,
        user_strategy="prefix",
        llm_strategy="mcp+llm",
    ),
    # MiniLM's cosines sit far lower than nomic's: the same gate, on its own scale.
    "all-minilm-l6-v2": Calibration(
        "all-minilm-l6-v2",
        Thresholds(high=0.20, fallback=0.70, auto=0.55, confirm=0.20),
        task_prefixes=False,
        user_strategy="mcp",
        llm_strategy="mcp",
    ),
}
# Strategies for a model nobody measured: the design's defaults.
DEFAULT_USER_STRATEGY = "prefix+mcp"
DEFAULT_LLM_STRATEGY = "mcp+llm"


def in_force(model: str, calibration: Calibration | None) -> tuple[Calibration | None, str]:
    """The calibration that applies to `model` and where it came from. A file fitted on
    another model is refused: its numbers are on another model's scale."""
    if calibration is not None:
        if calibration.model != model:
            raise CalibrationError(
                f"calibration was fitted on {calibration.model!r}, not on the model in use {model!r}: "
                "run `sidecar tune` for this model"
            )
        return calibration, "calibration"
    if model in BUILTIN:
        return BUILTIN[model], "builtin"
    return None, "uncalibrated"


def read(path: str | pathlib.Path) -> Calibration:
    try:
        return msgspec.json.decode(pathlib.Path(path).read_bytes(), type=Calibration)
    except OSError as e:
        raise CalibrationError(f"{path}: cannot read calibration ({e.strerror})") from None
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as e:
        raise CalibrationError(f"{path}: not a calibration file: {e}") from None


def thresholds_for(model: str, gate: GateConfig, calibration: Calibration | None) -> tuple[Thresholds, str]:
    """The thresholds in force and where they came from ("builtin", "calibration",
    "uncalibrated", each "+config" when configuration overrides some)."""
    cal, origin = in_force(model, calibration)
    base = cal.thresholds if cal else Thresholds()
    explicit = {k: getattr(gate, k) for k in ("high", "fallback", "auto", "confirm") if getattr(gate, k) is not None}
    if explicit:
        origin += "+config"
    try:
        return msgspec.structs.replace(base, **explicit), origin
    except ValueError as e:
        raise CalibrationError(str(e)) from None
