"""The HTTP side of the server's port, before any websocket: /healthz, /metrics, the page at
`/` and its examples (/examples), and who may open a websocket at all (token, Origin
allowlist, load, capacity).

`Web` is websockets' `process_request` hook: it answers a plain HTTP request itself, or
returns None to let a handshake through to the server's websocket handler.

Secure by default (issue 33): a browser page of another origin is refused unless
`server.origins` lists it (a client that sends no `Origin` is no browser page, and the page the
sidecar serves is its own origin); on a loopback bind, a `Host` that names no loopback address
is refused, so a web page cannot reach a local sidecar through DNS rebinding either; methods other
than GET and HEAD get 405.
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlsplit

import msgspec
from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from .completion import health
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
        if request.method not in ("GET", "HEAD"):
            resp = conn.respond(405, f"method {request.method} is not allowed: GET or HEAD\n")
            resp.headers["Allow"] = "GET, HEAD"
            return resp
        for name in ("Host", "Origin", "Authorization", "Upgrade"):  # read below: one each, or the request is ambiguous
            if len(request.headers.get_all(name)) > 1:
                return conn.respond(400, f"more than one {name} header\n")
        host = request.headers.get("Host")
        if host is not None and _loopback(limits.host) and not _loopback(_hostname(host)):
            return conn.respond(421, f"host {host} is not this sidecar: a loopback sidecar answers only to a loopback name\n")
        if path == "/healthz":
            if s.ready:
                return conn.respond(200, health(s.engine))
            return conn.respond(503, "shutting down\n" if s.closing else "loading\n")
        if path == "/metrics":
            if not self.authorized(request.headers, query):
                return unauthorized(conn)
            return _typed(conn.respond(200, s.metrics.render().decode()), CONTENT_TYPE)
        origin = request.headers.get("Origin")
        if origin is not None and origin not in limits.origins and (host is None or origin != f"http://{host}"):
            return conn.respond(403, f"origin {origin} is not allowed (list it in server.origins)\n")
        if not self.authorized(request.headers, query):
            return unauthorized(conn)
        if path == "/" and request.headers.get("Upgrade", "").lower() != "websocket":
            return page_response(conn)  # a browser, not a handshake: served while loading too
        if path == "/examples":
            if s.engine is None:
                return conn.respond(503, "loading the model; retry shortly\n")
            # the catalog as its authors shipped it: all of it, written cases or not (they come later)
            return _typed(conn.respond(200, msgspec.json.encode(examples(s.engine.pipeline.whole)).decode()), "application/json")
        if s.closing:
            return conn.respond(503, "shutting down\n")
        if s.engine is None:
            resp = conn.respond(503, "loading the model; retry shortly\n")
            resp.headers["Retry-After"] = "1"
            return resp
        if (refused := s.refusal(peer(conn))) is not None:
            status, why = refused
            resp = conn.respond(status, why + "\n")
            resp.headers["Retry-After"] = "1"
            return resp
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


def peer(conn: ServerConnection) -> str:
    """The peer's address, without its port ("" when the transport has none)."""
    remote = conn.remote_address
    return str(remote[0]) if remote else ""


def _hostname(host: str) -> str:
    """The name in a Host header: "127.0.0.1:8765" -> "127.0.0.1", "[::1]:8765" -> "::1"."""
    try:
        return urlsplit(f"//{host}").hostname or ""
    except ValueError:
        return ""


def _loopback(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def page_response(conn: ServerConnection) -> Response:
    """The page to watch the sidecar work (sidecar/serve/page/): checked like any client."""
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
