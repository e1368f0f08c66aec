"""What a text names that a tool takes, as a view of the ranker.

"open notes.txt" lies close to a notes server's `read_note` in any sentence embedding: the
words agree. What tells them apart is the thing named: `notes.txt` is a file, and only tools
with a file among their parameters can open one. So the ranker gets, beside the words, the
kinds of argument a text names (a file, a folder, a URL, an e-mail address, a commit) and
whether a tool's input schema takes them.

The text side reads tokens, each matched whole by an anchored pattern: linear in the text,
whatever a client sends. The tool side reads the names, formats and descriptions of the
input schema's properties ("repo_path" takes a folder, "revision" a commit, a string of
format "email" an address). One view per (text, tool): the share of the kinds the text names
that the tool takes, 0 where the text names none. A catalog without schemas gets 0 for
every tool, which leaves the ranking as it was.

Times and amounts of money were kinds too, and were dropped: most requests of every style name
a date or a price as a filter ("the newsletters from last month"), and a tool's parameters
mention dates everywhere; fitted with the others (MiniLM), times gained the verb probe half a
point and cost Seal-Tools 0.4, amounts cost BFCL's synthetic set (docs/benchmarks.md).

Pure: no model, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import regex

from .actions import ActionIndex
from .cases import name_words
from .catalog import Tool
from ..learn.learned import server_ids

KINDS = ("file", "folder", "slug", "url", "email", "commit")

MAX_TOKEN = 200  # longer tokens name nothing a tool takes
_EXTENSIONS = ("txt md markdown rst py js jsx ts tsx json jsonl yaml yml toml ini cfg conf env csv tsv xml html htm css scss pdf doc "
               "docx xls xlsx ppt pptx odt png jpg jpeg gif svg webp bmp ico mp3 mp4 wav mov avi zip tar gz tgz bz2 7z rar log sh bash "
               "zsh ps1 bat sql db sqlite ipynb rs go java kt cc cpp hpp cs rb php swift lua pl lock")  # fmt: skip; not .c / .h: "D.C."
_FILE = regex.compile(r"(?:[~.]?/)?(?:[\w.@-]+/)*(?:[\w-][\w.-]*)?\.(?:" + "|".join(_EXTENSIONS.split()) + r")", regex.I)
_FOLDER = regex.compile(r"(?:~|\.{1,2})?/(?:[\w.-]+/)*[\w.-]*|[a-z_.][\w.-]*/(?:[\w.-]+/)+[\w.-]*|[a-z_.][\w.-]*/|~", regex.I)
# One slash, no sigil, three characters a side: a folder ("src/utils"), a repository
# ("acme/webapp") or a branch ("feature/login"); not a unit ("m/s", "km/h") or "and/or".
_SLUG = regex.compile(r"[a-z_][\w.-]{2,}/[\w.-]{3,}", regex.I)
_URL = regex.compile(r"(?:https?://|www\.)\S+", regex.I)
_EMAIL = regex.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
_COMMIT = regex.compile(r"(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}")
_STRIP = "\"'`()[]{}<>,;:!?*"
_NOT_FOLDERS = frozenset("either/or his/her him/her yes/no true/false input/output read/write".split())


def of_text(text: str) -> frozenset[str]:
    """The kinds of argument a text names, token by token."""
    found: set[str] = set()
    for raw in text.split():
        token = raw.strip(_STRIP)
        if not token or len(token) > MAX_TOKEN:
            continue
        bare = token.rstrip(".")  # a sentence's full stop is not part of what it names
        low = bare.lower()
        if not any(c in bare for c in "./@~"):  # most words: a commit or nothing
            if 7 <= len(low) <= 40 and _COMMIT.fullmatch(low):
                found.add("commit")
        elif _URL.fullmatch(token):
            found.add("url")
        elif _EMAIL.fullmatch(bare):
            found.add("email")
        elif _FILE.fullmatch(bare):
            found.add("file")
        elif _SLUG.fullmatch(bare):
            if low not in _NOT_FOLDERS:
                found.add("slug")
        elif _FOLDER.fullmatch(bare):
            found.add("folder")
    return frozenset(found)


# A property takes a kind when a word of its name (split as tool names are) is one of these,
# its `format` is one of these, or its description says so.
_NAME_WORDS: Mapping[str, frozenset[str]] = {
    "file": frozenset("path paths file files filename filenames filepath source destination attachment attachments".split()),
    "folder": frozenset("path paths dir directory directories folder folders cwd root workdir destination".split()),
    "url": frozenset("url urls uri link links href website endpoint".split()),
    "email": frozenset("email emails cc bcc recipient recipients sender".split()),
    "commit": frozenset("sha commit revision rev hash ref".split()),
}
_SLUG_WORDS = frozenset("repo repository owner branch".split())  # besides a folder, what "a/b" names
_ONLY_FOLDER = frozenset("repo repository dir directory folder cwd root workdir".split())  # "repo_path" is a folder, never a file
_FORMATS = {"uri": "url", "url": "url", "email": "email", "idn-email": "email"}
_DESCRIBED = {
    "file": regex.compile(r"\bfile\s*(?:path|name)\b|\bpath\s+(?:to|of)\s+(?:the\s+)?file\b", regex.I),
    "folder": regex.compile(r"\b(?:directory|folder)\b", regex.I),
    "url": regex.compile(r"\burls?\b", regex.I),
    "email": regex.compile(r"\be-?mail\s+address", regex.I),
}


def of_property(name: str, schema: Any) -> frozenset[str]:
    """The kinds one input-schema property takes."""
    schema = schema if isinstance(schema, dict) else {}
    words = set(name_words(name).split())
    kinds = {k for k, vocabulary in _NAME_WORDS.items() if words & vocabulary}
    if words & _ONLY_FOLDER:
        kinds.discard("file")
    if "folder" in kinds or words & _SLUG_WORDS:
        kinds.add("slug")
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt in _FORMATS:
        kinds.add(_FORMATS[fmt])
    described = schema.get("description")
    if isinstance(described, str):
        head = described[:200]
        kinds.update(k for k, pattern in _DESCRIBED.items() if pattern.search(head))
    return frozenset(kinds)


OPTIONAL = 0.5  # a kind only an optional property takes ("attachments" of `draft_email`) counts half


def of_tool(tool: Tool) -> dict[str, float]:
    """The kinds a tool's input schema takes, over its properties and one level of their
    items / nested properties (a `files` array of objects with a `url`): 1 where a
    required property takes it (or the schema says nothing of what is required), OPTIONAL
    where only optional ones do."""
    out: dict[str, float] = {}
    for name, sub, required in _properties(tool.inputSchema):
        for kind in of_property(name, sub):
            out[kind] = max(out.get(kind, 0.0), 1.0 if required else OPTIONAL)
    return out


def _properties(schema: Any, depth: int = 0, inherited: bool = True) -> Iterable[tuple[str, Any, bool]]:
    """(name, schema, required) of each property; with no `required` list, all are."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict):
        return
    listed = schema.get("required")
    for name, sub in props.items():
        required = inherited and (not isinstance(listed, list) or name in listed)
        yield str(name), sub, required
        if depth < 1 and isinstance(sub, dict):
            yield from _properties(sub.get("items") if sub.get("type") == "array" else sub, depth + 1, required)


