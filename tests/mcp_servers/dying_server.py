"""A small real MCP server (official SDK, stdio) that dies in the middle of a call.

`fetch_page` exits the process before answering (the server crashed mid-call);
`download_page` does the same job and works, so it is the natural fallback.
"""

from __future__ import annotations

import os

from mcp.server.mcpserver import MCPServer

server = MCPServer("dying-server", version="1.0.0", log_level="WARNING")


@server.tool()
def fetch_page(url: str) -> str:
    """Fetch a web page by its URL and return its text."""
    os._exit(17)


@server.tool()
def download_page(url: str) -> str:
    """Download a web page from a URL and return its text content."""
    return f"<html>the page at {url}</html>"


server.run("stdio")
