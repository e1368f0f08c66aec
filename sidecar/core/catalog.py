"""Tool catalogs: MCP `tools/list` results read from files and merged into one namespace."""

from __future__ import annotations

import functools
import hashlib
import pathlib
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import orjson
import regex

from ..jsonl import read_json

SEP = "__"  # server__tool, as MCP gateways name merged tools


class CatalogError(ValueError):
    """A catalog file is unusable; the message names the file and, where known, the tool."""


class Tool(msgspec.Struct, frozen=True, omit_defaults=True):
    name: str
    description: str = ""
    inputSchema: dict[str, Any] = {}
    title: str | None = None
    outputSchema: dict[str, Any] | None = None
    annotations: dict[str, Any] | None = None
    cases: list[str] | None = None  # use-case phrases written by the catalog's author
    server: str | None = None  # set when merged from a server's catalog

    @property
    def bare_name(self) -> str:
        """The name the server itself gives the tool (without the server__ prefix)."""
        if self.server and self.name.startswith(self.server + SEP):
            return self.name[len(self.server) + len(SEP):]
        return self.name

    @property
    def content_hash(self) -> str:
        """Changes exactly when what the index derives from the tool changes."""
        payload = orjson.dumps(
            [self.name, self.title, self.description, self.inputSchema, self.cases],
            option=orjson.OPT_SORT_KEYS,
        )
        return hashlib.sha256(payload).hexdigest()

    def definition(self) -> dict[str, Any]:
        """The tool as an MCP client expects it in tools/list (what `inject` sends)."""
        out: dict[str, Any] = {"name": self.name}
        if self.title:
            out["title"] = self.title
        out["description"] = self.description
        out["inputSchema"] = self.inputSchema or {"type": "object"}
        if self.outputSchema:
            out["outputSchema"] = self.outputSchema
        if self.annotations:
            out["annotations"] = self.annotations
        return out


class Catalog:
    """An ordered, uniquely named set of tools."""

    def __init__(self, tools: Iterable[Tool], sources: Sequence[str] = ()):
        self.tools = tuple(tools)
        self.sources = tuple(sources)
        self._by_name = {t.name: t for t in self.tools}

    def __len__(self) -> int:
        return len(self.tools)

    def __iter__(self):
        return iter(self.tools)

    def get(self, name: str) -> Tool | None:
        return self._by_name.get(name)

    def names(self) -> list[str]:
        return list(self._by_name)

    @functools.cached_property
    def shared(self) -> frozenset[str]:
        """`shared_sentences` of these tools, found once: a start reads them to look for stored
        rows and again to index, and a cold start indexes the whole catalog part by part."""
        return shared_sentences(self)


def _fail(path: str, msg: str, tool: str | None = None) -> CatalogError:
    where = f"{path}: tool {tool!r}" if tool else path
    return CatalogError(f"{where}: {msg}")


def parse_tools(data: Any, origin: str) -> tuple[str | None, list[Tool]]:
    """Validate a decoded catalog; returns (server name if declared, tools)."""
    if isinstance(data, dict) and isinstance(data.get("result"), dict):
        data = data["result"]  # a raw JSON-RPC response
    if isinstance(data, list):
        data = {"tools": data}
    if not isinstance(data, dict) or not isinstance(data.get("tools"), list):
        raise _fail(origin, 'expected an MCP tools/list result: {"tools": [...]}')
    server = data.get("server")
    if server is not None and (not isinstance(server, str) or not server.strip()):
        raise _fail(origin, '"server" must be a non-empty string')
    tools: list[Tool] = []
    for i, raw in enumerate(data["tools"]):
        label = raw.get("name") if isinstance(raw, dict) and isinstance(raw.get("name"), str) else f"#{i}"
        if not isinstance(raw, dict):
            raise _fail(origin, "is not a JSON object", label)
        fields = {k: raw[k] for k in ("name", "description", "inputSchema", "title", "outputSchema", "annotations", "cases") if k in raw}
        if fields.get("description") is None:
            fields.pop("description", None)
        try:
            tool = msgspec.convert(fields, Tool)
        except msgspec.ValidationError as e:
            raise _fail(origin, str(e).replace("$.", ""), label) from None
        if not tool.name.strip():
            raise _fail(origin, "has an empty name", label)
        if tool.cases is not None and not all(c.strip() for c in tool.cases):
            raise _fail(origin, '"cases" holds an empty phrase', label)
        tools.append(tool)
    return server, tools


def load(paths: Sequence[str | pathlib.Path]) -> Catalog:
    """Read and merge catalog files (a directory stands for its *.json files). With several
    files, names become server__tool."""
    if not paths:
        raise CatalogError("no catalog given (pass --catalog FILE)")
    files: list[pathlib.Path] = []
    for p in map(pathlib.Path, paths):
        if p.is_dir():
            found = sorted(p.glob("*.json"))
            if not found:
                raise CatalogError(f"{p}: directory holds no *.json catalog")
            files.extend(found)
        else:
            files.append(p)
    per_file: list[tuple[str, str, list[Tool]]] = []
    for path in files:
        data = read_json(path, CatalogError)
        server, tools = parse_tools(data, str(path))
        per_file.append((str(path), server or path.stem, tools))
    merge = len(per_file) > 1
    out: list[Tool] = []
    seen: dict[str, str] = {}
    for origin, server, tools in per_file:
        for tool in tools:
            tool = _placed(tool, server, qualify=merge)
            if tool.name in seen:
                raise _fail(origin, f"name is not unique (also in {seen[tool.name]})", tool.name)
            seen[tool.name] = origin
            out.append(tool)
    return Catalog(out, [o for o, _, _ in per_file])


