"""Calling a live tool on behalf of a model, recorded: what `sidecar mcp`'s call_tool and the
OpenAI proxy's tool rounds share.

`call_recorded` dispatches a server__tool name through the `ConnectionManager`, records the
call in the metrics store (latency, success, error: the recommender learns from it), and on
failure returns an error result carrying `fallback_suggestions` (full definitions, from
`Recommender.fallbacks`, found by the caller's `fallbacks`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import mcp_types as types
import orjson

from ..store.metrics import MetricsStore, key_of
from .connections import ConnectionManager, ServerUnavailable, describe


def result(payload: dict[str, Any], is_error: bool = False, content: list[Any] | None = None) -> types.CallToolResult:
    """A tool result carrying `payload` as structured content and as JSON text."""
    text = types.TextContent(type="text", text=orjson.dumps(payload).decode())
    return types.CallToolResult(content=[*(content or []), text], structured_content=payload, is_error=is_error)


def error(message: str, **extra: Any) -> types.CallToolResult:
    return result({"error": message, **extra}, is_error=True)


def text_of(res: types.CallToolResult) -> str:
    return " ".join(c.text for c in res.content if isinstance(c, types.TextContent)).strip()


async def call_recorded(manager: ConnectionManager, history: MetricsStore | None, name: str, arguments: dict[str, Any],
                        fallbacks: Callable[[str], Awaitable[list[dict[str, Any]]]], *, agent: str | None = None,
                        retry: bool = True) -> types.CallToolResult:  # fmt: skip
    """Call a server__tool on its live server, record the call, and on failure suggest
    fallbacks; with the `auto_retry_fallback` option (and `retry`), first try the best one
    that takes the same arguments, once. A name no server lists is an error, not recorded."""
    server, tool = key_of(None, name)
    listed = manager.listings().get(server)
    if server not in manager.names or (listed is not None and all(d["name"] != tool for d in listed)):
        return error(f"no tool named {name!r}: use find_tool to get the exact name", tool=name)
    t0 = time.perf_counter()
    res: types.CallToolResult | None = None
    try:
        res = await manager.call(server, tool, arguments)
        failure = (text_of(res) or "the tool reported an error") if res.is_error else None
    except ServerUnavailable as e:
        failure = str(e)
    except Exception as e:  # a protocol error (bad arguments, unknown tool) or a timeout
        failure = describe(e, manager.options.request_timeout)
    latency_ms = (time.perf_counter() - t0) * 1000
    if history is not None:
        history.record_call(server, tool, failure is None, latency_ms, failure, agent=agent)
    if failure is None:
        return res
    suggested = await fallbacks(name)
    if retry and manager.options.auto_retry_fallback:
        alt = next((s for s in suggested if takes(s.get("inputSchema"), arguments)), None)
        if alt is not None:
            again = await call_recorded(manager, history, alt["name"], arguments, fallbacks, agent=agent, retry=False)
            if not again.is_error:
                note = types.TextContent(type="text", text=f"{name} failed ({failure}); {alt['name']} answered instead")
                return types.CallToolResult(content=[note, *again.content], structured_content=again.structured_content, is_error=False)
    payload = {"error": failure, "tool": name, "fallback_suggestions": suggested}
    return result(payload, is_error=True, content=list(res.content) if res is not None else None)


def takes(schema: Any, arguments: dict[str, Any]) -> bool:
    """Whether a tool's inputSchema takes `arguments` as they are: every property it requires
    given, and every argument one it names."""
    if not isinstance(schema, dict):
        return not arguments
    props = schema.get("properties") or {}
    return all(r in arguments for r in schema.get("required") or ()) and all(k in props for k in arguments)
