"""docs/configuration.md keeps up with sidecar/config.py: every key of every section of the
typed config has a row in its section's table, with the default the code has, the environment
variable and the flags that set it; and the doc's TOML examples load. A key added to
config.py fails here until it is documented."""

from __future__ import annotations

import argparse
import re
import tomllib
import typing

import msgspec
import pytest

from sidecar import cli, config

from .conftest import ROOT

DOC = ROOT / "docs" / "configuration.md"
HEADING = re.compile(r"^#{2,4} (.+)$")
TABLE_NAME = re.compile(r"`\[([\w.]+)\]`")
CELL_SPLIT = re.compile(r"(?<!\\)\|")  # `--model NAME\|PATH` is one cell
COLUMNS = ("key", "type", "default", "env / flag", "what")


def struct_of(tp: object) -> tuple[type, bool] | None:
    """The Struct a field opens a section for, and whether it is keyed by name
    (dict[str, Struct]: one `[section.NAME]` table per entry)."""
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp, False
    if typing.get_origin(tp) is dict:
        value = typing.get_args(tp)[1]
        if isinstance(value, type) and issubclass(value, msgspec.Struct):
            return value, True
    return None


def sections(cls: type = config.Config, path: str = "") -> dict[str, tuple[msgspec.structs.FieldInfo, ...]]:
    """Section name ("" for the top level, "recommend.variants.NAME" for a keyed one) -> its fields."""
    fields = msgspec.structs.fields(cls)
    out = {path: fields}
    for f in fields:
        if (sub := struct_of(f.type)) is not None:
            child = f"{path}.{f.name}" if path else f.name
            out.update(sections(sub[0], child + (".NAME" if sub[1] else "")))
    return out


def child_section(path: str, f: msgspec.structs.FieldInfo) -> str:
    keyed = struct_of(f.type)[1]
    return (f"{path}.{f.name}" if path else f.name) + (".NAME" if keyed else "")


def documented() -> dict[str, dict[str, list[str]]]:
    """The doc's tables: section -> key -> the row's cells. A heading naming `[section]` (or
    "Top level") starts a section's table."""
    tables: dict[str, dict[str, list[str]]] = {}
    current: str | None = None
    for n, line in enumerate(DOC.read_text(encoding="utf-8").splitlines(), 1):
        if m := HEADING.match(line):
            t = TABLE_NAME.search(m.group(1))
            current = t.group(1) if t else ("" if m.group(1).strip() == "Top level" else None)
            continue
        if current is None or not line.startswith("| `"):
            continue
        cells = [c.strip() for c in CELL_SPLIT.split(line.strip()[1:-1])]
        assert len(cells) == len(COLUMNS), f"configuration.md:{n}: a row needs {len(COLUMNS)} cells {COLUMNS}, has {len(cells)}"
        key = cells[0].strip("`")
        assert key not in tables.setdefault(current, {}), f"configuration.md:{n}: [{current}] {key} documented twice"
        tables[current][key] = cells
    return tables


def default_of(f: msgspec.structs.FieldInfo) -> object:
    return f.default_factory() if f.default is msgspec.NODEFAULT else f.default


def label(section: str) -> str:
    return f"[{section}]" if section else "the top level"


def test_every_key_of_every_section_has_a_row():
    doc = documented()
    problems = []
    for section, fields in sections().items():
        rows = doc.get(section)
        if rows is None:
            problems.append(f"no table for {label(section)} (a heading naming `[{section}]`)")
            continue
        keys = {f.name for f in fields if struct_of(f.type) is None}  # a nested table has its own heading
        if missing := sorted(keys - rows.keys()):
            problems.append(f"{label(section)}: undocumented {missing}")
        if stale := sorted(rows.keys() - {f.name for f in fields}):
            problems.append(f"{label(section)}: documented but not in config.py {stale}")
    assert not (extra := sorted(doc.keys() - sections().keys())), f"tables for sections config.py does not have: {extra}"
    assert not problems, "docs/configuration.md is behind sidecar/config.py:\n" + "\n".join(problems)


def test_every_default_is_the_codes():
    """The default cell: `[section]` for a nested table (which needs no row of its own, its
    heading is enough), "unset..." for None, else the TOML value in the first backticks, equal
    to the struct's default."""
    doc = documented()
    wrong = []
    for section, fields in sections().items():
        for f in fields:
            row = doc.get(section, {}).get(f.name)
            if row is None:  # reported by the test above (or a nested table without a row)
                continue
            cell, where = row[2], f"{label(section)} {f.name}"
            if struct_of(f.type) is not None:
                if f"`[{child_section(section, f)}]`" not in cell:
                    wrong.append(f"{where}: default should point at `[{child_section(section, f)}]`, says {cell!r}")
                continue
            default = default_of(f)
            if default is None:
                if not cell.startswith("unset"):
                    wrong.append(f"{where}: the default is unset (None), doc says {cell!r}")
                continue
            m = re.search(r"`([^`]+)`", cell)
            try:
                said = tomllib.loads(f"v = {m.group(1)}")["v"] if m else None
            except tomllib.TOMLDecodeError:
                said = m.group(1)
            if said != msgspec.to_builtins(default):
                wrong.append(f"{where}: the default is {default!r}, doc says {cell!r}")
    assert not wrong, "\n".join(wrong)


