"""Example requests for tools whose catalog ships none: the case packs shipped with the package
and what a case writer wrote (kept in the store), looked up by what the tool is.

Real MCP servers list names, descriptions and schemas, never `cases`; a catalog with cases gets
a classifier view and fits its own gate and ranker (learn/selffit.py), one without is ranked
on its descriptions alone. A case book fills that gap: for each tool with fewer than
`index.MIN_OWN_CASES` cases of its own it adds the written ones, so the rest of the pipeline
sees a catalog that teaches.

A written case is keyed by the tool's own name, description and input schema (`tool_key`), not
by the server's name: the same server is called "fs" in one config and "filesystem" in
another, and a pack must apply to both; but a changed description or schema is another tool,
which no pack case applies to. Written cases are data, never instructions: `clean` caps their
count and length and keeps plain text only, wherever they come from.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import orjson
import regex

from .catalog import Catalog, Tool

if TYPE_CHECKING:
    from ..store import Store

MAX_CASES = 24  # per tool, from any source
MAX_WORDS = 40
MAX_CHARS = 300
PACK_DIR = "casepacks"  # package data beside this module

SCHEMA = """
CREATE TABLE IF NOT EXISTS written_cases (
    key TEXT PRIMARY KEY,
    writer TEXT NOT NULL,
    body BLOB NOT NULL,
    created REAL NOT NULL
);
"""


class Written(msgspec.Struct, frozen=True):
    """What was written for one tool, and by whom (`pack:SERVER` or the writer's spec)."""

    cases: tuple[str, ...]
    near_misses: tuple[str, ...] = ()
    origin: str = ""


class PackTool(msgspec.Struct, frozen=True):
    name: str
    key: str
    cases: list[str]
    near_misses: list[str] = []


class Pack(msgspec.Struct, frozen=True):
    """One server's shipped cases (`bench/build_packs.py` writes them from fixtures/cases/)."""

    server: str
    writer: str
    prompt: str  # where the prompt the writer followed is kept
    tools: list[PackTool]


def tool_key(tool: Tool) -> str:
    """The tool as its server defines it: its own name (no server prefix), description and
    input schema. Title and annotations are left out: merged catalogs often drop them."""
    payload = orjson.dumps([tool.bare_name, tool.description, tool.inputSchema], option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(payload).hexdigest()


_NOT_TEXT = regex.compile(r"[\p{Cc}\p{Cf}\p{Co}\p{Cs}]+")
_MARKUP = regex.compile(r"```|\*\*|__|`|^\s*(?:[-*•#>]+|\d+[.)])\s+")
_SPACES = regex.compile(r"\s+")


def clean(texts: Iterable[Any], most: int = MAX_CASES) -> tuple[str, ...]:
    """Plain one-line texts: control and format characters and markup gone, surrounding quotes
    stripped, at most MAX_WORDS words and MAX_CHARS characters each (longer ones are dropped,
    not cut: a cut request says something else), no repeats, at most `most`."""
    out: list[str] = []
    seen: set[str] = set()
    for raw in texts:
        if not isinstance(raw, str):
            continue
        text = _SPACES.sub(" ", _MARKUP.sub(" ", _NOT_TEXT.sub(" ", raw))).strip().strip("\"'“”‘’").strip()
        if not text or len(text) > MAX_CHARS or len(text.split()) > MAX_WORDS:
            continue
        folded = text.casefold()
        if folded in seen:
            continue
        seen.add(folded)
        out.append(text)
        if len(out) >= most:
            break
    return tuple(out)


class CaseBook:
    """Written cases by tool key; `fill` adds them to a catalog's tools that lack their own."""

    def __init__(self, entries: Mapping[str, Written] | None = None):
        self.entries: dict[str, Written] = dict(entries or {})

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, tool: Tool) -> Written | None:
        return self.entries.get(tool_key(tool))

    def over(self, other: CaseBook) -> CaseBook:
        """This book's entries where both have a tool (what a writer wrote beats a pack)."""
        return CaseBook({**other.entries, **self.entries})

    def fill(self, catalog: Catalog, min_own: int) -> Catalog:
        """The catalog with written cases added to each tool that has fewer than `min_own`
        cases of its own (its own come first); the same catalog when nothing applies."""
        changed = False
        tools: list[Tool] = []
        for tool in catalog:
            written = self.get(tool) if len(tool.cases or ()) < min_own else None
            if written is not None and written.cases:
                tool = msgspec.structs.replace(tool, cases=list(clean([*(tool.cases or ()), *written.cases])))
                changed = True
            tools.append(tool)
        return Catalog(tools, catalog.sources) if changed else catalog

    def covered(self, catalog: Catalog) -> int:
        """How many of the catalog's tools this book has cases for."""
        return sum(1 for t in catalog if self.get(t) is not None)


def read_pack(data: bytes, origin: str) -> Pack:
    try:
        return msgspec.json.decode(data, type=Pack)
    except msgspec.ValidationError as e:
        raise ValueError(f"{origin}: not a case pack: {e}") from None


_builtin: CaseBook | None = None


def builtin() -> CaseBook:
    """Every pack shipped with the package (read once)."""
    global _builtin
    if _builtin is None:
        entries: dict[str, Written] = {}
        folder = importlib.resources.files(__package__).joinpath(PACK_DIR)
        for item in sorted(folder.iterdir(), key=lambda p: p.name) if folder.is_dir() else ():
            if item.name.endswith(".json"):
                pack = read_pack(item.read_bytes(), f"{PACK_DIR}/{item.name}")
                for t in pack.tools:
                    entries[t.key] = Written(clean(t.cases), clean(t.near_misses), f"pack:{pack.server}")
        _builtin = CaseBook(entries)
    return _builtin


def stored(store: Store | None) -> CaseBook:
    """What a case writer wrote into this store (an empty book without a store)."""
    if store is None:
        return CaseBook()
    store.ensure_schema(SCHEMA)
    entries: dict[str, Written] = {}
    for key, writer, body in store.query("SELECT key, writer, body FROM written_cases"):
        raw = orjson.loads(body)
        entries[key] = Written(clean(raw.get("cases", ())), clean(raw.get("near_misses", ())), writer)
    return CaseBook(entries)


def keep(store: Store, items: Sequence[tuple[Tool, Written]]) -> None:
    """Keep what a writer wrote, by tool key, so a catalog is written once."""
    store.ensure_schema(SCHEMA)
    now = time.time()
    rows = [(tool_key(tool), w.origin, orjson.dumps({"cases": list(w.cases), "near_misses": list(w.near_misses)}), now)
            for tool, w in items]  # fmt: skip
    store.write(lambda tx: tx.executemany(
        "INSERT INTO written_cases (key, writer, body, created) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (key) DO UPDATE SET writer = excluded.writer, body = excluded.body, created = excluded.created",
        rows))  # fmt: skip


def book_for(store: Store | None, packs: bool) -> CaseBook:
    """What the pipeline fills a catalog from: the store's written cases over the packs."""
    base = builtin() if packs else CaseBook()
    return stored(store).over(base)
