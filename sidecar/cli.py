"""The `sidecar` command: a thin shell over the library. Each subcommand parses flags,
builds a Config, calls the library, and prints; nothing here decides anything."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import msgspec

from . import __version__, config as config_mod, models
from .calibration import CalibrationError
from .catalog import CatalogError
from .config import ConfigError
from .embed import EmbedError
from .gate import Decision
from .patterns import PatternError
from .store import StoreError

# Errors that are the user's to fix: one line on stderr, exit 2, no traceback.
USER_ERRORS = (ConfigError, CatalogError, PatternError, CalibrationError, EmbedError, StoreError, models.ProvisioningError, ValueError, OSError)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML configuration file (env SIDECAR_CONFIG)")
    p.add_argument("--catalog", metavar="FILE", action="append", help="MCP tools/list JSON file, or a dir of them; repeat to merge several (as server__tool)")
    p.add_argument("--model", metavar="NAME|PATH", help=f"embedding model (default {models.DEFAULT_MODEL}; see `sidecar model list`)")
    p.add_argument("--calibration", metavar="FILE", help="thresholds fitted by `sidecar tune`")
    p.add_argument("--store", metavar="PATH", help="SQLite store (default: XDG data dir; env SIDECAR_STORE)")
    p.add_argument("--patterns", metavar="DIR", help="pattern directory (lists.txt, negative.txt, high.txt)")


def _config(args: argparse.Namespace) -> config_mod.Config:
    return config_mod.load(
        args.config,
        overrides={
            ("catalogs",): args.catalog,
            ("model", "name"): args.model,
            ("calibration",): args.calibration,
            ("store",): args.store,
            ("gate", "patterns"): args.patterns,
        },
    )


def cmd_detect(args: argparse.Namespace) -> int:
    from . import pipeline

    text = " ".join(args.text) if args.text else sys.stdin.read()
    if not text.strip():
        raise ValueError("no text to judge: pass TEXT or pipe it on stdin")
    pipe = pipeline.from_config(_config(args), progress=not args.json)
    decision = pipe.detect(text, args.source)
    if args.json:
        out = msgspec.to_builtins(decision)
        out.update(model=pipe.embedder.name, thresholds=msgspec.to_builtins(pipe.thresholds), thresholds_origin=pipe.thresholds_origin)
        sys.stdout.buffer.write(msgspec.json.encode(out) + b"\n")
    else:
        print(describe(decision))
    return 0


def describe(d: Decision) -> str:
    """A short human answer: what fired (or why nothing did), the runners-up, the time."""
    t = d.timing_ms
    timing = f"{t.total:.1f} ms (regex {t.regex:.2f}, embed {t.embed:.1f}, cosine {t.cosine:.2f})"
    if d.path.startswith("negative:"):
        head = f"silent: blocked by {d.path} ({d.trigger.text!r})" if d.trigger else f"silent: blocked by {d.path}"
        return f"{head}\n  {timing}"
    if d.fired:
        head = f"{d.tier}: {d.tool}  score {d.score:.3f} >= {d.threshold:.2f} via {d.path}\n  matched {d.case!r}"
    elif d.tool:
        why = f"below {d.threshold:.2f}" if d.score is not None and d.score < (d.threshold or 0) else "below the confirm tier"
        head = f"silent: best {d.tool} scored {d.score:.3f}, {why} ({d.path})"
    else:
        head = "silent: the catalog is empty"
    others = ", ".join(f"{c.tool} {c.score:.3f}" for c in d.candidates[1:4])
    return head + (f"\n  next: {others}" if others else "") + (" [text truncated to the model's limit]" if d.truncated else "") + f"\n  {timing}"


def cmd_model_pull(args: argparse.Namespace) -> int:
    names = list(models.KNOWN_MODELS) if args.name == "all" else [args.name]
    for name in names:
        path = models.pull(name, dest=args.dir, progress=True, force=args.force)
        print(f"{name}: {path}")
    return 0


def cmd_model_list(args: argparse.Namespace) -> int:
    present = {m.name: m for m in models.installed(args.dir)}
    rows = []
    for name, spec in models.KNOWN_MODELS.items():
        m = present.pop(name, None)
        rows.append({"name": name, "installed": m is not None, "path": m.path if m else None, "size": m.size if m else None,
                     "default": name == models.DEFAULT_MODEL, "license": spec.license, "source": spec.source})
    for m in present.values():
        rows.append({"name": m.name, "installed": True, "path": m.path, "size": m.size, "default": False, "license": None, "source": "local file"})
    if args.json:
        sys.stdout.buffer.write(msgspec.json.encode({"dir": str(args.dir or models.models_dir()), "models": rows}) + b"\n")
        return 0
    print(f"models in {args.dir or models.models_dir()}")
    for r in rows:
        mark = "*" if r["default"] else " "
        state = f"{r['size'] / 1e6:.0f} MB" if r["installed"] else f"not pulled (sidecar model pull {r['name']})"
        print(f"{mark} {r['name']:<24} {state}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sidecar", description="Intent-detection sidecar: which tool does this text call for?")
    parser.add_argument("--version", action="version", version=f"sidecar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("detect", help="judge one piece of text with the tiered gate")
    _common(p)
    p.add_argument("--source", choices=("user", "llm"), default="user", help="a user turn or LLM output (default user)")
    p.add_argument("--json", action="store_true", help="print the decision as JSON")
    p.add_argument("text", nargs="*", help="the text (default: stdin)")
    p.set_defaults(func=cmd_detect)

    model = sub.add_parser("model", help="provision embedding models").add_subparsers(dest="model_command", required=True)
    p = model.add_parser("pull", help="fetch and verify a known model into the model dir")
    p.add_argument("name", choices=[*models.KNOWN_MODELS, "all"])
    p.add_argument("--dir", help="model dir (default: XDG cache; env SIDECAR_MODELS_DIR)")
    p.add_argument("--force", action="store_true", help="fetch again even if present")
    p.set_defaults(func=cmd_model_pull)
    p = model.add_parser("list", help="known and installed models")
    p.add_argument("--dir", help="model dir")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_model_list)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except USER_ERRORS as e:
        print(f"sidecar: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
