"""The HTTP side of the server's port, before any websocket: /healthz, /metrics, the page at
`/` and its examples (/examples), and who may open a websocket at all (token, Origin
allowlist, load, capacity).

`Web` is websockets' `process_request` hook: it answers a plain HTTP request itself, or
returns None to let a handshake through to the server's websocket handler.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

import msgspec
from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from .examples import examples
from .page import page
from .telemetry import CONTENT_TYPE

if TYPE_CHECKING:
    from .server import SidecarServer


class Web:
    def __init__(self, server: SidecarServer):
        self.server = server

    def __call__(self, conn: ServerConnection, request: Request) -> Response | None:
        s, limits = self.server, self.server.limits
        path, _, query = request.path.partition("?")
        if path == "/healthz":
            if s.ready:
                return conn.respond(200, "ok\n")
            return conn.respond(503, "shutting down\n" if s.closing else "loading\n")
        if path == "/metrics":
            if not self.authorized(request.headers, query):
                return unauthorized(conn)
            return _typed(conn.respond(200, s.metrics.render().decode()), CONTENT_TYPE)
        origin = request.headers.get("Origin")
        if limits.origins and origin is not None and origin not in limits.origins:
            return conn.respond(403, f"origin {origin} is not allowed\n")
        if not self.authorized(request.headers, query):
            return unauthorized(conn)
        if path == "/" and request.headers.get("Upgrade", "").lower() != "websocket":
            return page_response(conn)  # a browser, not a handshake: served while loading too
        if path == "/examples":
            if s.engine is None:
                return conn.respond(503, "loading the model; retry shortly\n")
            return _typed(conn.respond(200, msgspec.json.encode(examples(s.engine.catalog)).decode()), "application/json")
        if s.closing:
            return conn.respond(503, "shutting down\n")
        if s.engine is None:
            resp = conn.respond(503, "loading the model; retry shortly\n")
            resp.headers["Retry-After"] = "1"
            return resp
        if len(s.connections) >= limits.max_connections:
            return conn.respond(503, f"at most {limits.max_connections} connections\n")
        return None

    def authorized(self, headers: Headers, query: str) -> bool:
        """The configured token, as `Authorization: Bearer` or `?token=` (none configured: anyone)."""
        token = self.server.limits.token
        if not token:
            return True
        auth = headers.get("Authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else None
        if given is None:
            given = (parse_qs(query).get("token") or [None])[0]
        return given is not None and hmac.compare_digest(given.encode(), token.encode())


def page_response(conn: ServerConnection) -> Response:
    """The page to watch the sidecar work (sidecar/page/): checked like any client."""
    served = page()
    resp = _typed(conn.respond(200, served.html), "text/html; charset=utf-8")
    for name, value in served.headers:
        resp.headers[name] = value
    return resp


def unauthorized(conn: ServerConnection) -> Response:
    resp = conn.respond(401, "a token is required: Authorization: Bearer TOKEN or ?token=TOKEN\n")
    resp.headers["WWW-Authenticate"] = 'Bearer realm="sidecar"'
    return resp


def _typed(resp: Response, content_type: str) -> Response:
    del resp.headers["Content-Type"]
    resp.headers["Content-Type"] = content_type
    return resp