class ArgumentIndex:
    """A catalog's tools as a (tools, kinds) indicator matrix, so a batch of texts gets the
    view in one product."""

    def __init__(self, tools: Sequence[Tool]):
        self.takes = _indicators([of_tool(t) for t in tools])  # (tools, kinds), 1 or OPTIONAL

    def views(self, texts: Sequence[str]) -> np.ndarray:
        """(texts, tools, 1): the share of each text's kinds the tool takes."""
        named = _indicators([of_text(t) for t in texts])
        share = (named @ self.takes.T) / np.maximum(named.sum(axis=1, keepdims=True), 1.0)
        return share[..., None].astype(np.float32)


def _indicators(rows: Sequence[Mapping[str, float] | frozenset[str]]) -> np.ndarray:
    out = np.zeros((len(rows), len(KINDS)), np.float32)
    for r, kinds in enumerate(rows):
        for k in kinds:
            out[r, KINDS.index(k)] = kinds[k] if isinstance(kinds, Mapping) else 1.0
    return out


class SymbolicIndex:
    """The ranker's views read from words, not embeddings: `action` and `clash` (the verb,
    `actions.py`) and `argument` (the things named, this module); and each tool's server,
    which the server view groups the tools by (`learned.server_view`)."""

    def __init__(self, tools: Sequence[Tool]):
        self.actions, self.arguments = ActionIndex(tools), ArgumentIndex(tools)
        self.servers = server_ids([t.server for t in tools])

    def views(self, texts: Sequence[str]) -> np.ndarray:
        """(texts, tools, 3)."""
        return np.concatenate([self.actions.views(texts), self.arguments.views(texts)], axis=-1)
