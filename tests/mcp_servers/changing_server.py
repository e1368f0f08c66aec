"""A small real MCP server (official SDK, stdio) whose tool list changes at run time.

Tools: `add` and `echo`; calling `grow` adds `multiply`, rewrites `echo`'s description
and removes `add`, then announces `notifications/tools/list_changed` (on a legacy
connection as a plain notification, on a 2026-07-28 one through `subscriptions/listen`).
`pid` returns the process id, so a test can kill the server from outside.
`--pages N` serves tools/list in pages of N tools (cursor pagination); `--http PORT`
serves streamable HTTP on 127.0.0.1 instead of stdio.
"""

from __future__ import annotations

import argparse
import os

import mcp_types as types
from mcp.server.mcpserver import Context, MCPServer

parser = argparse.ArgumentParser()
parser.add_argument("--pages", type=int, default=0, help="page size for tools/list (0: one page)")
parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on 127.0.0.1:PORT/mcp instead of stdio")
opts = parser.parse_args()



class PagedServer(MCPServer):
    """Serves tools/list in pages of `--pages` tools when asked to, with the cursor an offset."""

    async def _handle_list_tools(self, ctx, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        tools = await self.list_tools()
        if opts.pages <= 0:
            return types.ListToolsResult(tools=tools)
        start = int(params.cursor) if params is not None and params.cursor else 0
        end = start + opts.pages
        return types.ListToolsResult(tools=tools[start:end], next_cursor=str(end) if end < len(tools) else None)


server = PagedServer("changing-server", version="1.0.0", log_level="WARNING")


def add(a: int, b: int) -> int:
    """Add two integers and return the sum."""
    return a + b


def echo(text: str) -> str:
    """Repeat the given text back unchanged."""
    return text


def multiply(a: int, b: int) -> int:
    """Multiply two integers and return the product."""
    return a * b


server.add_tool(add)
server.add_tool(echo)


@server.tool()
async def grow(ctx: Context) -> str:
    """Change this server's tool list and announce it."""
    server.add_tool(multiply)
    server.remove_tool("echo")
    server.add_tool(echo, description="Echo text back, shouting it in capital letters.")
    server.remove_tool("add")
    await ctx.notify_tools_changed()  # 2026-07-28: subscriptions/listen streams
    try:
        await ctx.session.send_tool_list_changed()  # handshake era: a plain notification
    except Exception:  # not available on this connection's era
        pass
    return "grown"


@server.tool()
def pid() -> int:
    """Return this server's process id."""
    return os.getpid()


if opts.http:
    server.run("streamable-http", host="127.0.0.1", port=opts.http)
else:
    server.run("stdio")
