"""Example texts for the page's "fill in an example" (`GET /examples`), drawn from the catalog
the sidecar has loaded: a user turn asking for a tool and an assistant reply narrating a call
of it, for a few tools spread over the catalog's servers.

Examples written for one catalog (the notes fixture's "show me the note about onboarding")
fire nothing on another, and a newcomer trying the page on their own catalog learns only
that nothing happens. A tool's own `cases` are requests its author wrote, so a user turn is
its first one; without them, the use-case phrase `cases.derive` makes of its description
("get current weather information for a specified city") reads as a request too.
"""

from __future__ import annotations

import msgspec

from ..core import cases as cases_mod
from ..core.catalog import Catalog, Tool

MAX_EXAMPLES = 6


class Examples(msgspec.Struct):
    user: list[str]  # user turns, each asking for one of the catalog's tools
    reply: list[str]  # assistant replies, each about to call one (the same tools, in order)
    tools: list[str]  # those tools, by name


def examples(catalog: Catalog, n: int = MAX_EXAMPLES) -> Examples:
    picked = spread(catalog, n)
    return Examples([user_turn(t) for t in picked], [reply(t) for t in picked], [t.name for t in picked])


def spread(catalog: Catalog, n: int) -> list[Tool]:
    """Up to `n` tools, one per server in turn (the first of each server, then the second
    ...), so a merged catalog's examples are not all one server's."""
    by_server: dict[str | None, list[Tool]] = {}
    for tool in catalog:
        by_server.setdefault(tool.server, []).append(tool)
    out: list[Tool] = []
    for rank in range(max((len(ts) for ts in by_server.values()), default=0)):
        out.extend(ts[rank] for ts in by_server.values() if rank < len(ts))
        if len(out) >= n:
            break
    return out[:n]


def use_case(tool: Tool) -> str:
    """What the tool is for, as a short imperative phrase: its description's, else its name's."""
    name = cases_mod.name_words(tool.bare_name)
    title = (tool.title or "").strip().lower()
    derived = cases_mod.derive(msgspec.structs.replace(tool, cases=None))
    phrases = [c for c in derived if c.lower() not in (name, title) and len(c.split()) >= 3]
    return phrases[0] if phrases else name


def user_turn(tool: Tool) -> str:
    text = tool.cases[0] if tool.cases else use_case(tool)
    return text[:1].upper() + text[1:]


def reply(tool: Tool) -> str:
    phrase = use_case(tool)
    return f"Sure. I should call {tool.name} to {phrase[:1].lower() + phrase[1:]}. Then I will tell you what I found."
