"""A case writer: an LLM writes example requests for a tool from its definition, once per tool.

Catalogs of real MCP servers ship no example requests; the pipeline fits a classifier and its
own gate and ranker from them where they exist (core/casebook.py fills them in). This module
asks a chat model for them: an OpenAI-compatible API (`openai:URL`) or a local GGUF model
through llama-cpp-python (`gguf:PATH`). The prompt (writer_prompt.md, beside this module) is the
one the shipped case packs were written with.

A GGUF without a chat template is a base model (a plain next-token predictor, like Gemma 3
270M): it cannot follow that prompt, so it gets a completion instead, two worked examples of
other domains (writer_fewshot.txt) and the tool's own block left open at its first bullet,
and its lines are read (`parse_lines`), never JSON.

A reply is data, never instructions: it must be the JSON object the prompt asks for (or, from a
base model, bullet lines), and each text is cleaned and capped (`casebook.clean`); anything
else is refused with a WriterError naming the tool, and that tool keeps its description alone.
`sift` then drops what a writer repeated across tools and, given an embedder, each request the
embedding places nearer another tool's description than its own.
"""

from __future__ import annotations

import importlib.resources
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import numpy as np
import orjson
import regex

from ..core.casebook import Written, clean
from ..core.catalog import Tool
from ..core.embed import Embedder

MAX_DESCRIPTION_CHARS = 2000  # of the tool's description shown to the writer
MAX_PARAMETERS_CHARS = 1500  # of its parameters, as compact JSON
MAX_REPLY_CHARS = 20_000  # a longer reply is not the asked JSON
MIN_REQUESTS = 3  # fewer usable requests than this is a failed reply
MIN_LINE_WORDS = 3  # a base model's shorter lines are fragments ("16.46", "sum,")
FEW_SHOT_WANT = 10  # requests asked of a base model, in at most FEW_SHOT_ROUNDS completions
FEW_SHOT_ROUNDS = 2
FEW_SHOT_PARAMETERS = 10  # parameter names shown to a base model
FEW_SHOT_DESCRIPTION_CHARS = 300


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


def few_shot_prompt(tool: Tool) -> str:
    """A base model's completion prompt: the worked examples, then this tool's block (server,
    name, the description's head, parameter names) open at its first bullet. The prompt ends
    on "-", not "- ": the tokenizer puts the space in front of the next word, and a prompt
    ending on a bare space led Gemma 3 270M to digits and fragments."""
    examples = importlib.resources.files(__package__).joinpath("writer_fewshot.txt").read_text("utf-8")
    props = list(((tool.inputSchema or {}).get("properties") or {}))[:FEW_SHOT_PARAMETERS]
    lines = [f"Server: {tool.server or '-'}", f"Tool: {tool.bare_name}"]
    if description := " ".join((tool.description or "").split())[:FEW_SHOT_DESCRIPTION_CHARS]:
        lines.append(f"Description: {description}")
    if props:
        lines.append(f"Parameters: {', '.join(props)}")
    return examples + "\n".join(lines) + "\nRequests:\n-"


_BULLET = regex.compile(r"^\s*(?:[-*•]|\d{1,2}[.)])\s+(.*)$")


def parse_lines(completion: str, tool: Tool) -> list[str]:
    """The requests of a base model's completion (which continues after the prompt's "-"):
    its bullet lines up to the first line that is not one, without fragments (fewer than
    MIN_LINE_WORDS words, or no letter) and without lines quoting the tool's identifier."""
    out = []
    name = tool.bare_name.casefold()
    quoted = bool(regex.search(r"[_.-]|[a-z][A-Z]", tool.bare_name))  # an identifier no one types
    for i, line in enumerate(("-" + completion).splitlines()):
        m = _BULLET.match(line)
        if m is None or (i and line[:1].isspace()):  # the list ended, or a nested item
            break
        text = m.group(1).strip()
        if len(text.split()) < MIN_LINE_WORDS or not regex.search(r"\p{L}", text):
            continue
        if quoted and name in text.casefold():
            continue
        out.append(text)
    return out


