"""Reading typed JSONL files (labelled sets, transcripts) with errors that name file:line."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import TypeVar

import msgspec

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
