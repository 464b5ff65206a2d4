"""``qkv serve`` in a real browser (Debian's chromium via Playwright) against a real uvicorn
server on 127.0.0.1, and a bounded load test of the same server."""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from pathlib import Path

import pytest

import deadline

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[3]  # the repository (this is tests/apps/serve/)
ARTIFACTS = ROOT / "tests" / "artifacts"
XSS = "<script>alert(1)</script> <img src=x onerror=alert(1)> \"'><svg onload=alert(1)>"

uvicorn = pytest.importorskip("uvicorn")
from qkv.apps.serve.app import create_app  # noqa: E402
from serve_helpers import english_left, one_thread, open_page, page_text, post_json  # noqa: E402
from serve_helpers import page_ready as _ready  # noqa: E402

_open = open_page


def _shot(page, name):
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"serve_{name}.png"))


def test_every_view_renders_and_languages_switch(server, browser):
    strings = json.loads(
        (ROOT / "src/qkv/apps/serve/static/i18n/strings.json").read_text()
    )
    page, errors, dialogs, outside = _open(browser, f"{server}/?model=random")
    assert page.input_value("#text") == "The boy trains the puppy."
    keys = page.eval_on_selector_all("#view-step .card", "cs => cs.map(c => c.dataset.key)")
    assert keys == ["x", "q", "k", "v", "scores", "scaled", "mask", "masked", "weights",
                    "output", "concat", "wo"]  # fmt: skip
    assert "Random weights" in page.text_content("#notice")
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280
    _shot(page, "step_en")
    for lang, probe in (("zh", "词元"), ("my", "token"), ("bn", "টোকেন"), ("vi", "token")):
        page.select_option("#lang", lang)
        text = page.text_content("#view-step .card[data-key='q'] p.expl")
        assert text == strings[lang]["step.q"] and probe in text
    assert any("\u1000" <= c <= "\u109f" for c in strings["my"]["step.weights"])  # Burmese
    page.select_option("#lang", "zh")
    _shot(page, "step_zh")
    page.select_option("#lang", "my")
    _shot(page, "step_my")
    page.select_option("#lang", "en")

    # type a sentence: the page re-computes
    page.fill("#text", "The animal didn't cross the street because it was tired.")
    page.press("#text", "Enter")
    _ready(page)
    assert page.text_content("#status").startswith("15 tokens")

    # head view: one head on by default; hover isolates; click pins
    page.click(".tab[data-view='head']")
    assert page.eval_on_selector_all(".chip", "cs => cs.length") == 4
    assert page.eval_on_selector_all(".chip.on", "cs => cs.length") == 1
    page.hover(".toks.left div[data-i='10']")
    page.click(".toks.left div[data-i='10']")
    assert "pinned" in page.get_attribute(".toks.left div[data-i='10']", "class")
    shown = page.eval_on_selector_all(".blocks span", "s => s.map(x => +x.dataset.v)")
    resp = post_json(server, text=page.input_value("#text"), model="random")
    want = resp["layers"][0]

    def want_stats(layer):
        return [s for s in resp["stats"] if s["layer"] == layer]

    assert shown == pytest.approx(want["weights"][0][10], abs=1e-6)  # query "it", head 0
    page.select_option("#top-heads", "first")  # the 3 heads that look most at the first token
    firsts = {s["head"]: s["first"] for s in want_stats(want["name"])}
    on = page.eval_on_selector_all(".chip.on", "cs => cs.map(c => +c.dataset.head)")
    assert sorted(on) == sorted(sorted(firsts, key=lambda h: -firsts[h])[:3])
    _shot(page, "head")

    # model view: every layer × head, a click opens that one in the step view
    page.click(".tab[data-view='model']")
    assert page.eval_on_selector_all("canvas.thumb", "cs => cs.length") == 2 * 4
    page.click("canvas.thumb[data-layer='1'][data-head='3']")
    _ready(page)
    assert page.input_value("#layer") == "encoder.layers.1.self_attn" and page.input_value("#head") == "3"
    assert "head 3 of 4" in page.text_content("#view-step .intro")
    assert page.eval_on_selector_all("#stats tr.sel", "r => r.map(x => x.dataset.head)") == ["3"]
    page.click(".tab[data-view='model']")
    _shot(page, "model")

    # heads at work: the pronoun probe answers
    page.click(".tab[data-view='work']")
    assert "decide" in page.text_content("#probe-verdict")
    assert page.eval_on_selector_all("table.probe tr", "r => r.length") > 1
    assert dialogs == [] and errors == [] and outside == []
    page.close()