class Chat(Protocol):
    """One chat completion: messages in, the reply's text out. A writer that is a base model
    also has `complete` (prompt in, continuation out) and `chat = False`."""

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
    """A local model through llama-cpp-python (the embedding models' runtime): a chat model
    when its GGUF carries a chat template, else a base model written to by completion
    (`few_shot_prompt`; the examples stay in llama.cpp's cache, so each tool costs its own
    block and the lines written)."""

    SAMPLING = {"temperature": 0.8, "top_p": 0.95, "repeat_penalty": 1.1}  # a base model's; recorded with what it writes

    def __init__(self, path: str, threads: int | None = None):
        if not os.path.isfile(path):
            raise WriterError(f"gguf:{path}: no such file")
        from llama_cpp import Llama

        self.spec = f"gguf:{path}"
        try:
            self._llm = Llama(model_path=path, n_ctx=4096, n_threads=threads, verbose=False)
        except (ValueError, RuntimeError) as e:
            raise WriterError(f"{self.spec}: cannot load the model: {e}") from None
        self.chat = bool(self._llm.metadata.get("tokenizer.chat_template"))

    def __call__(self, messages: list[dict[str, str]]) -> str:
        if not self.chat:
            raise WriterError(f"{self.spec} has no chat template (a base model): it is written to by completion")
        out = self._llm.create_chat_completion(messages=messages, max_tokens=1200, temperature=0.7)
        return out["choices"][0]["message"]["content"] or ""

    def complete(self, prompt: str, seed: int = 0, max_tokens: int = 240) -> str:
        out = self._llm.create_completion(prompt, max_tokens=max_tokens, seed=seed, stop=["\n\n", "\nTool:", "\nServer:"],
                                          **self.SAMPLING)  # fmt: skip
        return out["choices"][0]["text"] or ""


def write_one(tool: Tool, chat: Chat, system: str | None = None) -> Written:
    """One tool's cases: by chat with the JSON prompt, or from a base model by few-shot
    completion (up to FEW_SHOT_ROUNDS samples until FEW_SHOT_WANT distinct requests)."""
    if getattr(chat, "chat", True):
        messages = [{"role": "system", "content": system or prompt()}, {"role": "user", "content": tool_message(tool)}]
        return parse_reply(chat(messages), tool.name, chat.spec)
    prompt_text, lines = few_shot_prompt(tool), []
    for seed in range(FEW_SHOT_ROUNDS):
        lines += parse_lines(chat.complete(prompt_text, seed=seed), tool)
        if len(clean(lines)) >= FEW_SHOT_WANT:
            break
    requests = clean(lines)
    if len(requests) < MIN_REQUESTS:
        raise WriterError(f"{tool.name}: the writer wrote {len(requests)} usable requests (at least {MIN_REQUESTS} are needed)")
    return Written(requests, (), chat.spec)


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
        try:
            report.written.append((tool, write_one(tool, chat, system)))
        except WriterError as e:
            report.failed.append((tool, str(e)))
        if on_tool is not None:
            on_tool(tool)
    report.seconds = time.perf_counter() - t0
    return report


class Sifted:
    def __init__(self) -> None:
        self.kept: list[tuple[Tool, Written]] = []
        self.repeated = 0  # requests written for more than one tool
        self.misplaced = 0  # requests the embedding places nearer another tool
        self.emptied: list[Tool] = []  # tools left with fewer than MIN_REQUESTS


def sift(written: Sequence[tuple[Tool, Written]], tools: Sequence[Tool], embedder: Embedder | None = None) -> Sifted:
    """What is left of written cases once a request written for several tools is dropped from
    all of them, and (given `embedder`) each request is dropped whose embedding is nearer
    another tool of `tools` (the whole catalog) than its own, by the tools' one-text views
    (index.primary_text, as documents). A tool left with fewer than MIN_REQUESTS is dropped.
    A weak writer's lines about the wrong thing then fall away; a good writer's mostly stay."""
    from ..core.index import primary_text  # learn's writer, core's view of a tool

    out = Sifted()
    count: dict[str, int] = {}
    for _, w in written:
        for text in {c.casefold() for c in w.cases}:
            count[text] = count.get(text, 0) + 1
    unique = [(t, [c for c in w.cases if count[c.casefold()] == 1], w) for t, w in written]
    out.repeated = sum(len(w.cases) - len(cs) for _, cs, w in unique)
    if embedder is not None and unique:
        names = [t.name for t in tools]
        docs = embedder.embed([primary_text(t) for t in tools], "document").vectors
        texts = [c for _, cs, _ in unique for c in cs]
        sims = embedder.embed(texts, "query").vectors @ docs.T if texts else np.zeros((0, len(tools)))
        row, sifted = 0, []
        for tool, cases, w in unique:
            own = names.index(tool.name) if tool.name in names else None
            keep = []
            for c in cases:
                if own is not None and sims[row].argmax() == own:
                    keep.append(c)
                row += 1
            out.misplaced += len(cases) - len(keep)
            sifted.append((tool, keep, w))
        unique = sifted
    for tool, cases, w in unique:
        if len(cases) < MIN_REQUESTS:
            out.emptied.append(tool)
        else:
            out.kept.append((tool, Written(tuple(cases), w.near_misses, w.origin)))
    return out


def lacking(tools: Iterable[Tool], have: Callable[[Tool], bool], min_own: int) -> list[Tool]:
    """The tools with fewer than `min_own` cases of their own and none written yet."""
    return [t for t in tools if len(t.cases or ()) < min_own and not have(t)]
