"""The tool list `sidecar mcp` shows an agent: three meta-tools and the config's keep_tools.

Pure: definitions in, definitions out (MCP tool definitions as the servers list them, JSON
dicts). The server (`server.py`) serves them and the savings report (`savings.py`) counts
them, so what is counted is exactly what is served.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..core.catalog import SEP

FIND_TOOL = "find_tool"
CALL_TOOL = "call_tool"
ALTERNATIVES = "get_tool_alternatives"
DEFAULT_LIMIT = 5
MAX_LIMIT = 50

FIND_TOOL_DEF: dict[str, Any] = {
    "name": FIND_TOOL,
    "description": (
        "Search every tool of the connected MCP servers for the ones that fit a task. Returns their full "
        "definitions (name, description, inputSchema), best first, with a score and why. Use it before "
        "call_tool when no listed tool fits."
    ),
    "inputSchema": {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "What you want to do, in plain words."},
            "limit": {"type": "integer", "description": "How many tools to return.", "default": DEFAULT_LIMIT,
                      "minimum": 1, "maximum": MAX_LIMIT},
        },
        "required": ["query"],
    },
}  # fmt: skip

CALL_TOOL_DEF: dict[str, Any] = {
    "name": CALL_TOOL,
    "description": (
        "Call a tool that find_tool returned, by its exact name, with arguments matching its inputSchema. "
        "On failure the result lists fallback_suggestions: other tools that may do the job."
    ),
    "inputSchema": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "description": "The tool's exact name (server__tool), as find_tool gave it."},
            "arguments": {"type": "object", "description": "The tool's arguments.", "default": {}},
        },
        "required": ["name"],
    },
}

ALTERNATIVES_DEF: dict[str, Any] = {
    "name": ALTERNATIVES,
    "description": (
        "Other tools that may do the job of a tool (one that failed, is slow or is missing something): "
        "full definitions, best first, each with a score and the reason."
    ),
    "inputSchema": {
        "type": "object",
        "properties": {"name": {"type": "string", "description": "The tool's exact name (server__tool)."}},
        "required": ["name"],
    },
}

META_TOOLS = (FIND_TOOL_DEF, CALL_TOOL_DEF, ALTERNATIVES_DEF)


def qualified(server: str, definition: Mapping[str, Any]) -> dict[str, Any]:
    """A server's tool definition under its sidecar name, server__tool."""
    return {**definition, "name": f"{server}{SEP}{definition['name']}"}


def all_tools(listings: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Every listed tool, {server__tool: definition}: what an agent sees without the sidecar."""
    return {f"{server}{SEP}{d['name']}": qualified(server, d) for server, defs in listings.items() for d in defs}


def exposed_tools(listings: Mapping[str, Sequence[Mapping[str, Any]]], keep_tools: Iterable[str]) -> list[dict[str, Any]]:
    """The meta-tools, then the keep_tools the servers list now (in the config's order)."""
    every = all_tools(listings)
    return [*META_TOOLS, *(every[name] for name in keep_tools if name in every)]
