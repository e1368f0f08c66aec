"""The page `GET /` serves (sidecar/serve/page/), in a real headless Chromium: Debian's
/usr/bin/chromium driven by Playwright for Python through `executable_path` (Playwright's own
browser builds are never downloaded). Each test starts a real `sidecar serve` with a token
and an Origin allowlist, as a deployment reached from a browser would have.

`SIDECAR_PAGE_SCREENSHOT=docs/page.png` saves the page as the first test leaves it (the
README's picture).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import socket
import sqlite3

import pytest
from playwright.async_api import Page, async_playwright
from playwright.async_api import TimeoutError as PlaywrightTimeout

from sidecar.core import catalog as catalog_mod
from sidecar.serve import examples as examples_mod

from .conftest import CATALOGS, ROOT, serve_process
from .test_server import NOTES, SMALL, WAIT_S, http_get, parse_metrics, run

CHROMIUM = pathlib.Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
SECRET = "page-test-token"
TURN = "Show me the note about onboarding"
REPLY = "Sure. I should call semantic_search to find the kubernetes setup. Maybe I should also list all your notes. Ok."
WAIT_MS = WAIT_S * 1000


@pytest.fixture
def chromium() -> str:
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)):
        pytest.fail(f"{CHROMIUM} is missing: the page is tested in Debian's chromium (apt-get install chromium)", pytrace=False)
    return str(CHROMIUM)


def free_port() -> int:
    """A port for the server, known before it starts: the allowlist names the page's origin."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def sidecar(tmp_path: pathlib.Path, catalog: pathlib.Path = NOTES):
    """A real `sidecar serve` (small model, the notes catalog unless told) that needs SECRET
    and allows only its own origin; yields its port."""
    port = free_port()
    cfg = tmp_path / "sidecar.toml"
    # auto pinned between the reply's two fired clauses (about 0.985 and 0.937 today), so it
    # yields one card of each tier even if a refit moves the calibration's own threshold
    cfg.write_text(f'[server]\ntoken = "{SECRET}"\norigins = ["http://127.0.0.1:{port}"]\n\n[gate]\nauto = 0.96\n')
    args = ["--config", str(cfg), "--port", str(port), "--model", SMALL, "--catalog", str(catalog), "--store", str(tmp_path / "serve.db")]
    with serve_process(args, tmp_path) as served:
        assert served.url == f"ws://127.0.0.1:{port}", served.log_text()
        yield port


@contextlib.asynccontextmanager
async def browser(executable: str):
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            await b.close()


async def send(page: Page, mode: str, text: str) -> None:
    await page.get_by_text(mode, exact=True).click()
    await page.fill("#input", text)
    await page.click("#send")


async def tile(page: Page, key: str) -> str:
    return await page.text_content(f'[data-key="{key}"] .v')


def test_a_reply_streamed_from_the_page_gets_inject_cards_and_a_confirm_is_stored(tmp_path, chromium):
    async def body():
        async with sidecar(tmp_path) as port, browser(chromium) as b:
            page = await b.new_page(viewport={"width": 1280, "height": 1000})
            problems: list[str] = []  # script errors and console errors (a CSP refusal is one)
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            resp = await page.goto(f"http://127.0.0.1:{port}/?token={SECRET}")
            assert resp.status == 200
            assert "script-src 'sha256-" in resp.headers["content-security-policy"]
            try:
                await page.wait_for_selector('#status[data-state="ready"]', timeout=WAIT_MS)
            except PlaywrightTimeout:
                raise AssertionError(f"the page never got `ready`: {await page.text_content('#status')}; {problems}") from None
            assert "all-minilm-l6-v2" in await page.text_content("#status")

            await send(page, "User turn", TURN)
            await page.wait_for_selector('.card[data-tools~="read_note"]', timeout=WAIT_MS)
            # where the trigger was, and when the inject came: a user turn arrives whole
            assert await page.text_content('.card[data-tools~="read_note"] .sent') == f"sent at {len(TURN)} (end of stream)"
            assert (await page.text_content('.card[data-tools~="read_note"] .relevance')).startswith("relevance ")
            assert (await page.text_content('.card[data-tools~="read_note"] .prob')).startswith("probability ")

            await send(page, "Assistant reply", REPLY)
            await page.fill("#rate", "40")  # the rest of the reply at 40 tokens/s
            card = page.locator('.card[data-tier="auto"][data-tools~="semantic_search"]')
            await card.wait_for(timeout=WAIT_MS)
            assert "call semantic_search" in await card.locator(".trigger q").text_content()
            sent = int(re.fullmatch(r"sent at (\d+)(?: \(end of stream\))?", await card.locator(".sent").text_content()).group(1))
            assert REPLY.index("setup. ") + len("setup. ") <= sent <= len(REPLY)  # once the clause's boundary was confirmed
            # the judged spans are painted in the streamed text, the trigger within them
            reply = page.locator(".turn", has_text="reply-")
            await reply.locator(".state", has_text="judged").wait_for(timeout=WAIT_MS)
            assert "call semantic_search" in await reply.locator(".j.auto.trig").first.text_content()
            assert await reply.locator(".j.confirm").count() >= 1
            assert await reply.locator(".j.silent").count() >= 1  # "Sure." judged, silent

            ask = page.locator('.card[data-tier="confirm"]')
            await ask.wait_for(timeout=WAIT_MS)
            tool = (await ask.locator(".tool .name").first.text_content()).strip()
            query = await ask.locator(".trigger q").text_content()
            await ask.locator("button.confirm-yes").click()
            done = ask.locator(".done.ok")
            await done.wait_for(timeout=WAIT_MS)
            assert f"confirmed {tool}, recorded as feedback #" in await done.text_content()

            # the live panel shows what /metrics says (polled every 2 s)
            await page.wait_for_function("() => document.querySelector('[data-key=\"feedback recorded\"] .v')?.textContent === '1'",
                                         timeout=WAIT_MS)  # fmt: skip
            served = parse_metrics((await http_get(port, "/metrics", {"Authorization": f"Bearer {SECRET}"}))[2])
            for key, name in [("injections auto", 'sidecar_injections_total{tier="auto"}'),
                              ("injections confirm", 'sidecar_injections_total{tier="confirm"}')]:  # fmt: skip
                assert float(await tile(page, key)) == served[name] >= 1
            assert problems == []
            if shot := os.environ.get("SIDECAR_PAGE_SCREENSHOT"):
                await page.mouse.move(0, 0)
                await page.screenshot(path=ROOT / shot, full_page=True)
            return tool, query

    tool, query = run(body())
    db = sqlite3.connect(tmp_path / "serve.db")
    try:
        assert db.execute("SELECT selected, rating, query FROM feedback").fetchall() == [(tool, 5.0, query)]
    finally:
        db.close()


