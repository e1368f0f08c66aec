"""Reading JSON files (catalogs, MCP configs) and typed JSONL files (labelled sets,
transcripts) with errors that name the file, and the line where there is one."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import TypeVar

import msgspec
import orjson

T = TypeVar("T")


def read(path: str | pathlib.Path, decoder: msgspec.json.Decoder, error: type[ValueError]) -> Iterator[tuple[str, T]]:
    """Yield ("file:line", item) for every non-blank line; raise `error` naming file:line."""
    path = pathlib.Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror})") from None
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{no}", decoder.decode(line)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise error(f"{path}:{no}: {e}") from None


def read_json(path: str | pathlib.Path, error: type[ValueError]) -> object:
    """A whole JSON file, parsed; raise `error` naming the file when it cannot be read or parsed."""
    path = pathlib.Path(path)
    try:
        return orjson.loads(path.read_bytes())
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror})") from None
    except orjson.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e})") from None
