"""A case writer: an LLM writes example requests for a tool from its definition, once per tool.

Catalogs of real MCP servers ship no example requests; the pipeline fits a classifier and its
own gate and ranker from them where they exist (core/casebook.py fills them in). This module
asks a chat model for them: an OpenAI-compatible API (`openai:URL`) or a local GGUF chat model
through llama-cpp-python (`gguf:PATH`). The prompt (writer_prompt.md, beside this module) is the
one the shipped case packs were written with.

A reply is data, never instructions: it must be the JSON object the prompt asks for, and each
text is cleaned and capped (`casebook.clean`); anything else is refused with a WriterError
naming the tool, and that tool keeps its description alone.
"""

from __future__ import annotations

import importlib.resources
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import orjson
import regex

from ..core.casebook import Written, clean
from ..core.catalog import Tool

MAX_DESCRIPTION_CHARS = 2000  # of the tool's description shown to the writer
MAX_PARAMETERS_CHARS = 1500  # of its parameters, as compact JSON
MAX_REPLY_CHARS = 20_000  # a longer reply is not the asked JSON
MIN_REQUESTS = 3  # fewer usable requests than this is a failed reply


class WriterError(RuntimeError):
    pass


def prompt() -> str:
    return importlib.resources.files(__package__).joinpath("writer_prompt.md").read_text("utf-8")


def tool_message(tool: Tool) -> str:
    """The tool as the writer sees it: server, name, title, description and parameters (cut
    to a bound: a long description's usage notes add nothing a request would say)."""
    props = (tool.inputSchema or {}).get("properties") or {}
    params = {k: {f: v[f] for f in ("type", "description", "enum") if isinstance(v, dict) and f in v} for k, v in props.items()}
    lines = [f"server: {tool.server or '-'}", f"name: {tool.bare_name}"]
    if tool.title:
        lines.append(f"title: {tool.title}")
    lines.append(f"description: {tool.description[:MAX_DESCRIPTION_CHARS]}")
    lines.append(f"parameters: {orjson.dumps(params).decode()[:MAX_PARAMETERS_CHARS]}")
    return "\n".join(lines)


_FENCE = regex.compile(r"^\s*```(?:json)?\s*\n(.*)\n\s*```\s*$", regex.S)


def parse_reply(reply: str, tool: str, origin: str) -> Written:
    """The asked JSON object, its texts cleaned; a WriterError for anything else. A reply
    wrapped in one ```json fence is read (chat models add them unasked); prose is not."""
    if not isinstance(reply, str) or len(reply) > MAX_REPLY_CHARS:
        raise WriterError(f"{tool}: the writer's reply is not the asked JSON (empty or over {MAX_REPLY_CHARS} characters)")
    fenced = _FENCE.match(reply)
    try:
        data = orjson.loads(fenced.group(1) if fenced else reply)
    except orjson.JSONDecodeError:
        raise WriterError(f"{tool}: the writer's reply is not JSON: {reply[:80]!r}") from None
    if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
        raise WriterError(f'{tool}: the writer\'s reply is not {{"requests": [...], "near_misses": [...]}}: {reply[:80]!r}')
    near = data.get("near_misses")
    requests = clean(data["requests"])
    if len(requests) < MIN_REQUESTS:
        raise WriterError(f"{tool}: the writer's reply holds {len(requests)} usable requests (at least {MIN_REQUESTS} are needed)")
    return Written(requests, clean(near if isinstance(near, list) else ()), origin)


class Chat(Protocol):
    """One chat completion: messages in, the reply's text out."""

    spec: str

    def __call__(self, messages: list[dict[str, str]]) -> str: ...


class OpenAIChat:
    """Any OpenAI-compatible chat completions API (`URL` is its base, e.g. http://127.0.0.1:8080/v1)."""

    def __init__(self, url: str, model: str, key: str | None, timeout_s: float):
        import httpx2  # the proxy's client; only the writer needs it here

        self.spec, self.model = f"openai:{url}", model
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._client = httpx2.Client(base_url=url.rstrip("/") + "/", headers=headers, timeout=timeout_s)
        self._errors = (httpx2.HTTPError,)

    def __call__(self, messages: list[dict[str, str]]) -> str:
        body = {"model": self.model, "messages": messages, "temperature": 0.7}
        try:
            r = self._client.post("chat/completions", content=orjson.dumps(body), headers={"Content-Type": "application/json"})
        except self._errors as e:
            raise WriterError(f"{self.spec}: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise WriterError(f"{self.spec}: HTTP {r.status_code}: {r.text[:200]}")
        try:
            return r.json()["choices"][0]["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError):
            raise WriterError(f"{self.spec}: the reply is not a chat completion: {r.text[:120]!r}") from None


class GgufChat:
    """A local chat model through llama-cpp-python (the embedding models' runtime)."""

    def __init__(self, path: str, threads: int | None = None):
        if not os.path.isfile(path):
            raise WriterError(f"gguf:{path}: no such file")
        from llama_cpp import Llama

        self.spec = f"gguf:{path}"
        self._llm = Llama(model_path=path, n_ctx=4096, n_threads=threads, verbose=False)

    def __call__(self, messages: list[dict[str, str]]) -> str:
        out = self._llm.create_chat_completion(messages=messages, max_tokens=1200, temperature=0.7)
        return out["choices"][0]["message"]["content"] or ""


def open_chat(spec: str, model: str | None, key_env: str, timeout_s: float) -> Chat:
    """The writer a `[cases] writer` spec names."""
    kind, _, where = spec.partition(":")
    if kind == "openai":
        if not where:
            raise WriterError("a bare 'openai' writer names `sidecar proxy`'s upstream; elsewhere give openai:URL")
        if not model:
            raise WriterError("cases.writer_model is needed with an openai: writer (the model the API is asked for)")
        return OpenAIChat(where, model, os.environ.get(key_env), timeout_s)
    if kind == "gguf":
        return GgufChat(where)
    raise WriterError(f"{spec!r}: a writer is 'openai:URL' or 'gguf:PATH'")


class Report:
    def __init__(self) -> None:
        self.written: list[tuple[Tool, Written]] = []
        self.failed: list[tuple[Tool, str]] = []
        self.seconds = 0.0


def write_cases(tools: Sequence[Tool], chat: Chat, on_tool: Callable[[Tool], None] | None = None) -> Report:
    """Ask `chat` for each tool's cases; a failed tool is reported and the rest go on."""
    report = Report()
    system = prompt()
    t0 = time.perf_counter()
    for tool in tools:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": tool_message(tool)}]
        try:
            report.written.append((tool, parse_reply(chat(messages), tool.name, chat.spec)))
        except WriterError as e:
            report.failed.append((tool, str(e)))
        if on_tool is not None:
            on_tool(tool)
    report.seconds = time.perf_counter() - t0
    return report


def lacking(tools: Iterable[Tool], have: Callable[[Tool], bool], min_own: int) -> list[Tool]:
    """The tools with fewer than `min_own` cases of their own and none written yet."""
    return [t for t in tools if len(t.cases or ()) < min_own and not have(t)]
