"""Gate thresholds belong to a model: each model has its own cosine scale.

Built-in defaults come from measurements (docs/benchmarks.md); a calibration file written by
`sidecar tune` overrides them for the model it was fitted on, and explicit configuration
overrides both.
"""

from __future__ import annotations

import importlib.resources
import pathlib

import msgspec

from . import models
from ..config import GateConfig
from .gate import Thresholds
from ..learn.learned import Examples, GateHead, Ranker


class CalibrationError(ValueError):
    pass


class Calibration(msgspec.Struct, forbid_unknown_fields=False):
    model: str  # the model name or identity it was fitted on
    thresholds: Thresholds
    task_prefixes: bool | None = None
    user_strategy: str | None = None
    llm_strategy: str | None = None
    ranker: Ranker | None = None  # fitted view weights; None: cosine + a little BM25
    head: GateHead | None = None  # the gate as a probability; None: thresholds are cosines
    examples: Examples | None = None  # the tune's labelled requests, for a classifier over own cases


# What a model gets when nothing else is said: the calibration shipped in the package
# (sidecar/core/calibrations/<model>.json), fitted with `sidecar tune` on the project's labelled
# corpus and reported on servers it never saw (docs/benchmarks.md, "Held-out servers"). A calibration
# file replaces it; explicit configuration overrides single thresholds of either.
def builtin(model: str) -> Calibration | None:
    """The calibration shipped for `model`, or for the model a variant of it was made from."""
    if model not in _BUILTIN:
        resource = importlib.resources.files(__package__).joinpath("calibrations", f"{model}.json")
        if resource.is_file():
            _BUILTIN[model] = msgspec.json.decode(resource.read_bytes(), type=Calibration)
        else:
            _BUILTIN[model] = builtin(base) if (base := models.base_name(model)) != model else None
    return _BUILTIN[model]


_BUILTIN: dict[str, Calibration | None] = {}
# Strategies for a model nobody measured: the tool's use-case phrases as they are.
DEFAULT_USER_STRATEGY = "base"
DEFAULT_LLM_STRATEGY = "base"


def in_force(model: str, calibration: Calibration | None) -> tuple[Calibration | None, str]:
    """The calibration that applies to `model` and where it came from. A file fitted on
    another model is refused: its numbers are on another model's scale. A quantised variant
    (NAME:q8_0) takes its base model's, unless given one fitted on the variant itself (its
    scores shift a little: docs/benchmarks.md, "Quantised models"); one fitted on NAME:bf16
    applies to NAME:f16 and back (the same weights to bfloat16's precision), so a tune on a
    machine whose plain NAME loads bf16 serves on one where it loads f16."""
    base = models.base_name(model)
    if calibration is not None:
        if calibration.model not in (model, base) and not models.same_weights(calibration.model, model):
            raise CalibrationError(
                f"calibration was fitted on {calibration.model!r}, not on the model in use {model!r}: "
                "run `sidecar tune` for this model"
            )
        return calibration, "calibration"
    if (cal := builtin(model)) is not None:  # a variant's is its base model's
        return cal, "builtin"
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
