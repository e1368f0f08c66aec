"""What the proxy adds to a request, decided by the engine, whichever API it speaks (a
`shapes.Dialect`: OpenAI Chat Completions or Anthropic Messages): the same `Session`, `judge` and
`inject_for` the websocket server runs (session.py), so a text injects the same tools through
either door. A request is one session: its last user turn is judged whole (stream "user"),
each reply's text is fed to the streaming gate as the model writes it (stream "reply-N").

A short last turn ("and in Paris?") is also judged joined to the user turn before it, in the
same batch; its own inject comes first, the joined one stands in when it has none.

Policy on top of the inject: an auto-tier inject adds its tools, a confirm-tier one only with
`proxy.confirm_tools = "include"`; tools the conversation already called stay offered (the
model sees its own earlier calls), and a tool whose function name the client already uses is
never replaced.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..config import Config
from ..core.pipeline import Request
from ..protocol import Hello, Inject
from ..recommend.filters import Context
from ..serve.session import Evaluation, Scope, Session, inject_for, judge
from . import search, shapes

if TYPE_CHECKING:
    from ..engine import Sidecar
    from ..mcp.live import LiveCatalog

log = logging.getLogger("sidecar.proxy")

CONTEXT_WORDS = 8  # a last user turn of at most this many words is also judged joined to the turn before it


@dataclass
class Offer:
    """The tools the proxy adds to one request, in the request's shape (OpenAI function tools,
    Anthropic tools)."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    names: dict[str, str] = field(default_factory=dict)  # function name -> catalog name
    runnable: set[str] = field(default_factory=set)  # function names the proxy runs itself (live MCP tools)
    tier: str | None = None
    probability: float | None = None
    searches: int = 0  # find_tools calls answered in this request

    def ours(self, function: str) -> bool:
        return function in self.runnable

    @property
    def searchable(self) -> bool:
        """find_tools is offered: the proxy answers its calls."""
        return search.FIND_TOOLS in self.runnable


class Judge:
    """Judges one request's texts on the engine's model thread (`executor`)."""

    def __init__(self, cfg: Config, engine: Sidecar, live: LiveCatalog | None, executor: Executor, agent: str | None = None,
                 dialect: shapes.Dialect = shapes.CHAT):  # fmt: skip
        self.cfg, self.engine, self.live, self.executor, self.dialect = cfg, engine, live, executor, dialect
        self.session = Session(cfg.server)
        self.vectors: dict[str, Any] = {}  # each judged user stream's query vector (what learning from traffic keeps)
        self.called: list[str] = []  # catalog names of the tools the model called in this request's replies, first first
        self.agent = agent
        down = live.unavailable if live is not None else None
        self.session.start(Hello(session="proxy", agent=agent), Scope(None, Context(agent=agent), engine, down))

    async def judge(self, evaluations: Sequence[Evaluation]) -> list[Inject]:
        """The injects `evaluations` call for (their tools not yet injected on their stream)."""
        if not evaluations:
            return []
        verdicts, _ = await asyncio.get_running_loop().run_in_executor(self.executor, judge, evaluations)
        self.vectors.update((v.ev.stream.id, v.judgement.vector) for v in verdicts if v.ev.source == "user")
        limits = self.cfg.server
        return [inj for v in verdicts if (inj := inject_for(v, limits.margin_for(v.ev.source))) is not None]

    async def user_turn(self, text: str, before: str = "") -> list[Inject]:
        """The injects for the last user turn: its own and, for a short turn ("and in Paris?")
        with a user turn `before` it, that of both turns joined, judged in the same batch (one
        embedding call): what a follow-up needs is often named only in the turn it follows."""
        now = time.perf_counter()
        evaluations = self.session.on_user("user", text, now)
        if before and len(text.split()) <= CONTEXT_WORDS:
            evaluations += self.session.on_user("context", f"{before}\n{text}", now)
        found = {inj.stream: inj for inj in await self.judge(evaluations)}
        return [found[s] for s in ("user", "context") if s in found]

    def allowed(self, inject: Inject) -> bool:
        """The tier policy: auto always, confirm only when configured to include it."""
        return inject.tier == "auto" or self.cfg.proxy.confirm_tools == "include"

    def runnable(self, catalog_name: str) -> bool:
        """A tool of a live MCP server the proxy can call."""
        if self.live is None:
            return False
        tool = self.engine.catalog.get(catalog_name)
        return tool is not None and tool.server is not None and tool.server in self.live.manager.names

    def add(self, offer: Offer, definitions: Sequence[Mapping[str, Any]], taken: Collection[str]) -> list[dict[str, Any]]:
        """Add MCP `definitions` to `offer` (not those whose function name is in `taken` or
        already offered); returns the tools added, in the request's shape."""
        added = []
        for d in definitions:
            fname = shapes.function_name(d["name"])
            if fname in taken or fname in offer.names:
                continue
            tool = self.dialect.tool(d, fname)
            offer.tools.append(tool)
            offer.names[fname] = d["name"]
            if self.runnable(d["name"]):
                offer.runnable.add(fname)
            added.append(tool)
        return added

    async def offer(self, body: Mapping[str, Any]) -> Offer:
        """What to add to `body`: nothing when its tool_choice forbids; else the last user
        turn's inject (by the tier policy), the catalog tools the conversation called, and
        find_tools by `proxy.find_tools` (not when the client has a tool of that name)."""
        offer = Offer()
        dialect = self.dialect
        if not dialect.adds_tools(body):
            return offer
        messages = body["messages"]
        taken = dialect.client_tool_names(body)
        turns = dialect.user_turns(messages)
        for name in dialect.called_names(messages[: shapes.last_user_index(messages)]):  # calls before the last turn: someone using tools (`[gate] after_call`)
            self.session.called(name)
        found = await self.user_turn(turns[-1], turns[-2] if len(turns) > 1 else "") if turns else []
        inject = next((inj for inj in found if self.allowed(inj)), None)
        injected = []
        if inject is not None:
            offer.tier, offer.probability = inject.tier, inject.probability
            injected = self.add(offer, [t.definition for t in inject.tools], taken)
        catalog = self.engine.catalog
        earlier = [t.definition() for n in dialect.called_names(messages) if (t := catalog.get(n)) is not None]
        self.add(offer, earlier, taken)
        policy = self.cfg.proxy.find_tools
        if (policy == "always" or policy == "when_none" and not injected) and search.FIND_TOOLS not in taken and search.FIND_TOOLS not in offer.names:
            offer.tools.append(dialect.tool(search.DEFINITION))
            offer.runnable.add(search.FIND_TOOLS)
        return offer

    async def find(self, offer: Offer, query: Any, taken: Collection[str]) -> tuple[str, str]:
        """Answer one find_tools call: the query ranked by the engine (`Sidecar.rank`, as
        `sidecar recommend`), the best `proxy.find_tools_top` tools added to `offer`, and the
        tool result naming them; with the outcome ("found", "none", "limit", "bad_query")."""
        opts = self.cfg.proxy
        if offer.searches >= opts.max_searches:
            return search.refused(f"no more searches in this request (at most {opts.max_searches}): use the tools you have"), "limit"
        if not isinstance(query, str) or not (text := search.query_text(query)):
            return search.refused('find_tools needs "query": the tool you need, e.g. "server: maps; tool: find parking near a landmark"'), "bad_query"
        offer.searches += 1
        down = sorted(self.live.unavailable()) if self.live is not None else []
        context = Context(agent=self.agent, unavailable_servers=down)
        ranked = await asyncio.get_running_loop().run_in_executor(
            self.executor, lambda: self.engine.rank(Request(text), opts.find_tools_top, context=context))
        catalog = self.engine.catalog
        tools = [t for r in ranked.results if (t := catalog.get(r.tool)) is not None]
        self.add(offer, [t.definition() for t in tools], taken)
        by_name = {v: k for k, v in offer.names.items()}
        found = [(by_name.get(t.name, shapes.function_name(t.name)), t.description) for t in tools]
        return search.result(query, found), "found" if found else "none"


