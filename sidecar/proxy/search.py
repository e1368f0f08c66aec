"""`find_tools`: the search tool the proxy offers beside the injected ones and answers itself,
so a turn whose inject missed has a way back (docs/proxy.md, "find_tools").

Pure: the tool's definition (MCP shape, one `query` string), the query as the ranking reads it,
and the result the model gets. The ranking is the engine's (`Sidecar.rank`, what `sidecar
recommend` runs); the flow (offer.Judge.find, app.Proxy._run_calls) is the proxy's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import orjson

FIND_TOOLS = "find_tools"

DEFINITION: dict[str, Any] = {
    "name": FIND_TOOLS,
    "description": "Find a tool you do not have. Name the service and the action, e.g. "
    '"server: maps; tool: find parking near a landmark". The tools found are added for your next step.',
    "inputSchema": {"type": "object", "properties": {"query": {"type": "string", "description": "The tool you need."}}, "required": ["query"]},
}

LABEL = re.compile(r"\b(?:server|tool|service|action)\s*:\s*", re.IGNORECASE)
MAX_QUERY_CHARS = 500
DESCRIPTION_CHARS = 160


def query_text(raw: str) -> str:
    """What is ranked of a query: its words without the "server:" / "tool:" labels of the
    suggested style (words every description lacks), the parts joined by ". "."""
    parts = [p.strip() for p in LABEL.sub("", raw[:MAX_QUERY_CHARS]).split(";")]
    return ". ".join(p for p in parts if p)


def one_line(description: str | None) -> str:
    """A description's first sentence (or line), cut at DESCRIPTION_CHARS."""
    text = " ".join((description or "").split())
    m = re.search(r"(?<=[.!?])\s", text)
    first = text[: m.start()] if m else text
    return first if len(first) <= DESCRIPTION_CHARS else first[: DESCRIPTION_CHARS - 1].rstrip() + "…"


def result(query: str, found: Sequence[tuple[str, str]]) -> str:
    """The tool result: the found tools' function names and one-line descriptions, best first."""
    if not found:
        return orjson.dumps({"query": query, "tools": [], "note": "No tool matched. Try other words, or answer without a tool."}).decode()
    tools = [{"name": name, "description": one_line(d)} for name, d in found]
    return orjson.dumps({"query": query, "tools": tools, "note": "These tools are now available: call the one that fits."}).decode()


def refused(message: str) -> str:
    return orjson.dumps({"error": message}).decode()
