"""The static site (``qkv web build``) in Debian's chromium, served by ``python -m http.server``
on 127.0.0.1: the first view paints from the answer saved at build time, nothing leaves the
origin and no ``/api/`` request is made, the language menu and a narrow window work, what the
site cannot compute is said in a sentence, and the page keeps working with the network off.
Screenshots: tests/artifacts/site_wide.png, site_narrow.png."""

from __future__ import annotations

import json
from pathlib import Path

from site_helpers import SENTENCE, open_site, strings

from serve_helpers import playwright_or_skip

playwright_or_skip()  # skips the module without chromium or Playwright (fails on CI)

ROOT = Path(__file__).resolve().parents[3]
ARTIFACTS = ROOT / "tests" / "artifacts"


def _views_filled(page, views=("head", "model", "work", "step")) -> None:
    """Each map view of the current answer shows something, and none the site's refusal
    (the probe may say that the sentence has no "it": that is the answer's)."""
    for view in views:
        page.click(f".tab[data-view='{view}']")
        root = page.locator(f"#view-{view}")
        assert root.is_visible()
        assert root.locator("canvas, .toks, table, .switches input").count() > 0, view
        assert "qkv serve" not in root.text_content(), view


def test_first_view_paints_from_the_saved_answer(site, site_url, browser):
    o = open_site(browser, site_url)
    try:
        page = o.page
        # every step of head 0 drawn, the 8 tokens of the notes' sentence as rows
        assert page.locator("#view-step .card canvas[data-rows='8']").count() >= 8
        assert page.text_content("#status").startswith("8 tokens")
        assert page.locator("#stats tbody tr").count() == 4  # the random model's 4 heads
        page.click(".tab[data-view='head']")
        tokens = page.locator("#view-head .toks").first.text_content()
        assert "puppy" in tokens and "boy" in tokens
        assert page.input_value("#text") == SENTENCE
        assert "/saved/random-maps.json" in o.paths  # the answer saved at build time
        for path in o.paths:  # every request is a file of the site
            assert (site / (path.lstrip("/") or "index.html")).is_file(), path
        ARTIFACTS.mkdir(exist_ok=True)
        page.click(".tab[data-view='step']")
        page.screenshot(path=str(ARTIFACTS / "site_wide.png"))
        o.clean()
    finally:
        o.close()


def test_first_view_downloads_little(site, site_url, browser):
    """The first view's bytes: every file the page fetched until its map was drawn, each
    whole (the site has no compression to hide a file's size)."""
    o = open_site(browser, site_url)
    try:
        got = o.page.evaluate("""() => performance.getEntriesByType('navigation')
            .concat(performance.getEntriesByType('resource')).filter((e) => e.responseEnd > 0)
            .map((e) => [new URL(e.name).pathname, e.transferSize, e.decodedBodySize])""")
        assert {"/", "/static/app.js", "/site.json", "/saved/random-maps.json"} <= {
            p for p, _, _ in got}  # fmt: skip
        for path, sent, body in got:
            assert body == (site / (path.lstrip("/") or "index.html")).stat().st_size, path
            assert sent > body, path  # the body and its headers
        assert sum(sent for _, sent, _ in got) <= 40 * 10**6
        o.clean()
    finally:
        o.close()


def test_a_link_to_the_first_view_opens_from_the_saved_answer(site, site_url, browser):
    """The address the page writes after the first view (with its layer and head), opened
    again: the same saved answer, no refusal."""
    o = open_site(browser, site_url, "?model=random&text=The+boy+trains+the+puppy.&view=head"
                  "&layer=encoder.layers.0.self_attn&head=0")  # fmt: skip
    try:
        assert strings(site)["en"]["site.savedOnly"].format(name="random") not in o.page.text_content("#notice")
        assert o.page.text_content("#status").startswith("8 tokens")
        assert o.page.locator("#view-head .toks").count() > 0
        o.clean()
    finally:
        o.close()


def test_the_language_menu(site, site_url, browser):
    words = strings(site)
    o = open_site(browser, site_url, "?lang=vi")
    try:
        page = o.page
        assert page.evaluate("document.documentElement.lang") == "vi"
        assert page.text_content(".tab[data-view='step']") == words["vi"]["tab.step"]
        assert page.text_content("#model option") == words["vi"]["model.random"]
        page.select_option("#lang", "zh")
        assert page.text_content(".tab[data-view='head']") == words["zh"]["tab.head"]
        assert "lang=zh" in page.url
        o.clean()
    finally:
        o.close()


