"""The `mcpServers` JSON (as Claude Desktop and Cursor write it), read into typed structs.

```json
{
  "mcpServers": {
    "filesystem": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "/tmp"]},
    "time": {"command": "uvx", "args": ["mcp-server-time"], "env": {"TZ": "UTC"}},
    "remote": {"url": "https://example.com/mcp", "headers": {"Authorization": "Bearer ..."}}
  },
  "sidecar": {"max_connection_retries": 3, "connection_timeout": 30, "preconnect_servers": ["time"]}
}
```

A server has either `command` (stdio: `args`, `env`, `cwd`) or `url` (streamable HTTP;
`"type": "sse"` for the older SSE transport; `headers`). Keys other clients add to a server
(`autoApprove`, `description`, ...) are ignored; `disabled: true` leaves a server out.
`protocol` is the sidecar's own: `"auto"` (default: the 2026-07-28 `server/discover`
probe, falling back to the `initialize` handshake), `"legacy"` (the handshake only), or a
protocol version. The `sidecar` object holds the connection options (`Options`).
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Literal

import msgspec

from ..core.catalog import SEP
from ..jsonl import read_json

TRANSPORTS = ("stdio", "http", "sse")


class McpConfigError(ValueError):
    """The mcpServers file is unusable; the message names the file and, where known, the server."""


class ServerSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    command: str | None = None
    args: list[str] = []
    env: dict[str, str] = {}
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = {}
    type: Literal["stdio", "http", "streamable-http", "streamableHttp", "streamable_http", "sse"] | None = None
    disabled: bool = False
    protocol: str = "auto"  # "auto" | "legacy" | a modern protocol version (sidecar-only key)

    @property
    def transport(self) -> str:
        """`stdio`, `http` (streamable HTTP) or `sse`."""
        if self.command is not None:
            return "stdio"
        return "sse" if self.type == "sse" else "http"


class Options(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How the sidecar connects: lazily, with retries, then a circuit breaker."""

    max_connection_retries: int = 3  # retries after the first attempt, waiting backoff_base * 2**i s
    connection_timeout: float = 30.0  # one attempt: spawn or reach the server and finish the handshake
    preconnect_servers: list[str] = []  # connected eagerly, in the background, at start
    backoff_base: float = 1.0  # first retry delay; doubles: 1, 2, 4, 8, 16 s
    backoff_max: float = 16.0
    circuit_reset: float = 60.0  # an open circuit fails fast this long, then allows one trial attempt
    request_timeout: float = 60.0  # tools/list and tools/call
    keep_tools: list[str] = []  # server__tool names `sidecar mcp` lists directly beside its meta-tools
    # A failed call is tried once more on the best fallback whose inputSchema takes the same
    # arguments; the result says which tool answered. Off: another tool may act differently.
    auto_retry_fallback: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.max_connection_retries <= 10:
            raise ValueError(f"max_connection_retries={self.max_connection_retries} must be within 0..10")
        for key in ("connection_timeout", "request_timeout"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key}={getattr(self, key)} must be positive")
        for key in ("backoff_base", "backoff_max", "circuit_reset"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key}={getattr(self, key)} must not be negative")


class McpConfig(msgspec.Struct, frozen=True):
    servers: dict[str, ServerSpec]  # enabled servers, in file order
    options: Options = msgspec.field(default_factory=Options)
    origin: str = "<config>"
    disabled: list[str] = []  # servers the file lists with "disabled": true


def _fail(origin: str, msg: str, server: str | None = None) -> McpConfigError:
    where = f"{origin}: server {server!r}" if server is not None else origin
    return McpConfigError(f"{where}: {msg}")


def _spec(name: str, raw: Any, origin: str, base: pathlib.Path | None) -> ServerSpec:
    if not isinstance(raw, dict):
        raise _fail(origin, "must be a JSON object with \"command\" or \"url\"", name)
    known = {f: raw[f] for f in ServerSpec.__struct_fields__ if f in raw}
    try:
        spec = msgspec.convert(known, ServerSpec)
    except msgspec.ValidationError as e:
        raise _fail(origin, str(e).replace("$.", ""), name) from None
    if spec.command is not None and spec.url is not None:
        raise _fail(origin, 'has both "command" and "url": give one', name)
    if spec.command is None and spec.url is None:
        raise _fail(origin, 'needs "command" (stdio) or "url" (streamable HTTP)', name)
    if spec.command is not None and not spec.command.strip():
        raise _fail(origin, '"command" is empty', name)
    if spec.command is not None and spec.type not in (None, "stdio"):
        raise _fail(origin, f'"type": "{spec.type}" needs a "url", not a "command"', name)
    if spec.url is not None:
        if spec.type == "stdio":
            raise _fail(origin, '"type": "stdio" needs a "command", not a "url"', name)
        if not spec.url.startswith(("http://", "https://")):
            raise _fail(origin, f'"url" must be http:// or https://, not {spec.url!r}', name)
    if spec.protocol not in ("auto", "legacy"):
        from mcp_types.version import MODERN_PROTOCOL_VERSIONS

        if spec.protocol not in MODERN_PROTOCOL_VERSIONS:
            allowed = ", ".join(["auto", "legacy", *MODERN_PROTOCOL_VERSIONS])
            raise _fail(origin, f'"protocol" must be one of {allowed}, not {spec.protocol!r}', name)
    if spec.cwd is not None and base is not None and not os.path.isabs(spec.cwd):
        spec = msgspec.structs.replace(spec, cwd=str(base / spec.cwd))
    return spec


def parse(data: Any, origin: str = "<config>", base: pathlib.Path | None = None) -> McpConfig:
    """Validate a decoded mcpServers document. Relative `cwd`s resolve against `base`."""
    if not isinstance(data, dict) or not isinstance(data.get("mcpServers"), dict):
        raise _fail(origin, 'expected {"mcpServers": {"NAME": {"command": ...} | {"url": ...}}}')
    servers: dict[str, ServerSpec] = {}
    disabled: list[str] = []
    for name, raw in data["mcpServers"].items():
        if not name.strip():
            raise _fail(origin, "a server has an empty name")
        if SEP in name:
            raise _fail(origin, f"name must not contain {SEP!r} (tools are named server{SEP}tool)", name)
        spec = _spec(name, raw, origin, base)
        if spec.disabled:
            disabled.append(name)
        else:
            servers[name] = spec
    raw_opts = data.get("sidecar", {})
    if not isinstance(raw_opts, dict):
        raise _fail(origin, '"sidecar" must be an object of connection options')
    try:
        options = msgspec.convert(raw_opts, Options)
    except (msgspec.ValidationError, ValueError) as e:
        raise _fail(origin, f"sidecar options: {str(e).replace('$.', '')}") from None
    def absent(server: str) -> str:
        return "is disabled" if server in disabled else "is not in mcpServers"

    for name in options.preconnect_servers:
        if name not in servers:
            raise _fail(origin, f"sidecar.preconnect_servers names {name!r}, which {absent(name)}")
    for name in options.keep_tools:
        server, sep, tool = name.partition(SEP)
        if not sep or not tool:
            raise _fail(origin, f"sidecar.keep_tools names {name!r}: give it as server{SEP}tool")
        if server not in servers:
            raise _fail(origin, f"sidecar.keep_tools names {name!r}, whose server {server!r} {absent(server)}")
    return McpConfig(servers, options, origin, disabled)


def load(path: str | os.PathLike) -> McpConfig:
    """Read an mcpServers JSON file."""
    path = pathlib.Path(path)
    return parse(read_json(path, McpConfigError), str(path), path.resolve().parent)