def test_every_choice_of_a_literal_is_named():
    doc = documented()
    for section, fields in sections().items():
        for f in fields:
            if typing.get_origin(f.type) is typing.Literal:
                cell = doc[section][f.name][1]
                for choice in typing.get_args(f.type):
                    assert f'"{choice}"' in cell, f'{label(section)} {f.name}: type should name "{choice}", says {cell!r}'


def test_every_environment_variable_is_in_its_keys_row():
    doc = documented()
    text = DOC.read_text(encoding="utf-8")
    resolution = text.split("## How a value is resolved", 1)[1].split("\n## ", 1)[0]
    assert "SIDECAR_CONFIG" in resolution
    for var in config.ENV:
        assert f"`{var}`" in resolution, f"'How a value is resolved' should list {var}"
    for var, keys in config.ENV.items():
        section, key = ".".join(keys[:-1]), keys[-1]
        row = doc[section][key]
        assert var in row[3], f"{label(section)} {key}: the env column should name {var}, says {row[3]!r}"


class Captured(Exception):
    """Raised by the stand-in for config.load: the flags' overrides were seen, stop there."""


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


# The arguments each command needs before it reads the configuration (which it does first).
REQUIRED = {"detect": ["some text"], "recommend": ["a query"], "eval": ["--labeled", "x.jsonl"], "proxy": [],
            "tune": ["--labeled", "x.jsonl"], "replay": ["x.jsonl"], "serve": [], "metrics": []}  # fmt: skip


def overrides_of(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> dict[tuple[str, ...], object]:
    """The config keys a command line sets through flags, as the command hands them to config.load."""
    seen: dict[tuple[str, ...], object] = {}

    def load(path=None, env=None, overrides=None):
        seen.update({k: v for k, v in (overrides or {}).items() if v is not None})
        raise Captured

    monkeypatch.setattr(config, "load", load)
    with pytest.raises(Captured):
        cli.main(argv)
    return seen


def test_every_flag_that_sets_a_key_is_in_its_keys_row(monkeypatch: pytest.MonkeyPatch):
    """Each command's flags, given one at a time with a probe value, through the real parser and
    command up to config.load: the keys they set must name them in the flag column."""
    doc = documented()
    parsers = subparsers()
    mapped: dict[tuple[str, ...], set[str]] = {}
    for command, required in REQUIRED.items():
        assert not overrides_of(monkeypatch, [command, *required]), f"{command} sets config keys with no flag given"
        for action in parsers[command]._actions:
            flag = max(action.option_strings, key=len, default=None)
            if flag is None or action.nargs == 0 or flag == "--config" or flag in required:
                continue
            value = str(action.choices[0] if action.choices else "1" if action.type in (int, float) else "x-probe")
            for keys in overrides_of(monkeypatch, [command, *required, flag, value]):
                mapped.setdefault(keys, set()).add(flag)
    assert {"--catalog"} <= mapped.get(("catalogs",), set()), "the probe found no flag for catalogs: it is broken"
    for keys, flags in mapped.items():
        section, key = ".".join(keys[:-1]), keys[-1]
        row = doc[section][key]
        for flag in flags:
            assert flag in row[3], f"{label(section)} {key}: the flag column should name {flag}, says {row[3]!r}"


def toml_blocks() -> list[str]:
    return re.findall(r"```toml\n(.*?)```", DOC.read_text(encoding="utf-8"), re.DOTALL)


def test_the_example_files_load(tmp_path):
    blocks = toml_blocks()
    assert blocks, "configuration.md has no ```toml example"
    defaults = config.Config()
    for i, block in enumerate(blocks):
        path = tmp_path / f"example{i}.toml"
        path.write_text(block, encoding="utf-8")
        cfg = config.load(path, env={})
        for section in tomllib.loads(block):  # what the example sets, it changes
            assert getattr(cfg, section) != getattr(defaults, section), f"example {i}: [{section}] loads as the defaults"


def test_a_key_the_doc_misses_is_caught(monkeypatch: pytest.MonkeyPatch):
    """The check itself: a key config.py gains is reported as undocumented."""

    class Grown(config.ModelConfig, forbid_unknown_fields=True):
        batch_size: int = 32

    real = sections

    def grown(cls=config.Config, path=""):
        out = real(cls, path)
        if path == "":
            out["model"] = msgspec.structs.fields(Grown)
        return out

    monkeypatch.setitem(globals(), "sections", grown)
    with pytest.raises(AssertionError, match=r"\[model\]: undocumented \['batch_size'\]"):
        test_every_key_of_every_section_has_a_row()


def test_the_documented_gate_thresholds_are_the_built_in_calibrations():
    """Refitting a built-in calibration moves its thresholds; the [gate] rows say which."""
    from sidecar.core import calibration

    rows = documented()["gate"]
    cals = {m: calibration.read(ROOT / "sidecar" / "core" / "calibrations" / f"{m}.json").thresholds
            for m in ("nomic-embed-text-v1.5", "all-minilm-l6-v2")}  # fmt: skip
    for key in ("high", "fallback", "auto", "confirm"):
        said = re.search(r"nomic ([0-9.]+), MiniLM ([0-9.]+)", rows[key][2])
        assert said, f"[gate] {key}: the default cell names no calibration values"
        have = (getattr(cals["nomic-embed-text-v1.5"], key), getattr(cals["all-minilm-l6-v2"], key))
        assert (float(said.group(1)), float(said.group(2))) == pytest.approx(have, abs=5e-5), f"[gate] {key}: doc {said.groups()}, calibrations {have}"
