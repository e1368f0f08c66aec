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


# Defaults per known model. nomic's are the design's numbers; MiniLM's were measured on
# fixtures/labeled/dev.jsonl (see README, "Thresholds").
BUILTIN: dict[str, Thresholds] = {
    "nomic-embed-text-v1.5": Thresholds(high=0.50, fallback=0.68, auto=0.70, confirm=0.55),
    "all-minilm-l6-v2": Thresholds(high=0.35, fallback=0.55, auto=0.60, confirm=0.40),
}
# Whether a model's task prefixes (e.g. nomic's "search_query: ") are used by default.
PREFIXES_ON: dict[str, bool] = {"nomic-embed-text-v1.5": False}


def read(path: str | pathlib.Path) -> Calibration:
    try:
        return msgspec.json.decode(pathlib.Path(path).read_bytes(), type=Calibration)
    except OSError as e:
        raise CalibrationError(f"{path}: cannot read calibration ({e.strerror})") from None
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as e:
        raise CalibrationError(f"{path}: not a calibration file: {e}") from None


def thresholds_for(model: str, gate: GateConfig, calibration: Calibration | None) -> tuple[Thresholds, str]:
    """The thresholds in force and where they came from ("builtin", "calibration", "uncalibrated")."""
    base = BUILTIN.get(model)
    origin = "builtin" if base else "uncalibrated"
    if calibration is not None:
        if calibration.model != model:
            raise CalibrationError(
                f"calibration was fitted on {calibration.model!r}, not on the model in use {model!r}: "
                "run `sidecar tune` for this model"
            )
        base, origin = calibration.thresholds, "calibration"
    base = base or BUILTIN["nomic-embed-text-v1.5"]
    explicit = {k: getattr(gate, k) for k in ("high", "fallback", "auto", "confirm") if getattr(gate, k) is not None}
    if explicit:
        origin += "+config"
    try:
        return msgspec.structs.replace(base, **explicit), origin
    except ValueError as e:
        raise CalibrationError(str(e)) from None
