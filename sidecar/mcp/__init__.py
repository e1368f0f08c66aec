"""Live catalogs: the configured MCP servers, connected with the official `mcp` SDK.

    config.py       the mcpServers JSON (Claude Desktop / Cursor) and the sidecar's options
    state.py        per-server state machine, circuit breaker, backoff, tool-list diffs (pure)
    connections.py  ConnectionManager: lazy connections, retries, list_changed, call()
    live.py         LiveCatalog: live tool lists -> Catalog (server__tool) -> Pipeline.reindex

The SDK is the top-level package `mcp`; modules here import it absolutely (`import mcp`),
so this package's own name never shadows it. Nothing is imported eagerly: the CLI and the
pipeline do not pay for the SDK unless live servers are used.
"""
