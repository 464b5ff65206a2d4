"""Shared fixtures of the ``qkv serve`` tests: a tiny saved translator, a registry, and a
real server on 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import deadline
from qkv.apps.serve.models import Registry, default_registry
from qkv.data import Tokenizer
from qkv.models import Seq2SeqTransformer, TransformerConfig, save_pretrained

SENTS = ["a dog runs", "the boy trains the puppy", "le chien court", "le garçon entraîne le chiot"]


def tiny_translator(directory: Path) -> Path:
    """A small seq2seq model, fitted for a few steps on two pairs, saved with its tokenizer."""
    tok = Tokenizer.train(SENTS * 10, vocab_size=340)
    torch.manual_seed(0)
    cfg = TransformerConfig(src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size,
                            d_model=32, n_heads=4, d_ff=64, dropout=0.0, n_encoder_layers=2,
                            n_decoder_layers=2)  # fmt: skip
    model = Seq2SeqTransformer(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    pairs = [(SENTS[0], SENTS[2]), (SENTS[1], SENTS[3])]
    with one_thread():
        for _ in range(15):
            for s, t in pairs:
                src = torch.tensor([tok.encode(s) + [2]])  # (1, S)
                tgt = torch.tensor([[1, *tok.encode(t), 2]])  # (1, T)
                logits = model(src, tgt[:, :-1])  # (1, T - 1, V)
                loss = torch.nn.functional.cross_entropy(logits[0], tgt[0, 1:])
                opt.zero_grad()
                loss.backward()
                opt.step()
    return save_pretrained(model.eval(), directory, tokenizer=tok)


@contextmanager
def one_thread():
    """torch on one thread while serving (small models: threads only contend)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


_SAVED: dict[str, Path] = {}


def registry(tmp: Path, *, minilm: bool = True) -> Registry:
    """MiniLM (optional), random, and the tiny translator as ``tiny-fr`` (trained once per run)."""
    if "tiny-fr" not in _SAVED:
        _SAVED["tiny-fr"] = tiny_translator(tmp / "tiny-fr")
    reg = default_registry({"tiny-fr": str(_SAVED["tiny-fr"])})
    if not minilm:
        reg._entries.pop("minilm")
    return reg


@contextmanager
def running_server(app) -> Iterator[int]:
    """``app`` served as ``qkv serve`` serves it (uvicorn, :class:`TimedH11Protocol`) on
    127.0.0.1 in a thread; yields the port. The socket is bound here: no free-port race."""
    import uvicorn

    from qkv.apps.serve.server import TimedH11Protocol

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            http=TimedH11Protocol)  # fmt: skip
    srv = uvicorn.Server(config)
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    try:
        deadline.wait_until(
            lambda: srv.started or not th.is_alive(), 20, "uvicorn to start", poll=0.02
        )
        assert srv.started, "uvicorn stopped before it started (see its log above)"
        yield port
    finally:
        srv.should_exit = True
        th.join(timeout=10)
        sock.close()


@contextmanager
def serving(tmp_path_factory, name: str, *, minilm: bool) -> Iterator[str]:
    """The test registry (:func:`registry`) served on 127.0.0.1, torch on one thread: its
    URL (the browser tests' module fixtures)."""
    from qkv.apps.serve.app import create_app

    reg = registry(tmp_path_factory.mktemp(name), minilm=minilm)
    with one_thread(), running_server(create_app(reg)) as port:
        yield f"http://127.0.0.1:{port}"


def page_ready(page, timeout_ms: float = 30_000) -> None:
    """Wait until the explorer page has finished its current request (``data-ready``).

    No fixed pause first: every control that asks the server calls ``refresh()`` in its
    event handler, which sets ``data-ready='0'`` before it awaits anything, and Playwright's
    actions return after the handlers ran; so a request started by the last action is seen.
    ``timeout_ms``: longer for the 2,048-token answers, which take tens of seconds on 2 cores
    busy with the rest of the suite."""
    page.wait_for_selector("body[data-ready='1']", timeout=timeout_ms)


def post_json(server: str, path: str = "/api/attention", /, **body) -> dict:
    """POST ``body`` to ``server``'s ``path`` (``http://host:port``); the JSON answer."""
    host, port = server.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    out = json.loads(conn.getresponse().read())
    conn.close()
    return out


