"""The page `GET /` serves to watch the sidecar work: one self-contained HTML file shipped as
package data (no build step, nothing fetched from elsewhere, so it works offline).

It is read once, with a Content-Security-Policy that admits exactly its own inline script
and style (by hash) and connections back to the server it came from: whatever text or tool
description the page shows cannot run as script there.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from importlib import resources

import msgspec

_INLINE = re.compile(r"<(script|style)>(.*?)</\1>", re.DOTALL)


class Page(msgspec.Struct, frozen=True):
    html: str
    headers: tuple[tuple[str, str], ...]  # sent with it, besides Content-Type


@functools.cache
def page() -> Page:
    html = resources.files(__package__).joinpath("index.html").read_text("utf-8")
    hashes: dict[str, list[str]] = {"script": [], "style": []}
    for tag, body in _INLINE.findall(html):
        digest = base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()
        hashes[tag].append(f"'sha256-{digest}'")
    csp = "; ".join([
        "default-src 'none'",
        "script-src " + " ".join(hashes["script"]),
        "style-src " + " ".join(hashes["style"]),
        "connect-src 'self'",  # the websocket and /metrics, on this origin only
        "img-src data:",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ])  # fmt: skip
    headers = (
        ("Content-Security-Policy", csp),
        ("Referrer-Policy", "no-referrer"),  # its URL may carry ?token=
        ("Cache-Control", "no-store"),
        ("X-Content-Type-Options", "nosniff"),
    )
    return Page(html, headers)
