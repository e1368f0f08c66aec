"""A small real MCP server (official SDK, low-level, stdio) that lists the tools of a catalog file
exactly as written: `python catalog_server.py CATALOG.json`. For a test of what `sidecar mcp`
does with tools no runnable server offers (BFCL's APIs, say), where only their definitions
matter (find_tool ranks them); calling one answers an error.
"""

from __future__ import annotations

import json
import sys

import anyio
import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

with open(sys.argv[1], encoding="utf-8") as f:
    doc = json.load(f)
TOOLS = [types.Tool.model_validate(t) for t in (doc["tools"] if isinstance(doc, dict) else doc)]


async def list_tools(ctx, params) -> types.ListToolsResult:
    return types.ListToolsResult(tools=TOOLS)


async def call_tool(ctx, params: types.CallToolRequestParams) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=f"{params.name}: listed only, not runnable here")], is_error=True)


server = Server("catalog-server", version="1.0.0", on_list_tools=list_tools, on_call_tool=call_tool)


async def main() -> None:
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


anyio.run(main)
