"""The static site's test tools: a site served by ``python -m http.server`` on 127.0.0.1, and a
page that aborts (and records) every request leaving the site's origin."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import deadline

SENTENCE = "The boy trains the puppy."


@contextmanager
def http_server(directory: Path) -> Iterator[str]:
    """``python -m http.server`` serving ``directory`` on 127.0.0.1, on a port the system
    picks (read from its first line: no race for a free port); yields its URL."""
    proc = subprocess.Popen(
        [sys.executable, "-u", "-m", "http.server", "0", "-b", "127.0.0.1", "-d", str(directory)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        line = [""]

        def started() -> bool:
            line[0] = proc.stdout.readline()
            return "port" in line[0] or proc.poll() is not None

        deadline.wait_until(started, 20, "python -m http.server to start", poll=0.01)
        assert proc.poll() is None, "python -m http.server stopped at start"
        port = int(line[0].split(" port ")[1].split()[0])
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@dataclass
class Opened:
    """A page of the site and what it did: console errors, requests outside the origin
    (aborted), requests to ``/api/``, and every path it fetched."""

    page: object
    context: object
    errors: list = field(default_factory=list)
    outside: list = field(default_factory=list)
    api: list = field(default_factory=list)
    paths: list = field(default_factory=list)

    def close(self) -> None:
        self.context.close()

    def clean(self) -> None:
        """No console error, no request outside the origin, none to ``/api/``."""
        assert self.outside == [], f"requests outside the site's origin: {self.outside}"
        assert self.api == [], f"requests to an API the site does not have: {self.api}"
        assert self.errors == [], f"console errors: {self.errors}"


def open_site(browser, url: str, query: str = "", *, width: int = 1280, height: int = 800,
              init: str | None = None, wait: bool = True) -> Opened:  # fmt: skip
    """``url`` + ``query`` opened in a fresh context; requests to any other origin are
    aborted and recorded (``data:`` URLs are no requests)."""
    context = browser.new_context(viewport={"width": width, "height": height})
    page = context.new_page()
    got = Opened(page, context)
    origin = url.rstrip("/")

    def route(r) -> None:
        u = r.request.url
        if u.startswith("data:"):
            return r.continue_()
        if not u.startswith(origin + "/"):
            got.outside.append(u)
            return r.abort()
        path = urlsplit(u).path
        got.paths.append(path)
        if path.startswith("/api/"):
            got.api.append(u)
        return r.continue_()

    context.route("**/*", route)
    page.on("console", lambda m: got.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: got.errors.append(str(e)))
    if init:
        page.add_init_script(init)
    page.goto(f"{origin}/{query}")
    if wait:
        page.wait_for_selector("body[data-ready='1']", timeout=30_000)
    return got


def strings(site: Path) -> dict:
    return json.loads((site / "static" / "i18n" / "strings.json").read_text(encoding="utf-8"))
