"""The site with an in-page engine, and with a translator.

The engine here is a stand-in with the contract of ``qkv.apps.web.export`` (its module put in
``sys.modules`` for the build): ``export_site_models`` writes its files and says each model's
size, ``ENGINE_SCRIPTS`` its scripts, which define ``window.qkvLocal.createEngine``. Its
answer to a new sentence is the server's, computed here. The site must load its scripts before
site.js, say the model's size in the menu before anything downloads, answer the first view
without making the engine, hand it every other request, and say the download while it runs."""

from __future__ import annotations

import json
import re
import sys
import types

import pytest
from site_helpers import http_server, open_site, strings

from serve_helpers import playwright_or_skip

playwright_or_skip()  # skips the module without chromium or Playwright (fails on CI)

NEW = "A dog runs in the snow."
SIZE = 12_345_678  # the stand-in's model: "12 MB" in the menu
# the stand-in engine: it answers with the file its export wrote, once the test lets it
# (window.__release), and records what it was asked
ENGINE_JS = """"use strict";
window.__local = [];
window.qkvLocal = { createEngine({ base }) {
  window.__local.push({ made: base });
  let release; const gate = new Promise((ok) => { release = ok; }); window.__release = release;
  const E = window.qkvEngine;
  return {
    live: true,
    strings: () => Promise.reject(new E.EngineError("not the site's", 0)),
    health: () => Promise.reject(new E.EngineError("not the site's", 0)),
    saved: () => Promise.resolve(null),
    async attention(request) {
      window.__local.push({ method: "attention", request });
      await gate;
      return (await fetch(base + "random/answer.json")).json();
    },
    lens: () => Promise.reject(new E.EngineError("the stand-in has no lens", 0)),
  };
} };
"""


def _stand_in_export() -> types.ModuleType:
    from qkv.apps.serve.models import default_registry
    from qkv.apps.web import build

    def export_site_models(out, names, progress=print):
        body = {**build.first_requests("random", False)[0], "text": NEW}
        answer = build._answer(default_registry(), body)
        (out / "models" / "random").mkdir(parents=True)
        (out / "models" / "random" / "answer.json").write_text(json.dumps(answer))
        (out / "engine").mkdir()
        (out / "engine" / "stand-in.js").write_text(ENGINE_JS)
        progress("stand-in engine written")
        return [{"name": n, "bytes": SIZE} for n in names]

    mod = types.ModuleType("qkv.apps.web.export")
    mod.export_site_models = export_site_models
    mod.ENGINE_SCRIPTS = ["engine/stand-in.js"]
    return mod


@pytest.fixture(scope="module")
def engine_site(tmp_path_factory):
    from qkv.apps.web.build import build_site

    out = tmp_path_factory.mktemp("engine-site") / "live"
    saved = sys.modules.get("qkv.apps.web.export")
    sys.modules["qkv.apps.web.export"] = _stand_in_export()
    try:
        summary = build_site(out, ["random"], progress=lambda line: None)
    finally:
        if saved is None:
            del sys.modules["qkv.apps.web.export"]
        else:
            sys.modules["qkv.apps.web.export"] = saved
    assert summary["engine"] and summary["models"][0]["bytes"] == SIZE
    with http_server(out) as url:
        yield out, url


def test_the_page_loads_the_engine_before_the_site_and_app(engine_site):
    site, _ = engine_site
    page = (site / "index.html").read_text(encoding="utf-8")
    scripts = re.findall(r'<script src="([^"]+)" defer>', page)
    assert scripts[-3:] == ["engine/stand-in.js", "static/site.js", "static/app.js"]
    assert scripts[0] == "static/engine.js"


def test_the_engine_answers_new_sentences_and_its_download_is_said(engine_site, browser):
    site, url = engine_site
    o = open_site(browser, url)
    try:
        page = o.page
        label = page.text_content("#model option")
        assert "12 MB" in label and strings(site)["en"]["model.random"] in label
        assert page.evaluate("window.__local") == []  # the first view: saved, no engine made
        assert "/models/random/answer.json" not in o.paths
        page.fill("#text", NEW)
        page.press("#text", "Enter")
        page.wait_for_function(
            "() => document.querySelector('#status').textContent.includes('12 MB')")
        assert "downloading random" in page.text_content("#status")
        page.evaluate("window.__release()")
        page.wait_for_selector("body[data-ready='1']")
        calls = page.evaluate("window.__local")
        assert calls[0] == {"made": "models/"}
        assert [c["request"]["text"] for c in calls[1:]] == [NEW]
        assert page.text_content("#status").endswith("ms") and "12 MB" not in page.text_content(
            "#status")
        page.click(".tab[data-view='head']")
        assert "snow" in page.locator("#view-head .toks").first.text_content()
        # the saved sentence again: from the saved answer, not the engine
        page.fill("#text", "The boy trains the puppy.")
        page.press("#text", "Enter")
        page.wait_for_selector("body[data-ready='1']")
        assert len(page.evaluate("window.__local")) == 2
        assert "puppy" in page.locator("#view-head .toks").first.text_content()
        o.clean()
    finally:
        o.close()