def test_the_page_is_refused_without_the_token_and_a_page_of_another_origin_cannot_connect(tmp_path, chromium):
    async def body():
        async with sidecar(tmp_path) as port, browser(chromium) as b:
            page = await b.new_page()
            for url in (f"http://127.0.0.1:{port}/", f"http://127.0.0.1:{port}/?token=wrong"):
                resp = await page.goto(url)
                assert resp.status == 401
                assert "a token is required" in await page.text_content("body")
            # the same server under another loopback name is still its own page: it connects
            resp = await page.goto(f"http://localhost:{port}/?token={SECRET}")
            assert resp.status == 200
            await page.wait_for_selector('#status[data-state="ready"]', timeout=WAIT_MS)
            # a page of another origin (the browser serves it itself) opens a websocket to the
            # sidecar, token and all: refused, as it would be with no allowlist at all (issue 33)
            script = (f"<script>const ws = new WebSocket('ws://127.0.0.1:{port}/?token={SECRET}');"
                      "ws.onopen = () => { document.title = 'open'; }; ws.onerror = () => { document.title = 'refused'; };</script>")
            await page.route("http://evil.test/", lambda route: route.fulfill(status=200, content_type="text/html", body=script))
            await page.goto("http://evil.test/")
            await page.wait_for_function("document.title !== ''", timeout=WAIT_MS)
            assert await page.title() == "refused"
            status, _, text = await http_get(port, f"/?token={SECRET}", {"Origin": "https://evil.example"})
            assert (status, text) == (403, "origin https://evil.example is not allowed (list it in server.origins)\n")

    run(body())


def test_the_examples_come_from_the_catalog_the_sidecar_loaded(tmp_path, chromium):
    """Not the notes catalog's texts written into the page: a sidecar serving git.json fills
    in requests for git's tools, and the reply it suggests, streamed, injects the tool it names."""
    catalog = catalog_mod.load([CATALOGS / "git.json"])
    notes = {t.name for t in catalog_mod.load([NOTES])}

    async def body():
        async with sidecar(tmp_path, CATALOGS / "git.json") as port, browser(chromium) as b:
            page = await b.new_page()
            await page.goto(f"http://127.0.0.1:{port}/?token={SECRET}")
            await page.wait_for_selector('#status[data-state="ready"]', timeout=WAIT_MS)
            await page.wait_for_selector("#example:enabled", timeout=WAIT_MS)
            users = []
            for _ in range(examples_mod.MAX_EXAMPLES + 1):  # each click the next one, then round again
                await page.click("#example")
                users.append(await page.input_value("#input"))
            await page.get_by_text("Assistant reply", exact=True).click()
            await page.click("#example")
            reply = await page.input_value("#input")
            await page.fill("#rate", "60")
            await page.click("#send")
            card = page.locator(".card").first
            await card.wait_for(timeout=WAIT_MS)
            injected = (await card.get_attribute("data-tools")).split()
            status, _, _ = await http_get(port, "/examples")  # the page's token checks apply to it
            return users, reply, injected, status

    users, reply, injected, status = run(body())
    want = examples_mod.examples(catalog)
    assert users == want.user + want.user[:1] and len(set(users)) == examples_mod.MAX_EXAMPLES
    # each a request for one of git's tools, phrased from its description
    derived = {examples_mod.use_case(t).lower(): t.name for t in catalog}
    assert [derived[u.lower()] for u in want.user] == want.tools and all(name.startswith("git_") for name in want.tools)
    assert reply == want.reply[0] and f"call {want.tools[0]} to " in reply
    assert injected[0] == want.tools[0] and not notes & set(injected)  # the example fires the tool it is about
    assert status == 401