def test_a_narrow_window_has_no_horizontal_overflow(site_url, browser):
    o = open_site(browser, site_url, width=375, height=740)
    try:
        page = o.page
        out = page.evaluate("""() => [document.documentElement.scrollWidth,
            [...document.querySelectorAll('body *')].filter((e) => e.checkVisibility()
              && !e.closest('#views') && e.getBoundingClientRect().right > innerWidth + 0.5)
              .map((e) => e.tagName + '#' + e.id)]""")  # fmt: skip
        assert out == [375, []]  # nothing sticks out; a wide map scrolls inside #views
        assert page.locator("#run").bounding_box()["x"] + 20 < 375
        page.screenshot(path=str(ARTIFACTS / "site_narrow.png"))
        o.clean()
    finally:
        o.close()
    # the translation's map takes the window's width (the decoder's self-attention goes below)
    o = open_site(browser, site_url, "?translate=1&view=trans", width=375, height=740)
    try:
        box = o.page.locator("#view-trans canvas").first.bounding_box()
        assert 200 <= box["width"] and box["x"] + box["width"] <= 375
        o.page.screenshot(path=str(ARTIFACTS / "site_narrow_translation.png"))
        o.clean()
    finally:
        o.close()


def test_a_new_sentence_without_the_engine_is_refused_in_a_sentence(site, site_url, browser):
    said = strings(site)["en"]["site.savedOnly"].format(name="random")
    o = open_site(browser, site_url)
    try:
        page = o.page
        page.fill("#text", "A dog runs in the snow.")
        page.press("#text", "Enter")
        page.wait_for_selector("body[data-ready='1']")
        notice = page.text_content("#notice")
        assert said in notice and "qkv serve" in notice
        assert said in page.text_content("#view-step .err")
        assert "Traceback" not in page.content() and "Error:" not in notice
        o.clean()
    finally:
        o.close()


def test_another_head_without_the_engine_shows_its_weights(site, site_url, browser):
    """The saved answer holds every head's weights: another head of the saved sentence shows
    them, with the note that its steps are not in the site (no error, maps kept)."""
    words = strings(site)["en"]
    o = open_site(browser, site_url)
    try:
        page = o.page
        page.select_option("#head", "2")
        page.wait_for_selector("body[data-ready='1']")
        text = page.text_content("#view-step")
        assert words["step.unavailable"] in text and "head 2" in text
        assert page.locator("#view-step canvas[data-rows='8']").count() == 1
        assert words["site.savedOnly"].format(name="random") not in page.text_content("#notice")
        assert page.locator("#view-step .err").count() == 0
        o.clean()
    finally:
        o.close()


def test_it_keeps_working_offline_once_loaded(site, site_url, browser):
    """With the network off: the views switch, and the saved translation (fetched after the
    first view) opens when "translate" is ticked."""
    translated = json.loads((site / "saved" / "random-translate.json").read_text())
    o = open_site(browser, site_url)
    try:
        page = o.page
        page.wait_for_function("""() => performance.getEntriesByType('resource').some(
            (e) => e.name.endsWith('/saved/random-translate.json') && e.responseEnd > 0)""")
        o.context.set_offline(True)
        _views_filled(page)
        page.check("#translate")
        page.wait_for_selector("body[data-ready='1']")
        _views_filled(page, ("trans", "head", "model", "step"))
        page.click(".tab[data-view='trans']")
        shown = page.text_content("#view-trans")
        assert translated["translation"]["target_tokens"][0] in shown
        assert page.locator("#view-trans canvas").count() > 0
        o.clean()
        page.fill("#text", "A new sentence.")  # offline and no engine: still one sentence
        page.press("#text", "Enter")
        page.wait_for_selector("body[data-ready='1']")
        assert "qkv serve" in page.text_content("#notice")
    finally:
        o.close()


def test_a_link_to_a_model_of_one_s_own_points_to_qkv_serve(site, site_url, browser):
    """A link written by qkv serve for a model of the user's own (``--model mine=DIR``)."""
    said = strings(site)["en"]["site.ownModel"].format(models="random")
    o = open_site(browser, site_url, "?model=mine&text=A+dog+runs.&view=head")
    try:
        assert said in o.page.text_content("#notice") and "qkv serve --model" in said
        assert said in o.page.text_content("#view-head .err")
        o.clean()
    finally:
        o.close()


def test_opened_as_a_file_it_says_it_needs_a_web_server(site, browser):
    """index.html double-clicked (file://): the browser lets it read no other file; the page
    says how to serve it instead of a fetch error."""
    page = browser.new_page()
    try:
        page.goto((site / "index.html").as_uri())
        page.wait_for_selector("#notice:not([hidden])")
        notice = page.text_content("#notice")
        assert "python -m http.server" in notice and "Failed to fetch" not in notice
    finally:
        page.close()


def test_a_beam_without_translating_opens_the_saved_maps(site_url, browser):
    """The beam is read when translating only: ?beam=4 on the maps is the saved answer."""
    o = open_site(browser, site_url, "?beam=4")
    try:
        assert o.page.input_value("#beam") == "4"
        assert o.page.text_content("#status").startswith("8 tokens")
        assert "qkv serve" not in o.page.text_content("#notice")
        o.clean()
    finally:
        o.close()