@pytest.mark.slow
def test_a_translator_s_first_view_and_the_menu(tmp_path, browser):
    """en-fr's saved answers: the menu switches to it (ticking "translate") and the page shows
    the notes' translation with no model in the page; the Lens, which needs one, says so."""
    from qkv.apps.web.build import build_site

    site = tmp_path / "live"
    build_site(site, ["random", "en-fr"], progress=lambda line: None, engine=False)
    said = strings(site)["en"]["site.savedOnly"].format(name="en-fr")
    with http_server(site) as url:
        o = open_site(browser, url, "?view=trans")
        try:
            page = o.page
            assert page.eval_on_selector_all("#model option", "os => os.map(o => o.value)") == [
                "en-fr", "random"]  # fmt: skip
            page.select_option("#model", "random")
            page.wait_for_selector("body[data-ready='1']")
            assert not page.is_checked("#translate")  # random weights: not ticked
            page.select_option("#model", "en-fr")
            page.wait_for_selector("body[data-ready='1']")
            assert page.is_checked("#translate")
            assert "Le garçon entraîne le chiot." in page.text_content("#view-trans")
            assert said not in page.text_content("#notice")
            page.click(".tab[data-view='lens']")
            page.wait_for_selector("#view-lens[data-state='error']")
            assert said in page.text_content("#view-lens")
            o.clean()
        finally:
            o.close()


@pytest.fixture(scope="module")
def real_site(tmp_path_factory):
    """The random model with the real in-page engine (qkv.apps.web.export), when installed
    with its runtime (``npm ci --prefix web``)."""
    from qkv.apps.web.build import build_site

    export = pytest.importorskip("qkv.apps.web.export")
    pytest.importorskip("onnx")  # the [web] extra: the export traces the models with it
    try:
        export.ort_dist()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    out = tmp_path_factory.mktemp("real-site") / "live"
    summary = build_site(out, ["random"], progress=lambda line: None)
    assert summary["engine"]
    with http_server(out) as url:
        yield out, url


def test_the_real_engine_answers_in_the_page_and_offline(real_site, browser):
    """The site's policy lets the engine run (WebAssembly, its files): a new sentence gets the
    server's tokens and layers, with no request outside the origin and none to /api/; with
    the network off after that, another sentence still gets its answer."""
    from qkv.apps.serve.models import default_registry
    from qkv.apps.web import build

    site, url = real_site
    o = open_site(browser, url)
    try:
        page = o.page
        size = json.loads((site / "site.json").read_text())["models"][0]["bytes"]
        assert f"{size / 1e6:.1f} MB download" in page.text_content("#model option")
        page.fill("#text", NEW)
        page.press("#text", "Enter")
        page.wait_for_selector("body[data-ready='1']", timeout=60_000)
        want = build._answer(default_registry(), {**build.first_requests("random", False)[0],
                                                  "text": NEW})  # fmt: skip
        status = page.text_content("#status")
        assert status.startswith(f"{len(want['tokens'])} tokens"), status
        page.click(".tab[data-view='head']")
        assert "snow" in page.locator("#view-head .toks").first.text_content()
        assert any(p.startswith("/models/random/") for p in o.paths)
        o.context.set_offline(True)
        page.fill("#text", "Two dogs play.")
        page.press("#text", "Enter")
        page.wait_for_selector("body[data-ready='1']", timeout=60_000)
        assert "dogs" in page.locator("#view-head .toks").first.text_content()
        assert "qkv serve" not in page.text_content("#notice")
        o.clean()
    finally:
        o.close()


@pytest.mark.parametrize("width", [900, 1024, 1100])
def test_the_menu_with_sizes_does_not_overflow_a_laptop_window(engine_site, browser, width):
    """The sizes make the model menu's labels long ("… · 12 MB download"): between the narrow
    layout (≤ 700 px) and a wide window, the top bar still fits the window (site.css)."""
    _, url = engine_site
    o = open_site(browser, url, width=width)
    try:
        page = o.page
        assert "12 MB" in page.text_content("#model option")
        sizes = page.evaluate("""() => ({ page: document.documentElement.scrollWidth,
            bar: document.querySelector('#bar').scrollWidth,
            right: Math.max(...[...document.querySelectorAll('#bar > *')].map((e) => e.getBoundingClientRect().right)) })""")
        assert sizes["page"] <= width and sizes["bar"] <= width and sizes["right"] <= width, sizes
        o.clean()
    finally:
        o.close()
