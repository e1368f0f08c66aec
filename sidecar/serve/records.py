"""tool_result and feedback frames: checked on the event loop (an unknown tool is an error and
nothing is stored), committed to the metrics store on a store thread, those that arrived
meanwhile together, and acknowledged only after the commit; a failed call's `ack` carries
stand-ins for it. Records are scoped by the server's connection id, never by a client-chosen
name."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
from typing import TYPE_CHECKING

import msgspec

from .. import protocol as p
from ..store.metrics import Feedback, Record, RefReused, key_of
from .session import Session
from ..store import StoreBusy

if TYPE_CHECKING:
    from .server import Connection, SidecarServer

log = logging.getLogger("sidecar.server")


BATCH = 256  # records committed in one transaction at most


class Records:
    """The records waiting for the store, in arrival order, and the one task that commits
    them: whatever arrived while a commit ran goes in the next transaction (`write_many`),
    so the store keeps up with a server whose event loop is saturated (a 1,000-connection soak
    committed one record a transaction and a thread hand-off each, fell behind, and held
    53,000 uncommitted records, RSS climbing 10 MB a minute)."""

    def __init__(self, server: SidecarServer):
        self.server = server
        self.pending: set[asyncio.Task] = set()  # the committing task, while it runs
        self._committing = 0  # records in the commit that runs
        self._queue: collections.deque[tuple[Connection, p.ToolResult | p.Feedback, Record]] = collections.deque()

    @property
    def waiting(self) -> int:
        """Records received and not yet committed: queued, or in the commit that runs."""
        return len(self._queue) + self._committing

    def take(self, conn: Connection, msg: p.ToolResult | p.Feedback) -> None:
        """Check the message now (an unknown tool is an error, nothing recorded), queue it for
        the store, ack after the commit."""
        s = conn.session
        if s.scope.catalog.get(msg.tool) is None:
            raise p.ProtocolError("unknown_tool", f"no tool {msg.tool!r} in this session's catalog")
        history = self.server.history
        if history is None:
            raise p.ProtocolError("store_failed", "this sidecar has no store")
        key, digest = ref_key(conn.refs, msg.ref), payload_digest(msg)
        if isinstance(msg, p.ToolResult):
            if s.turns is not None:
                s.turns.called(msg.tool)
            server, tool = key_of(s.scope.catalog, msg.tool)
            record = history.call_record(server, tool, msg.ok, msg.latency_ms, msg.error, agent=s.hello.agent, call_id=key,
                                         reporter=conn.id, digest=digest)  # fmt: skip
        else:
            record = history.feedback_record(feedback_of(s, msg), key, digest)
        conn.records += 1
        self._queue.append((conn, msg, record))
        if not self.pending:
            task = asyncio.create_task(self._commit_all())
            self.pending.add(task)
            task.add_done_callback(self.pending.discard)

    async def _commit_all(self) -> None:
        while self._queue:
            batch = [self._queue.popleft() for _ in range(min(BATCH, len(self._queue)))]
            self._committing = len(batch)
            try:
                answers = await asyncio.to_thread(self._commit, batch)
            except StoreBusy as e:  # another process held the write lock past the bound: the clients may resend
                log.warning("%d records were not recorded: %s", len(batch), e)
                answers = [e] * len(batch)
            except Exception as e:
                log.exception("recording %d records failed", len(batch))
                answers = [e] * len(batch)
            self._committing = 0
            for (conn, msg, _), answer in zip(batch, answers):
                conn.recorded()
                conn.send(self._reply(conn, msg, answer))

    def _commit(self, batch) -> list[p.Ack | Exception]:
        """On a store thread: the batch, committed; for a failed call, its stand-ins."""
        rows = self.server.history.write_many([record for _, _, record in batch])
        answers: list[p.Ack | Exception] = []
        for (conn, msg, _), row in zip(batch, rows):
            if isinstance(row, RefReused) or isinstance(msg, p.Feedback) or msg.ok:
                answers.append(row if isinstance(row, RefReused) else p.Ack(msg.ref, row))
                continue
            scope = conn.session.scope
            try:
                fallbacks = scope.engine.recommender.fallbacks(msg.tool, scope.context) or None
            except Exception:
                log.exception("stand-ins for %s failed", msg.tool)
                fallbacks = None
            answers.append(p.Ack(msg.ref, row, fallbacks))
        return answers

    def _reply(self, conn: Connection, msg: p.ToolResult | p.Feedback, answer: p.Ack | Exception) -> p.Ack | p.Error:
        kind = type(msg).__struct_config__.tag
        if isinstance(answer, p.Ack):
            self.server.metrics.events.labels(kind).inc()
            if kind == "tool_result" and self.server.learner is not None:
                self.server.learner.called()
            return answer
        if isinstance(answer, RefReused):
            return p.Error("ref_reused", f"{kind} not recorded: its ref was already used for a different {kind} "
                                         "(a resend must be the same frame; a new record needs a new ref)", msg.ref)  # fmt: skip
        if isinstance(answer, StoreBusy):
            return p.Error("store_busy", f"{kind} not recorded: the store is locked by another process; "
                                         "resend it (the same ref is counted once)", msg.ref)  # fmt: skip
        return p.Error("store_failed", f"{kind} not recorded: {answer}", msg.ref)


def ref_key(scope: str, ref: p.Ref | None) -> str | None:
    """A record's key in the store, from its `ref` under the connection's key (`ready.resume`,
    a secret the server made, or an earlier connection's that the client sent back as
    hello.resume): a record resent with the same ref, on this connection or after a reconnect,
    is counted once (the ref's JSON keeps 7 and "7" apart). Not the client-chosen
    hello.session, so no other client can claim (or pre-empt) this one's refs."""
    return None if ref is None else f"{scope}\x1f{msgspec.json.encode(ref).decode()}"


def payload_digest(msg: p.ToolResult | p.Feedback) -> str:
    """sha256 of the record as the client sent it (its ref included): a resend must match it."""
    return hashlib.sha256(p.encode(msg)).hexdigest()


def feedback_of(s: Session, msg: p.Feedback) -> Feedback:
    """The feedback row: what was recommended is the ranking the rated tool was injected from
    on this connection (just the tool, if it never was), the query its span unless the client
    names one; `selected` says whether it was used. A rating outside 0..5 is the client's error."""
    variant = s.scope.engine.recommender.weights_for(s.hello.agent)[0]
    ranking, span = s.offered.get(msg.tool, ([msg.tool], ""))
    try:
        return Feedback(query=msg.query or span, recommended=ranking, selected=msg.tool if msg.selected else None,
                        rating=msg.rating, agent=s.hello.agent, variant=variant)  # fmt: skip
    except ValueError as e:
        raise p.ProtocolError("invalid_field", f"feedback: {e}", msg.ref) from None