class Narration:
    """The streaming gate over one reply: its text as the model writes it, judged as LLM output
    off the event loop, each clause superseding its shorter self. `found` collects injects
    whose tools the request was not given."""

    def __init__(self, judge: Judge, stream: str, given: Collection[str]):
        self.judge, self.stream, self.given = judge, stream, set(given)
        self.found: list[Inject] = []
        self._waiting: dict[object, Evaluation] = {}
        self._task: asyncio.Task | None = None
        self._fed = False

    def feed(self, delta: str) -> None:
        self._fed = True
        for ev in self.judge.session.on_token(self.stream, delta, time.perf_counter()):
            self._waiting[ev.key] = ev
        if self._waiting and (self._task is None or self._task.done()):
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while self._waiting:
            batch, self._waiting = list(self._waiting.values()), {}
            try:
                found = await self.judge.judge(batch)
            except Exception:  # the reply still streams: a narration is an extra, not the answer
                log.exception("judging a reply's clauses failed")
                continue
            for inject in found:
                self._found(inject)

    def _found(self, inject: Inject) -> None:
        if not self.judge.allowed(inject):
            return
        tools = [t for t in inject.tools if shapes.function_name(t.definition["name"]) not in self.given]
        if tools:
            self.given.update(shapes.function_name(t.definition["name"]) for t in tools)
            self.found.append(Inject(stream=inject.stream, tier=inject.tier, probability=inject.probability, tools=tools,
                                     trigger=inject.trigger, sent_at=inject.sent_at, latency_ms=inject.latency_ms))  # fmt: skip

    def take(self) -> list[Inject]:
        found, self.found = self.found, []
        return found

    async def end(self) -> list[Inject]:
        """The reply is complete: judge its last clause, wait for every judgement, and return
        what was found and not yet taken."""
        for ev in self.judge.session.on_end(self.stream, time.perf_counter()) if self._fed else ():
            self._waiting[ev.key] = ev
        while self._waiting or (self._task is not None and not self._task.done()):
            if self._task is None or self._task.done():
                self._task = asyncio.ensure_future(self._run())
            await asyncio.shield(self._task)
        return self.take()

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
