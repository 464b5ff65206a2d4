"""The explorer's engine (``static/engine.js``) in a real browser (Debian's chromium via
Playwright) on a real server: every answer the page shows comes through the engine chosen at
start-up, none of the page's requests leaves its origin, and an engine put in through the
``window.QKV_ENGINE`` hook drives every view without the server's API."""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from serve_helpers import page_ready, playwright_or_skip, post_json

playwright_or_skip()  # skips the module without chromium or Playwright (fails on CI)
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[3]
STATIC = ROOT / "src/qkv/apps/serve/static"
INDEX = (STATIC / "index.html").read_text(encoding="utf-8")
TEXT, TEXT2 = "the boy trains the puppy", "a dog runs"

# the engine qkv serve's page chooses (HttpEngine), wrapped so that the page records each call
# and its answer (window.__calls) as it hands them on
RECORD = """
window.__calls = [];
window.QKV_ENGINE = (E) => {
  const http = new E.HttpEngine(), rec = { get live() { return http.live; } };
  for (const m of E.METHODS) rec[m] = (request) => http[m](request).then(
    (answer) => { window.__calls.push({ method: m, request: request ?? null, answer }); return answer; },
    (err) => { window.__calls.push({ method: m, request: request ?? null, status: err.status }); throw err; });
  return rec;
};
"""


def _open(browser, url: str, init: str):
    """``url`` with ``init`` run before the page's own scripts; ``(page, errors, requests)``,
    requests as ``(method, url, JSON body or None, content type)``."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors, requests = [], []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(
        (r.method, r.url, r.post_data_json if r.method == "POST" else None,
         r.headers.get("content-type"))))  # fmt: skip
    page.add_init_script(init)
    page.goto(url)
    page_ready(page)
    return page, errors, requests


def test_every_answer_comes_through_the_engine(server, browser):
    """A page with a translation, a sentence B to compare and the Lens: each request to the
    API is one call of the engine, with the same body, and the views draw the engine's
    answers."""
    url = (f"{server}/?model=tiny-fr&translate=1&text=the+boy+trains+the+puppy&view=lens"
           "&compare=text&text2=a+dog+runs")  # fmt: skip
    page, errors, requests = _open(browser, url, RECORD)
    page.wait_for_selector("#view-lens[data-state='ready']")
    calls = page.evaluate("window.__calls")
    assert sorted(c["method"] for c in calls) == ["attention", "attention", "health", "lens",
                                                  "strings"]  # fmt: skip
    assert all("answer" in c for c in calls)  # no call failed

    # nothing leaves the origin; the page's own files, and the API only as the engine's calls
    assert [u for _, u, _, _ in requests if not u.startswith(server + "/")] == []
    paths = [urlsplit(u).path for _, u, _, _ in requests]
    scripts = re.findall(r'<script src="(/static/[\w.-]+\.js)"', INDEX)
    styles = re.findall(r'href="(/static/[\w.-]+\.css)"', INDEX)
    assert sorted(p for p in paths if not p.startswith("/api/")) == sorted(
        ["/", *scripts, *styles, "/static/i18n/strings.json"])  # fmt: skip
    api = sorted((m, urlsplit(u).path, json.dumps(b, sort_keys=True), ct)
                 for m, u, b, ct in requests if urlsplit(u).path.startswith("/api/"))  # fmt: skip
    route = {"health": ("GET", "/api/health"), "attention": ("POST", "/api/attention"),
             "lens": ("POST", "/api/lens")}  # fmt: skip
    asked = sorted((*route[c["method"]], json.dumps(c["request"], sort_keys=True),
                    "application/json" if c["request"] is not None else None)
                   for c in calls if c["method"] != "strings")  # fmt: skip
    assert api == asked

    # the views draw the engine's answers: the Lens table, A's and B's translations
    lens = next(c["answer"] for c in calls if c["method"] == "lens")
    cells = page.eval_on_selector_all(
        "table.lens-table tr[data-layer]",
        "rs => rs.map(r => [...r.querySelectorAll('td')].map(td => td.textContent))",
    )
    assert cells == [[cell[0] for cell in row] for row in lens["lens"]["tokens"]]
    texts = {c["request"]["text"]: c["answer"] for c in calls if c["method"] == "attention"}
    assert set(texts) == {TEXT, TEXT2}
    page.click(".tab[data-view='trans']")
    shown = page.text_content("#view-trans")
    assert texts[TEXT]["translation"]["text"] in shown
    assert texts[TEXT2]["translation"]["text"] in shown
    health = next(c["answer"] for c in calls if c["method"] == "health")
    options = page.eval_on_selector_all("#model option", "os => os.map(o => o.value)")
    assert options == [m["name"] for m in health["models"]]
    assert errors == []
    page.close()


def test_an_engine_put_in_by_the_hook_drives_the_page(server, browser):
    """An engine that answers from memory (a test's stand-in for one that runs the models in
    the page): the page opens on its answer and shows its errors, and asks the server for its
    files only, never its API."""
    health = json.loads(_get(server, "/api/health"))
    answer = post_json(server, text=TEXT, model="random")
    tokens = ["ENGINE-" + t for t in answer["tokens"]]  # tokens no server would answer with
    answer["tokens"] = tokens
    for layer in answer["layers"]:
        layer["q_tokens"] = layer["k_tokens"] = tokens
    strings = json.loads((STATIC / "i18n/strings.json").read_text(encoding="utf-8"))
    init = f"""
    window.QKV_ENGINE = (E) => {{
      const answer = {json.dumps(answer)}, fail = (status) => Promise.reject(new E.EngineError("no such answer here", status));
      return {{
        live: true,
        strings: () => Promise.resolve({json.dumps(strings)}),
        health: () => Promise.resolve({json.dumps(health)}),
        attention: (request) => request.text === answer.text && request.model === answer.model ? Promise.resolve(answer) : fail(422),
        lens: () => fail(400),
        saved: () => Promise.resolve(null),
      }};
    }};
    """
    url = f"{server}/?model=random&text=the+boy+trains+the+puppy&view=head"
    page, errors, requests = _open(browser, url, init)
    labels = page.eval_on_selector_all(".toks.left div", "ds => ds.map(d => d.textContent)")
    assert labels == tokens
    assert page.text_content("#status").startswith(f"{len(tokens)} tokens")
    # an engine's error shows as the server's do: its message in place of the maps
    page.fill("#text", "another sentence")
    page.press("#text", "Enter")
    page_ready(page)
    assert "no such answer here" in page.text_content("#notice")
    assert page.query_selector(".toks.left div") is None
    assert [u for _, u, _, _ in requests if urlsplit(u).path.startswith("/api/")] == []
    assert [u for _, u, _, _ in requests if not u.startswith(server + "/")] == []
    assert errors == []
    page.close()


def test_only_the_engine_asks_the_network():
    """No front-end file but engine.js sends a request; index.html loads engine.js before
    the files that use it."""
    net = re.compile(r"\bfetch\s*\(|XMLHttpRequest|EventSource|WebSocket|sendBeacon|\bimport\s*\(")
    users = sorted(p.name for p in STATIC.glob("*.js") if net.search(p.read_text(encoding="utf-8")))
    assert users == ["engine.js"]
    scripts = re.findall(r'<script src="/static/([\w.-]+\.js)"', INDEX)
    assert scripts.index("engine.js") < min(scripts.index("lens.js"), scripts.index("app.js"))


def _get(server: str, path: str) -> bytes:
    import urllib.request

    with urllib.request.urlopen(server + path, timeout=60) as r:
        return r.read()