# --- a real browser: Debian's chromium through Playwright -----------------------------------

CHROMIUM = "/usr/bin/chromium"


def playwright_or_skip():
    """Playwright's sync API, or skip the test (or the module, called at its top) when
    chromium or Playwright is missing; on CI, where scripts/setup-system.sh installs chromium,
    its absence is an error."""
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI") == "true":
            raise RuntimeError(f"{CHROMIUM} missing in CI: run scripts/setup-system.sh")
        pytest.skip(f"{CHROMIUM} not installed (scripts/setup-system.sh installs it)",
                    allow_module_level=True)  # fmt: skip
    return pytest.importorskip("playwright.sync_api")


@contextmanager
def chromium() -> Iterator:
    """A headless chromium (no network of its own: no sync, no component updates)."""
    sync_api = playwright_or_skip()
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"],
        )  # fmt: skip
        try:
            yield b
        finally:
            b.close()


def open_page(browser, url: str, *, height: int = 800, downloads: bool = False):
    """``(page, errors, dialogs, outside)``: ``url`` opened at 1280 × ``height`` and ready
    (``data-ready``), with the console errors, dialogs and requests to other origins it
    makes collected as they come."""
    page = browser.new_page(viewport={"width": 1280, "height": height}, accept_downloads=downloads)
    errors, dialogs, outside = [], [], []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    origin = url.split("/?")[0]
    page.on("request", lambda r: outside.append(r.url) if not r.url.startswith(origin) else None)
    page.goto(url)
    page.wait_for_selector("body[data-ready='1']")
    return page, errors, dialogs, outside


def expect_download(page, button):
    """The download that clicking ``button`` (a locator on ``page``) starts. Under heavy load
    (the suite's other worker busy on the same 2 cores) headless Chromium has let a download's
    event go missing after the page saved the file; the button is then clicked once more. A
    page that never starts a download still fails: both waits time out."""
    sync_api = playwright_or_skip()
    try:
        with page.expect_download(timeout=20_000) as info:
            button.click()
    except sync_api.TimeoutError:
        with page.expect_download(timeout=20_000) as info:
            button.click()
    return info.value


# the page's visible words: text, selected options, titles and labels, but not data (tokens,
# sentences: marked translate='no') nor the tooltip
_UI_TEXT = """() => {
  const out = [], data = (e) => !e || e.closest("[translate='no'], script, style, #tip");
  const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let n = walk.nextNode(); n; n = walk.nextNode()) {
    const p = n.parentElement;
    if (!data(p) && !p.closest("select") && p.checkVisibility() && n.textContent.trim()) out.push(n.textContent);
  }
  for (const s of document.querySelectorAll("select")) {
    if (!data(s) && s.checkVisibility() && s.selectedOptions.length) out.push(s.selectedOptions[0].textContent);
  }
  for (const e of document.querySelectorAll("[title], [aria-label]")) {
    if (!data(e) && e.checkVisibility()) out.push(e.title || "", e.getAttribute("aria-label") || "");
  }
  return out.join("\\n");
}"""


def english_left(strings: dict, lang: str, text: str) -> list[tuple[str, str]]:
    """English words of the strings table still on a page shown in ``lang``: each piece of an
    English text between its placeholders, unless ``lang``'s own table uses it too (a term it
    keeps, such as "token" or "Q·Kᵀ"). Pieces without a word of 3+ letters are skipped."""
    own = "\n".join(strings[lang].values())
    left = []
    for key, english in strings["en"].items():
        if strings[lang][key] == english:
            continue
        for piece in re.split(r"\{\w+\}", english):
            piece = piece.strip(" .,:;()“”—←→▶❚·=%#…")
            if not re.search(r"[A-Za-z]{3}", piece) or piece in own:
                continue
            if re.search(rf"(?<![\w-]){re.escape(piece)}(?![\w-])", text):
                left.append((key, piece))
    return left


def page_text(page) -> str:
    """What a reader sees of ``page``'s interface, one piece per line (see _UI_TEXT)."""
    return page.evaluate(_UI_TEXT)