def test_translation_steps_and_switching_heads_off(server, browser):
    page, errors, dialogs, outside = _open(browser, f"{server}/?model=tiny-fr&translate=1"
                                           "&text=the%20boy%20trains%20the%20puppy&view=trans")  # fmt: skip
    before = page.text_content("#view-trans .intro")
    assert before.startswith("Translation:")
    n = int(page.get_attribute("#step-slider", "max")) + 1
    assert n >= 2
    page.fill("#step-slider", "1")
    page.dispatch_event("#step-slider", "input")
    assert page.text_content("#step-label").startswith(f"step 2 / {n}")
    assert page.eval_on_selector_all(".tokens-line span.cur", "s => s.length") == 1
    page.click("#play")  # plays the decoding to its last step, then stops
    # (the page's CSP forbids wait_for_function's eval: poll, for a load-scaled time)
    deadline.wait_until(
        lambda: page.text_content("#step-label").startswith(f"step {n} / {n}"),
        30, "the step player to reach the last step",
        lambda: f"label: {page.text_content('#step-label')!r}",
    )  # fmt: skip
    page.wait_for_selector("#play:has-text('play')")
    _shot(page, "translation")

    page.click(".tab[data-view='work']")
    for h in range(4):
        page.uncheck(f"input.switch[data-layer='decoder.layers.0.self_attn'][data-head='{h}']")
    page.click("#ablate-run")
    _ready(page)
    changes = page.text_content("#changes")
    assert "4 head(s) off" in changes and "all heads on:" in changes
    baseline = changes.split("all heads on: ")[1].split("with heads off:")[0].strip()
    after = changes.split("with heads off: ")[1].split("\n")[0]
    assert baseline and after and not after.startswith(baseline)  # the translation changed
    _shot(page, "heads_off")
    page.click(".tab[data-view='model']")  # switched-off heads are dimmed
    assert page.eval_on_selector_all("canvas.thumb.off", "c => c.length") == 4
    assert dialogs == [] and errors == [] and outside == []
    page.close()


def test_beam_search_shows_its_hypotheses(server, browser):
    page, errors, dialogs, outside = _open(browser, f"{server}/?model=tiny-fr&translate=1"
                                           "&text=the%20boy%20trains%20the%20puppy&view=trans")  # fmt: skip
    assert page.query_selector("#beams") is None  # greedy: no beam table
    page.select_option("#beam", "4")
    _ready(page)
    page.wait_for_selector("#beams")
    rows = page.eval_on_selector_all("#beams tr.chosen", "rs => rs.length")
    assert rows == 1 and "chosen" in page.text_content("#beams tr.chosen")
    shown = page.text_content("#view-trans .intro").removeprefix("Translation:").strip()
    assert shown in page.text_content("#beams tr.chosen")  # the chosen one is the translation
    _shot(page, "beams")
    assert dialogs == [] and errors == [] and outside == []
    page.close()


def test_hostile_text_fires_nothing(server, browser):
    page, errors, dialogs, _ = _open(browser, f"{server}/?model=random")
    page.fill("#text", XSS)
    page.press("#text", "Enter")
    _ready(page)
    for view in ("head", "model", "work", "step"):
        page.click(f".tab[data-view='{view}']")
        _ready(page)
    page.click(".tab[data-view='head']")
    labels = page.eval_on_selector_all(".toks.left div", "ds => ds.map(d => d.textContent)")
    assert "<" in labels and "script" in labels and "onerror" in labels
    assert page.eval_on_selector_all("img, svg, iframe", "x => x.length") == 0
    own = (ROOT / "src/qkv/apps/serve/static/index.html").read_text().count("<script src=")
    assert page.eval_on_selector_all("script", "s => s.length") == own  # index.html's, no more
    page.wait_for_timeout(200)
    assert dialogs == [] and errors == []
    page.close()


