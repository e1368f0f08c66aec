"""tool_result and feedback frames: checked on the event loop (an unknown tool is an error and
nothing is stored), committed to the metrics store on a store thread, and acknowledged only
after the commit; a failed call's `ack` carries stand-ins for it. Records are scoped by the
server's connection id, never by a client-chosen name."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from .. import protocol as p
from ..store.metrics import Feedback, RefReused, key_of
from .session import Session
from ..store import StoreBusy

if TYPE_CHECKING:
    from .server import Connection, SidecarServer

log = logging.getLogger("sidecar.server")


class Records:
    def __init__(self, server: SidecarServer):
        self.server = server
        self.pending: set[asyncio.Task] = set()

    def take(self, conn: Connection, msg: p.ToolResult | p.Feedback) -> None:
        """Check the message now (an unknown tool is an error, nothing recorded), commit it on
        a store thread, ack after the commit."""
        s = conn.session
        if s.scope.catalog.get(msg.tool) is None:
            raise p.ProtocolError("unknown_tool", f"no tool {msg.tool!r} in this session's catalog")
        if self.server.history is None:
            raise p.ProtocolError("store_failed", "this sidecar has no store")
        key, digest = ref_key(conn.refs, msg.ref), payload_digest(msg)
        if isinstance(msg, p.ToolResult):
            if s.turns is not None:
                s.turns.called(msg.tool)
            write = functools.partial(self._store_call, conn, msg, key, digest)
        else:
            write = functools.partial(self._store_feedback, feedback_of(s, msg), msg.ref, key, digest)
        conn.records += 1
        task = asyncio.create_task(self._commit(conn, type(msg).__struct_config__.tag, write, msg.ref))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _commit(self, conn: Connection, kind: str, write: Callable[[], p.Ack], ref: p.Ref | None) -> None:
        try:
            ack = await asyncio.to_thread(write)
        except RefReused:
            conn.send(p.Error("ref_reused", f"{kind} not recorded: its ref was already used for a different {kind} "
                                            "(a resend must be the same frame; a new record needs a new ref)", ref))  # fmt: skip
            return
        except StoreBusy as e:  # another process held the write lock past the bound: the client may resend
            log.warning("a %s was not recorded: %s", kind, e)
            conn.send(p.Error("store_busy", f"{kind} not recorded: the store is locked by another process; "
                                            "resend it (the same ref is counted once)", ref))  # fmt: skip
            return
        except Exception as e:
            log.exception("recording a %s failed", kind)
            conn.send(p.Error("store_failed", f"{kind} not recorded: {e}", ref))
            return
        finally:
            conn.recorded()
        self.server.metrics.events.labels(kind).inc()
        if kind == "tool_result" and self.server.learner is not None:
            self.server.learner.called()
        conn.send(ack)

    def _store_call(self, conn: Connection, msg: p.ToolResult, key: str | None, digest: str) -> p.Ack:
        """On a store thread: the call, committed; for a failed one, the stand-ins."""
        scope = conn.session.scope
        server, tool = key_of(scope.catalog, msg.tool)
        row = self.server.history.record_call(server, tool, msg.ok, msg.latency_ms, msg.error, agent=conn.session.hello.agent,
                                              call_id=key, reporter=conn.id, digest=digest)  # fmt: skip
        if msg.ok:
            return p.Ack(msg.ref, row)
        return p.Ack(msg.ref, row, scope.engine.recommender.fallbacks(msg.tool, scope.context) or None)

    def _store_feedback(self, fb: Feedback, ref: p.Ref | None, key: str | None, digest: str) -> p.Ack:
        return p.Ack(ref, self.server.history.record_feedback(fb, key, digest))


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