def _placed(tool: Tool, server: str, qualify: bool) -> Tool:
    """Attach the server; qualify the name when merging, unless it already is (ALL.json)."""
    if SEP in tool.name and tool.server is None:
        prefix = tool.name.split(SEP, 1)[0]
        return msgspec.structs.replace(tool, server=prefix)
    name = f"{server}{SEP}{tool.name}" if qualify else tool.name
    return msgspec.structs.replace(tool, name=name, server=server)


def from_tools(tools: Iterable[dict[str, Any]], origin: str = "<session>") -> Catalog:
    """A catalog from in-memory definitions (e.g. tools sent in a session's hello)."""
    _, parsed = parse_tools({"tools": list(tools)}, origin)
    return Catalog(parsed, [origin])


SHARED_BY = 3  # a sentence this many tools' descriptions say tells none of them apart
_SPLIT = regex.compile(r"((?<=[.!?])\s+)")  # sentence, the space after it, sentence, ...
_LABEL = regex.compile(r"^([A-Za-z][\w ]{0,29}):\s+")  # "Tool description: ..."


def _whole(s: str) -> bool:
    """Two words or more, not a wrapped line's tail (lower case first), ending as sentences end."""
    return not s[0].islower() and s[-1] in ".!?" and " " in s


def _sentences(description: str) -> list[list[tuple[str, bool]]]:
    """Per line, its sentences and whether each is whole: a line of hard-wrapped prose
    ("Server/Data Center\ninstances do not ...") begins and ends in mid-sentence."""
    out: list[list[tuple[str, bool]]] = []
    ended = True  # the line before ended a sentence (or there was none)
    for line in description.splitlines():
        parts = _SPLIT.split(line.strip())[::2] if line.strip() else []
        out.append([(p, (ended or i > 0) and _whole(p)) for i, p in enumerate(parts)])
        ended = not parts or parts[-1][-1:] in ".!?:"
    return out


def shared_sentences(catalog: Iterable[Tool]) -> frozenset[str]:
    """The sentences that SHARED_BY or more tools' descriptions say, and the lead-in labels
    ("Tool description:") that as many begin a sentence with: a server's boilerplate ("This
    tool belongs to the trading system, which allows users to ...", "Only works within allowed
    directories.") is the same for each of its tools, so in a tool's embedded text it dilutes
    what the tool alone does and, leading it, takes the place of its first sentence. Labels are
    kept with their colon; `own_description` drops one only where it leads what is left."""
    said: dict[str, int] = {}
    for tool in catalog:
        seen: set[str] = set()
        for line in _sentences(tool.description or ""):
            for s, whole in line:
                if whole:
                    seen.add(s)
                if (label := _LABEL.match(s)) is not None:
                    seen.add(label.group(1) + ":")
        for s in seen:
            said[s] = said.get(s, 0) + 1
    return frozenset(s for s, n in said.items() if n >= SHARED_BY)


def own_description(description: str, shared: frozenset[str]) -> str:
    """`description` without the `shared` sentences and a shared label leading what is left,
    cut from each line so its spacing stays (two spaces part sentences for cases.derive); the
    description itself where nothing else would be left."""
    lines: list[str] = []
    for line, said in zip(description.splitlines(), _sentences(description)):
        if any(whole and s in shared for s, whole in said):
            parts = _SPLIT.split(line.strip())
            line = "".join(
                p for i in range(0, len(parts), 2) if not (said[i // 2][1] and parts[i] in shared) for p in parts[i : i + 2]
            ).strip()
            if not line:
                continue
        if not any(ln.strip() for ln in lines) and (label := _LABEL.match(line.lstrip())) is not None and label.group(1) + ":" in shared:
            line = line.lstrip()[label.end():]
        lines.append(line)
    own = "\n".join(lines).strip()
    return own if own else description


def distinct(catalog: Catalog, shared: frozenset[str] | None = None) -> Catalog:
    """The catalog as the index reads it: each description without what `shared` (default:
    this catalog's, `Catalog.shared`) says many tools say. The catalog served keeps every
    word: an LLM calling the tool needs the boilerplate's rules."""
    shared = catalog.shared if shared is None else shared
    if not shared:
        return catalog
    tools = []
    for tool in catalog:
        said = tool.description and any(s in tool.description for s in shared)  # most say none: no need to split them
        own = own_description(tool.description, shared) if said else tool.description
        tools.append(tool if own == tool.description else msgspec.structs.replace(tool, description=own))
    return Catalog(tools, catalog.sources)
