"""Which tools may be recommended at all, given who asks and what is working right now.

Pure: the recommender gathers the facts (failing servers, recent call counts) and this
module only decides. Every exclusion carries a reason, so a missing tool can be explained.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Mapping, Sequence

import msgspec
import regex

from ..core.catalog import Tool
from ..protocol import needs_regex
from .intent import ToolProfile


class Permissions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a session's `hello` grants. Globs match the catalog name (server__tool) or the
    server's own tool name."""

    allow: list[str] | None = None  # None: every tool
    deny: list[str] = []
    read_only: bool = False  # only tools that change nothing
    destructive: bool = True  # False: no tool that deletes or is annotated destructive


class Context(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    agent: str | None = None  # who asks: picks the A/B variant, the agent bias, the rate limits
    permissions: Permissions | None = None
    project_tags: list[str] = []  # e.g. ["python", "web"]: tools built for other platforms are skipped
    unavailable_servers: list[str] = []  # servers the caller knows are down
    source: str = "user"  # which index to match against: a user turn or LLM output

    def __post_init__(self) -> None:
        if self.source not in ("user", "llm"):
            raise ValueError(f"context.source must be 'user' or 'llm', not {self.source!r}")

    def static_key(self) -> bytes:
        """What the per-tool exclusions that do not depend on the metrics are decided from."""
        return msgspec.json.encode([self.permissions, sorted(self.project_tags)])


class Facts(msgspec.Struct, frozen=True):
    """What the metrics say now."""

    failing_servers: frozenset[str] = frozenset()
    recent_calls: Mapping[tuple[str, str], int] = {}  # this agent's calls per (server, tool) in the window
    rate_limit: int | None = None


PLATFORMS = frozenset(
    "python javascript typescript node nodejs deno rust golang java kotlin swift ruby php csharp dotnet "
    "elixir scala haskell".split()
)
_ALIASES = {"js": "javascript", "ts": "typescript", "nodejs": "node", "py": "python", "c#": "csharp", ".net": "dotnet", "go": "golang"}
_WORD = regex.compile(r"[\p{L}\p{N}#+.]+")


class Tags(msgspec.Struct, frozen=True):
    values: frozenset[str]
    explicit: bool  # from annotations.tags (any vocabulary) rather than inferred platforms


def tool_tags(tool: Tool) -> Tags:
    """What a tool says it is for: `annotations.tags` if given, else the platform names
    (python, javascript, ...) in its name and description."""
    ann = tool.annotations or {}
    tags = ann.get("tags")
    if isinstance(tags, list) and tags:
        return Tags(frozenset(_norm(str(t)) for t in tags), True)
    text = f"{tool.bare_name} {tool.description}".lower().replace("_", " ")
    found = (m.rstrip(".") for m in _WORD.findall(text))
    return Tags(frozenset(_norm(w) for w in found if w in PLATFORMS), False)  # no aliases here: "go to the page"


def _norm(tag: str) -> str:
    tag = tag.lower()
    return _ALIASES.get(tag, tag)


def _matches(tool: Tool, patterns: list[str]) -> bool:
    glob = _globs(tuple(patterns))
    return glob.match(tool.name) or glob.match(tool.bare_name)


class Globs:
    """A session's globs, matched with no Python call per glob: the names among them in a
    set, the prefixes (`github__*`) in one str.startswith, the rest (`protocol.needs_regex`) in
    one compiled alternation (fnmatch's own cache holds 32,768 globs, so hellos of many long
    lists recompiled them on every match: issue 33). fnmatch translates every star but the
    last into an atomic group, so no glob backtracks; compiling costs about 30 us a glob and 2
    us a character, which the hello's caps on those globs bound."""

    def __init__(self, globs: Sequence[str]):
        names, prefixes, patterns = set(), [], []
        for g in globs:
            if needs_regex(g):
                patterns.append(g)
            elif g.endswith("*"):
                prefixes.append(g[:-1])
            else:
                names.add(g)
        self.names, self.prefixes = frozenset(names), tuple(prefixes)
        self.regex = re.compile("|".join(map(fnmatch.translate, patterns))) if patterns else None

    def match(self, name: str) -> bool:
        return name in self.names or name.startswith(self.prefixes) or (self.regex is not None and self.regex.match(name) is not None)


@functools.lru_cache(maxsize=64)
def _globs(patterns: tuple[str, ...]) -> Globs:
    return Globs(patterns)


def compile_permissions(patterns: Sequence[str]) -> None:
    """Compile a session's globs now, into the cache its rankings read: the server does it at
    the hello, on its index thread, so the model thread never spends a list's 8-20 ms."""
    _globs(tuple(patterns))


def exclusion(tool: Tool, prof: ToolProfile, tags: Tags, ctx: Context, facts: Facts) -> str | None:
    """Why `tool` must not be recommended in this context, or None when it may be."""
    perm = ctx.permissions
    if perm is not None:
        if perm.allow is not None and not _matches(tool, perm.allow):
            return "not allowed for this session"
        if perm.deny and _matches(tool, perm.deny):
            return "denied for this session"
        if perm.read_only and not prof.read_only:
            return "session is read-only"
        destructive = (tool.annotations or {}).get("destructiveHint") is True or prof.deletes
        if not perm.destructive and destructive:
            return "session forbids destructive tools"
    server = tool.server or ""
    if server in facts.failing_servers or server in ctx.unavailable_servers:
        return f"server {server or '(none)'} is failing"
    if facts.rate_limit is not None and facts.recent_calls.get((server, tool.bare_name), 0) >= facts.rate_limit:
        return "rate limit reached for this agent"
    if ctx.project_tags and tags.values:
        wanted = {_norm(t) for t in ctx.project_tags}
        judged = wanted if tags.explicit else wanted & PLATFORMS  # a project without platforms keeps them all
        if judged and not tags.values & judged:
            return f"built for {', '.join(sorted(tags.values))}"
    return None


def failing_servers(recent: Mapping[tuple[str, str], object], min_calls: int, failure_rate: float,
                    reporters: Mapping[str, tuple[int, bool]] | None = None, min_reporters: int = 1) -> frozenset[str]:  # fmt: skip
    """Servers whose recent calls (summed over their tools) mostly failed. `recent` maps
    (server, tool) to anything with `calls` and `successes`. With `reporters` (server ->
    (distinct reporters of its failures, whether this process's own calls failed)), a server
    also needs failures from `min_reporters` distinct reporters, or from its own calls: one
    client's reports alone do not take a server away from everyone."""
    per: dict[str, list[int]] = {}
    for (server, _), c in recent.items():
        acc = per.setdefault(server, [0, 0])
        acc[0] += c.calls
        acc[1] += c.calls - c.successes
    out = set()
    for s, (n, bad) in per.items():
        if n < min_calls or bad / n < failure_rate:
            continue
        if reporters is not None:
            distinct, own = reporters.get(s, (0, False))
            if not own and distinct < min_reporters:
                continue
        out.add(s)
    return frozenset(out)