@pytest.mark.slow
def test_load_32_clients_20_seconds(server):
    """32 concurrent clients for 20 s against 127.0.0.1: zero errors; prints p50/p95."""
    host, port = server.removeprefix("http://").split(":")
    body = json.dumps({"text": "The boy trains the puppy.", "model": "random"}).encode()
    stop = time.monotonic() + 20.0
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()

    def client() -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            try:
                conn.request("POST", "/api/attention", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                ok = resp.status == 200 and json.loads(data)["tokens"][0] == "[CLS]"
            except Exception as err:  # noqa: BLE001 - every failure counts
                ok, data = False, repr(err).encode()
                conn.close()
                conn = http.client.HTTPConnection(host, int(port), timeout=60)
            with lock:
                (latencies if ok else failures).append(
                    time.perf_counter() - t0 if ok else data[:200].decode(errors="replace")
                )
        conn.close()

    threads = [threading.Thread(target=client) for _ in range(32)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    wall = time.monotonic() - t0
    assert not any(t.is_alive() for t in threads)
    q = statistics.quantiles(latencies, n=20)
    print(f"\nload: 32 clients, {wall:.1f} s, {len(latencies)} requests "
          f"({len(latencies) / wall:.1f}/s), p50 {1000 * statistics.median(latencies):.0f} ms, "
          f"p95 {1000 * q[18]:.0f} ms, errors {len(failures)}")  # fmt: skip
    assert failures == [] and len(latencies) >= 32 and wall >= 20.0


def test_notebook_view_is_self_contained_and_safe(browser, tmp_path):
    from qkv.inspect import capture
    from qkv.inspect.tiny import TinyEncoder

    enc = TinyEncoder()
    toks, ids = enc.tokenize("The animal didn't cross the street because it was tired .")
    toks[3] = "</script><script>alert(1)</script>"  # a hostile token: text, never markup
    maps = capture(enc, ids, tokens=toks)
    path = tmp_path / "nb.html"
    path.write_text(f"<!DOCTYPE html><html><body>{maps._repr_html_()}</body></html>")
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    errors, dialogs, requests = [], [], []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.on("request", lambda r: requests.append(r.url))
    page.goto(path.as_uri())
    frame = page.frame_locator("iframe")
    frame.locator("body[data-ready='1']").wait_for()
    frame.locator(".tab[data-view='head']").click()
    labels = frame.locator(".toks.left div").all_text_contents()
    assert labels == toks
    frame.locator(".tab[data-view='model']").click()
    assert frame.locator("canvas.thumb").count() == 2 * 4
    _shot(page, "notebook")
    assert dialogs == [] and errors == [] and requests == [path.as_uri()]
    # a long capture is cut to the limit, so the page stays small
    big = TinyEncoder()
    toks, ids = big.tokenize(" ".join(["word"] * 600))
    html = capture(big, ids, tokens=toks)._repr_html_()
    assert len(html) < 4_000_000 and "Cut to the first" in html
    page.close()


# The page's words as the reader sees them: visible text, the chosen option of each menu,
# tooltips and accessible names; never what is marked translate="no" (tokens, translations,
# layer names: data, not words of the page).
@pytest.mark.parametrize("lang", ["my", "vi", "bn", "zh"])
def test_every_view_is_in_the_readers_language(server, browser, lang):
    strings = json.loads(
        (ROOT / "src/qkv/apps/serve/static/i18n/strings.json").read_text()
    )
    page, errors, dialogs, outside = _open(browser, f"{server}/?model=tiny-fr&translate=1"
                                           f"&text=the%20boy%20trains%20the%20puppy&lang={lang}")  # fmt: skip
    assert page.get_attribute("html", "lang") == lang

    def check(where: str) -> None:
        text = page_text(page)
        assert english_left(strings, lang, text) == [], (lang, where, text)

    for view in ("step", "head", "model", "trans", "work"):
        page.click(f".tab[data-view='{view}']")
        _ready(page)
        check(view)
    page.click(".tab[data-view='trans']")
    page.select_option("#beam", "2")  # the beam table and the greedy line
    _ready(page)
    page.wait_for_selector("#beams")
    check("trans, beam 2")
    page.click(".tab[data-view='work']")
    page.uncheck("input.switch[data-layer='decoder.layers.0.self_attn'][data-head='0']")
    page.click("#ablate-run")  # what changed; the probe's "it" is not in the text: its message
    _ready(page)
    page.wait_for_selector("#changes")
    check("work, a head off")
    page.select_option("#model", "random")  # the random-weights notice
    _ready(page)
    assert not page.is_hidden("#notice")
    page.click(".tab[data-view='work']")
    page.click("#probe-example")  # the probe's verdict
    _ready(page)
    page.wait_for_selector("#probe-verdict")
    check("work, probe")
    for view in ("step", "head", "model", "trans", "work"):
        page.click(f".tab[data-view='{view}']")
        _ready(page)
        check(f"random, {view}")
    page.fill("#text", " ")  # refused by the server: the error, in the reader's words
    page.press("#text", "Enter")
    _ready(page)
    assert page.text_content("#notice") and not page.is_hidden("#notice")
    check("error")
    page.fill("#text", "A GROUP OF MUSICIANS IS PLAYING ON THE STAGE.")  # far from the captions
    page.select_option("#model", "en-fr")  # (a shipped translator: it ticks translate)
    _ready(page)
    assert strings[lang]["warn.pieces"] in page.text_content("#notice")
    check("warning")
    page.select_option("#lang", "en")  # and back: the same page in English
    assert page.text_content("#run") == "Run" and page.get_attribute("html", "lang") == "en"
    assert dialogs == [] and _but_refusals(errors) == [] and outside == []
    page.close()


def test_a_failed_request_clears_the_maps_and_says_why(browser, tmp_path):
    """A model that fails every request: the previous model's maps do not stay under its name."""
    from qkv.apps.serve.models import Registry, default_registry
    from serve_helpers import running_server

    def broken():
        raise ValueError("this model cannot read text")

    reg = Registry()
    reg._entries["random"] = default_registry()._entries["random"]
    reg.add("broken", broken)
    with one_thread(), running_server(create_app(reg)) as port:
        page, errors, dialogs, _ = _open(browser, f"http://127.0.0.1:{port}/?model=random")
        assert page.eval_on_selector_all("#view-step .card", "cs => cs.length") > 0
        page.select_option("#model", "broken")
        _ready(page)
        notice = page.text_content("#notice")
        assert "could not answer" in notice and "this model cannot read text" in notice
        assert "this model cannot read text" in page.text_content("#view-step")
        for view in ("step", "head", "model", "trans", "work"):
            page.click(f".tab[data-view='{view}']")
            assert page.eval_on_selector_all(f"#view-{view} canvas, #view-{view} .card",
                                             "x => x.length") == 0  # fmt: skip
        assert page.eval_on_selector_all("#layer option", "o => o.length") == 0
        assert page.eval_on_selector_all("#stats tbody tr", "r => r.length") == 0
        assert page.text_content("#status") == ""
        _shot(page, "failed_request")
        page.select_option("#model", "random")  # and back: maps again, no error
        _ready(page)
        assert page.is_hidden("#notice") is False  # the random-weights notice
        assert "could not answer" not in page.text_content("#notice")
        assert page.eval_on_selector_all("#view-work .card", "cs => cs.length") > 0
        assert dialogs == [] and _but_refusals(errors) == []
        page.close()


def _but_refusals(errors: list[str]) -> list[str]:
    """The console's errors but the browser's own line for each 4xx the server answered."""
    return [e for e in errors if not e.startswith("Failed to load resource: the server responded")]


def test_the_layer_menu_is_never_cut(server, browser):
    """At 1280×800 the layer menu is as wide as its longest name (e.g. a decoder's
    "decoder.layers.1.cross_attn (cross)"), in every language, and the page does not scroll
    sideways."""
    page, errors, _, _ = _open(browser, f"{server}/?model=tiny-fr&translate=1&view=trans")
    natural = """s => { const c = s.cloneNode(true); c.style.cssText = "position:absolute;max-width:none";
      document.body.append(c); const w = c.getBoundingClientRect().width; c.remove();
      return [s.getBoundingClientRect().width, w, s.getBoundingClientRect().right]; }"""
    for lang in ("en", "my", "vi", "bn", "zh"):
        page.select_option("#lang", lang)
        shown, wanted, right = page.eval_on_selector("#layer", natural)
        assert shown >= wanted - 0.5 and right <= 1280, (lang, shown, wanted, right)
        assert page.evaluate("document.documentElement.scrollWidth") <= 1280
    page.select_option("#lang", "en")
    assert page.input_value("#layer") == "decoder.layers.1.cross_attn"
    _shot(page, "layer_menu")
    assert errors == []
    page.close()
