"""Configuration in one typed place: defaults < TOML file < environment < command-line flags.

Everything is validated when loaded, so a typo in a key or a threshold out of range stops
start-up with a message naming the key, instead of surfacing mid-conversation.
"""

from __future__ import annotations

import os
import pathlib
import tomllib
from typing import Any, Literal

import msgspec

from .cases import Strategy


class ConfigError(ValueError):
    pass


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True):
    name: str = "nomic-embed-text-v1.5"  # a known model name or a path to a GGUF file
    dir: str | None = None  # where pulled models live (default: XDG cache)
    threads: int | None = None  # llama.cpp threads (default: all cores)
    task_prefixes: Literal["auto", "on", "off"] = "auto"  # auto: the model's measured default
    pull: bool = True  # provision a known model on first use


class GateConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Explicit threshold overrides; unset ones come from the model's calibration."""

    high: float | None = None
    fallback: float | None = None
    auto: float | None = None
    confirm: float | None = None
    patterns: str | None = None  # directory with lists.txt, negative.txt, high.txt
    regex_timeout_ms: float = 20.0


class IndexConfig(msgspec.Struct, forbid_unknown_fields=True):
    user_strategy: str = "prefix+mcp"
    llm_strategy: str = "mcp+llm"
    top_k: int = 5

    def __post_init__(self) -> None:
        for key in ("user_strategy", "llm_strategy"):
            Strategy.parse(getattr(self, key))  # raises with the list of modifiers
        if not 1 <= self.top_k <= 100:
            raise ValueError(f"index.top_k={self.top_k} must be within 1..100")


class Config(msgspec.Struct, forbid_unknown_fields=True):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    gate: GateConfig = msgspec.field(default_factory=GateConfig)
    index: IndexConfig = msgspec.field(default_factory=IndexConfig)
    catalogs: list[str] = []
    store: str | None = None  # SQLite file (default: XDG data dir)
    calibration: str | None = None  # file written by `sidecar tune`


# Environment variables and the config keys they set.
ENV = {
    "SIDECAR_MODEL": ("model", "name"),
    "SIDECAR_MODELS_DIR": ("model", "dir"),
    "SIDECAR_THREADS": ("model", "threads"),
    "SIDECAR_STORE": ("store",),
    "SIDECAR_CALIBRATION": ("calibration",),
    "SIDECAR_PATTERNS": ("gate", "patterns"),
}


def _set(tree: dict[str, Any], keys: tuple[str, ...], value: Any) -> None:
    for k in keys[:-1]:
        tree = tree.setdefault(k, {})
    tree[keys[-1]] = value


def load(path: str | os.PathLike | None = None, env: dict[str, str] | None = None, overrides: dict[tuple[str, ...], Any] | None = None) -> Config:
    """Build the configuration. `overrides` maps key paths to flag values (None = flag not given)."""
    env = os.environ if env is None else env
    tree: dict[str, Any] = {}
    path = path or env.get("SIDECAR_CONFIG")
    if path:
        try:
            tree = tomllib.loads(pathlib.Path(path).read_text(encoding="utf-8"))
        except OSError as e:
            raise ConfigError(f"{path}: cannot read config ({e.strerror})") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: {e}") from None
    for var, keys in ENV.items():
        if env.get(var):
            _set(tree, keys, int(env[var]) if keys[-1] == "threads" and env[var].isdigit() else env[var])
    for keys, value in (overrides or {}).items():
        if value is not None:
            _set(tree, keys, value)
    try:
        return msgspec.convert(tree, Config)
    except (msgspec.ValidationError, ValueError) as e:
        where = f"{path}: " if path else ""
        raise ConfigError(f"{where}invalid configuration: {e}") from None
