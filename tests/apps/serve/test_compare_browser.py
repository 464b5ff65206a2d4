"""Compare in the explorer, in a real browser (Debian's chromium via Playwright) against a real
server: sentence A beside sentence B (a Winograd pair) in the head, step and model views, the
difference map B − A equal to the API's numbers, the address that reopens the comparison, one
sentence with heads switched off, token counts that differ, every language, the offline page."""

from __future__ import annotations

import csv
import io
import json
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlsplit

import numpy as np
import pytest

from serve_helpers import playwright_or_skip

ROOT = Path(__file__).resolve().parents[3]  # the repository (this is tests/apps/serve/)
ARTIFACTS = ROOT / "tests" / "artifacts"
SVG_NS = "{http://www.w3.org/2000/svg}"
BIG = "The trophy didn't fit in the suitcase because it was too big."
SMALL = "The trophy didn't fit in the suitcase because it was too small."
SHORT = "The trophy didn't fit."
L0, L1 = "encoder.layers.0.self_attn", "encoder.layers.1.self_attn"
XSS = "<script>alert(1)</script> <img src=x onerror=alert(1)>"

sync_api = playwright_or_skip()
pytest.importorskip("uvicorn")

from qkv.apps.serve.long import unpack  # noqa: E402
from serve_helpers import english_left, expect_download, open_page, page_text, post_json  # noqa: E402  # noqa: E402
from serve_helpers import page_ready as _ready  # noqa: E402

STRINGS = json.loads((ROOT / "src/qkv/apps/serve/static/i18n/strings.json").read_text())


def _open(browser, url):
    return open_page(browser, url, downloads=True)[:3]  # (page, errors, dialogs)


def _url(server, **q) -> str:
    return f"{server}/?{urlencode(q)}"


def _shot(page, name):
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"compare_{name}.png"))


def _card_download(page, view: str, fmt: str) -> bytes:
    """A download of the A/B/B − A card of ``view``."""
    d = expect_download(page, page.locator(
        f"#view-{view} #compare-card .export-bar button[data-format='{fmt}']"))
    assert d.suggested_filename.endswith(f"_diff.{fmt}")
    data = Path(d.path()).read_bytes()
    if fmt == "svg":  # kept to look at
        ARTIFACTS.mkdir(exist_ok=True)
        (ARTIFACTS / "compare_diff.svg").write_bytes(data)
    return data


def _weights(resp: dict, layer: str, head: int) -> list[list[float]]:
    lay = next(x for x in resp["layers"] if x["name"] == layer)
    return lay["weights"][lay["heads"].index(head)]


def _minus(b: list[list[float]], a: list[list[float]]) -> list[list[float]]:
    return [[round(y - x, 3) for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]


def _check_diff(page, view: str, a: dict, b: dict, layer: str, head: int) -> list[list[float]]:
    """The card's JSON and CSV: B − A of the API's numbers for ``layer`` and ``head``."""
    want = _minus(_weights(b, layer, head), _weights(a, layer, head))
    got = json.loads(_card_download(page, view, "json"))
    assert (got["view"], got["layer"], got["head"]) == ("diff", layer, head)
    assert got["weights"] == _weights(a, layer, head)  # A, exactly as the API returned it
    cmp = got["shown"]["compare"]
    assert cmp["b"]["weights"] == _weights(b, layer, head)
    assert cmp["diff"]["values"] == want
    rows = list(csv.reader(io.StringIO(_card_download(page, view, "csv").decode(), newline="")))
    assert rows[0][0] == "query \\ key" and [r[0] for r in rows[1:]] == cmp["diff"]["rows"]
    assert [[float(v) for v in r[1:]] for r in rows[1:]] == want  # negative numbers stay numbers
    return want


def _side(page, view: str, side: str, selector: str) -> int:
    return page.eval_on_selector_all(f"#view-{view} .cmp-side[data-side='{side}'] {selector}",
                                     "x => x.length")  # fmt: skip


def test_two_sentences_side_by_side_with_their_difference(server, browser):
    url = _url(server, model="random", text=BIG, compare="text", text2=SMALL, view="head",
               layer=L1, head=2)  # fmt: skip
    page, errors, dialogs = _open(browser, url)
    assert page.is_checked("#compare") and page.is_visible("#compare-bar")
    assert page.is_checked("#cmp-text") and page.input_value("#text2") == SMALL
    assert page.input_value("#layer") == L1 and page.input_value("#head") == "2"
    a = post_json(server, text=BIG, model="random")
    b = post_json(server, text=SMALL, model="random")
    assert len(a["tokens"]) == len(b["tokens"]) == 17

    # head view: A's lines beside B's, then A, B and B − A of layer 1, head 2
    left = {s: page.eval_on_selector_all(f"#view-head .cmp-side[data-side='{s}'] .toks.left div",
                                         "ds => ds.map(d => d.textContent)") for s in "ab"}  # fmt: skip
    assert left["a"] == a["tokens"] and left["b"] == b["tokens"]
    assert "big" in left["a"] and "small" in left["b"]
    for which in ("a", "b", "diff"):
        rows = page.get_attribute(f"#view-head .cmp-map[data-which='{which}'] canvas", "data-rows")
        assert rows == "17", which
    assert page.query_selector("#compare-counts") is None  # same token counts: no message
    assert "A: 17 tokens · B: 17 tokens" in page.text_content("#status")
    want = _check_diff(page, "head", a, b, L1, 2)
    assert any(v < 0 for r in want for v in r) and any(v > 0 for r in want for v in r)
    svg = ET.fromstring(_card_download(page, "head", "svg"))  # A, B and B − A, a cell per value
    maps = {g.get("data-key"): g for g in svg.iter(f"{SVG_NS}g") if g.get("class") == "heatmap"}
    assert set(maps) == {"weights", "diff"}
    cells = [c for c in maps["diff"].iter(f"{SVG_NS}g") if c.get("class") == "cells"][0]
    assert len(list(cells.iter(f"{SVG_NS}rect"))) == 17 * 17
    assert "big/small" in [t.text for t in maps["diff"].iter(f"{SVG_NS}text")]
    _shot(page, "head")

    # step by step: the card first, then every matrix of A beside B's
    page.click(".tab[data-view='step']")
    _ready(page)
    page.wait_for_selector("#view-step #compare-card")
    keys = {s: page.eval_on_selector_all(f"#view-step .cards.pairs .card[data-side='{s}']",
                                         "cs => cs.map(c => c.dataset.key)") for s in "ab"}  # fmt: skip
    assert keys["a"] == keys["b"] and keys["a"][-4:] == ["weights", "output", "concat", "wo"]
    _check_diff(page, "step", a, b, L1, 2)
    _shot(page, "step")

    # model view: A's grid beside B's, B − A of every layer × head
    page.click(".tab[data-view='model']")
    assert (
        _side(page, "model", "a", "canvas.thumb") == _side(page, "model", "b", "canvas.thumb") == 8
    )
    assert page.eval_on_selector_all("#compare-grid canvas.thumb-diff", "c => c.length") == 8
    _shot(page, "model")

    # the address holds the comparison (history.replaceState): a reload reopens it
    q = parse_qs(urlsplit(page.url).query)
    assert q["compare"] == ["text"] and q["text"] == [BIG] and q["text2"] == [SMALL]
    assert (q["view"], q["layer"], q["head"], q["model"]) == (["model"], [L1], ["2"], ["random"])
    page.select_option("#head", "1")  # a change of head: the address follows
    assert parse_qs(urlsplit(page.url).query)["head"] == ["1"]
    again, errors2, _ = _open(browser, page.url)
    assert again.is_checked("#compare") and again.input_value("#text2") == SMALL
    assert again.input_value("#text") == BIG and again.input_value("#head") == "1"
    assert again.get_attribute(".tab.active", "data-view") == "model"
    assert again.eval_on_selector_all("#compare-grid canvas.thumb-diff", "c => c.length") == 8
    again.click(".tab[data-view='head']")
    _check_diff(again, "head", a, b, L1, 1)
    assert again.url == page.url.replace("view=model", "view=head")
    # B edited and run: the address follows
    again.fill("#text2", SMALL.replace("small", "large"))
    again.press("#text2", "Enter")
    _ready(again)
    assert parse_qs(urlsplit(again.url).query)["text2"] == [SMALL.replace("small", "large")]
    assert errors == errors2 == [] and dialogs == []
    again.close()
    page.close()


def test_one_sentence_with_heads_switched_off(server, browser):
    off = [[L0, 1], [L0, 2]]
    url = _url(server, model="random", text=BIG, compare="off", view="model", layer=L1, head=0,
               off=",".join(f"{la}:{h}" for la, h in off))  # fmt: skip
    page, errors, dialogs = _open(browser, url)
    assert page.is_checked("#cmp-off") and page.is_disabled("#text2")
    assert "2" in page.text_content("#off-count")
    # B's grid dims the heads switched off; A has every head on
    assert _side(page, "model", "a", "canvas.thumb.off") == 0
    assert _side(page, "model", "b", "canvas.thumb.off") == 2
    assert "2 head(s) switched off" in page.text_content("#view-model .cmp-side[data-side='b']")
    a = post_json(server, text=BIG, model="random")
    b = post_json(server, text=BIG, model="random", ablate=off)
    want = _check_diff(page, "model", a, b, L1, 0)
    assert any(v != 0 for r in want for v in r)  # layer 1 reads layer 0's output: it changed
    assert _minus(_weights(b, L0, 0), _weights(a, L0, 0)) == [[0] * 17] * 17  # layer 0 did not
    _shot(page, "heads_off")
    page.click(".tab[data-view='work']")  # what changed: B's answer
    assert "2 head(s) off" in page.text_content("#changes")
    for h in (1, 2):
        assert not page.is_checked(f"input.switch[data-layer='{L0}'][data-head='{h}']")
    q = parse_qs(urlsplit(page.url).query)
    assert q["compare"] == ["off"] and q["off"] == [f"{L0}:1,{L0}:2"] and "text2" not in q
    assert f"off={L0}:1,{L0}:2" in page.url  # readable in the address bar
    again, errors2, _ = _open(browser, page.url)
    assert (
        again.is_checked("#cmp-off") and again.get_attribute(".tab.active", "data-view") == "work"
    )
    assert not again.is_checked(f"input.switch[data-layer='{L0}'][data-head='1']")
    assert "2 head(s) off" in again.text_content("#changes")
    assert errors == errors2 == [] and dialogs == []
    again.close()
    page.close()


def test_token_counts_that_differ_are_said_and_text_stays_text(server, browser):
    url = _url(server, model="random", text=BIG, compare="text", text2=SHORT, view="head")
    page, errors, dialogs = _open(browser, url)
    msg = page.text_content("#view-head #compare-counts")
    assert "A has 17 tokens and B has 9" in msg
    assert msg in page.text_content("#notice")  # at the top of every view too
    assert page.query_selector("#view-head .cmp-map[data-which='diff']") is None
    assert page.get_attribute("#view-head .cmp-map[data-which='a'] canvas", "data-rows") == "17"
    assert page.get_attribute("#view-head .cmp-map[data-which='b'] canvas", "data-rows") == "9"
    assert page.query_selector("#view-head #compare-card .export-bar") is None
    _shot(page, "counts")
    page.click(".tab[data-view='model']")
    assert "A has 17 tokens and B has 9" in page.text_content("#compare-grid .cmp-counts")
    assert page.eval_on_selector_all("#compare-grid canvas.thumb-diff", "c => c.length") == 0
    page.click(".tab[data-view='head']")
    page.fill("#text2", XSS)  # a hostile sentence B: shown as text, nothing runs
    page.press("#text2", "Enter")
    _ready(page)
    labels = page.eval_on_selector_all("#view-head .cmp-side[data-side='b'] .toks.left div",
                                       "ds => ds.map(d => d.textContent)")  # fmt: skip
    assert "<" in labels and "script" in labels and "onerror" in labels
    assert page.eval_on_selector_all("img, svg, iframe", "x => x.length") == 0
    page.fill("#text2", " ")  # no sentence B: said, and A alone is asked for
    page.press("#text2", "Enter")
    _ready(page)
    assert page.text_content("#compare-hint") == STRINGS["en"]["compare.needText2"]
    assert STRINGS["en"]["compare.needText2"] in page.text_content(
        "#view-head .cmp-side[data-side='b']"
    )
    page.uncheck("#compare")  # and off again: one sentence, no second request
    _ready(page)
    assert page.query_selector("#view-head .cmp-side") is None and page.is_hidden("#compare-bar")
    assert "compare" not in parse_qs(urlsplit(page.url).query)
    assert errors == [] and dialogs == []
    page.close()


def test_translations_side_by_side_and_wrapped_when_narrow(server, browser):
    a_text, b_text = "the boy trains the puppy", "a dog runs"
    url = _url(server, model="tiny-fr", translate="1", text=a_text, compare="text", text2=b_text,
               view="trans")  # fmt: skip
    page, errors, dialogs = _open(browser, url)
    want = {s: post_json(server, text=t, model="tiny-fr", translate=True)["translation"]["text"]
            for s, t in (("a", a_text), ("b", b_text))}  # fmt: skip
    side = "#view-trans .cmp-trans-pair .cmp-side[data-side='{}']"
    for s in ("a", "b"):  # each side: its sentence, its output, its cross-attention map
        assert page.text_content(side.format(s) + " .cmp-trans .intro").endswith(want[s])
        assert page.eval_on_selector_all(side.format(s) + " .hm > canvas", "c => c.length") == 1
    a, b = (page.locator(side.format(s)).bounding_box() for s in ("a", "b"))
    assert b["x"] >= a["x"] + a["width"] and abs(b["y"] - a["y"]) < 2  # beside each other
    assert page.query_selector("#view-trans #compare-card") is not None  # A, B, B − A below
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280
    _shot(page, "trans")
    page.set_viewport_size({"width": 760, "height": 800})  # narrow: B under A
    page.click(".tab[data-view='trans']")  # (drawn again for the new width)
    # both boxes read in one evaluation: the view is redrawn by the click and again when the
    # resize settles (a debounced handler), and a box read between two redraws is None
    a, b = page.wait_for_function(
        """(sel) => {
             const r = ['a', 'b'].map((s) => document.querySelector(sel.replace('{}', s)));
             if (r.some((e) => e === null || e.getBoundingClientRect().width === 0)) return null;
             return r.map((e) => { const b = e.getBoundingClientRect();
                                   return {x: b.x, y: b.y, width: b.width, height: b.height}; });
           }""",
        arg=side,
    ).json_value()
    assert b["y"] >= a["y"] + a["height"] - 1 and abs(b["x"] - a["x"]) < 2
    _shot(page, "trans_narrow")
    assert errors == [] and dialogs == []
    page.close()


@pytest.mark.parametrize("lang", ["my", "vi", "bn", "zh"])
def test_compare_is_in_the_readers_language(server, browser, lang):
    page, errors, dialogs = _open(browser, _url(server, model="random", text=BIG, compare="text",
                                                text2=SMALL, lang=lang))  # fmt: skip

    def check(where: str) -> None:
        text = page_text(page)
        assert english_left(STRINGS, lang, text) == [], (lang, where, text)

    for view in ("step", "head", "model", "trans", "work"):
        page.click(f".tab[data-view='{view}']")
        _ready(page)
        check(view)
    page.click(".tab[data-view='head']")
    assert STRINGS[lang]["compare.positions"] == page.text_content("#compare-card p.hint")
    if lang == "my":
        _shot(page, "head_my")
    page.fill("#text2", SHORT)  # token counts differ
    page.press("#text2", "Enter")
    _ready(page)
    assert page.text_content("#compare-counts") == STRINGS[lang]["compare.counts"].format(a=17, b=9)
    check("counts")
    page.check("#cmp-off")  # heads off: none yet
    _ready(page)
    assert page.text_content("#compare-hint") == STRINGS[lang]["compare.noneOff"]
    check("heads off")
    page.click(".tab[data-view='model']")
    check("heads off, model")
    assert errors == [] and dialogs == []
    page.close()


# two texts of 2,048 tokens each ([CLS] + 2,046 words + [SEP]); B: a word in twenty changed
LONG_WAIT_MS = 120_000  # two 2,048-token answers: over 30 s when other tests share the cores
LONG_A = " ".join(f"w{i % 97}" for i in range(2046))
LONG_B = " ".join(f"v{i % 89}" if i % 20 == 7 else f"w{i % 97}" for i in range(2046))


def _responsive(page, what: str) -> None:
    """A round trip to the page's script within a few seconds: the page is not frozen."""
    t0 = time.perf_counter()
    page.evaluate("() => document.querySelectorAll('canvas').length")
    assert time.perf_counter() - t0 < 3, what


def _hover_value(page, canvas: str, fx: float, fy: float) -> tuple[int, int, float]:
    page.locator(canvas).scroll_into_view_if_needed()
    box = page.locator(canvas).bounding_box()
    page.mouse.move(box["x"] + fx * box["width"], box["y"] + fy * box["height"])
    page.wait_for_selector("#tip:not([hidden])")
    i, j = map(int, page.get_attribute("#tip", "data-cell").split(","))
    return i, j, float(page.text_content("#tip").rsplit("= ", 1)[1].replace("\u2212", "-"))  # "−0.002"


def test_two_long_texts(server, browser):
    """Two texts of 2,048 tokens: both sides drawn, B − A of the selected layer and head (the
    two exact maps, cell by cell), the model view's difference grid, a link that reopens the
    comparison (the texts too long for the query: in the address's #fragment), and a page
    that stays responsive."""
    page, errors, dialogs = _open(browser, _url(server, model="random", view="head"))
    page.fill("#text", LONG_A)
    page.check("#compare")
    page.fill("#text2", LONG_B)
    # a layer picked while the two answers are computed (seconds) stays picked, and its exact
    # maps are asked for next (it used to jump back to the layer the answers were asked for)
    page.select_option("#layer", L1)
    _ready(page, LONG_WAIT_MS)
    assert page.input_value("#layer") == L1
    page.select_option("#head", "2")
    _ready(page, LONG_WAIT_MS)
    _responsive(page, "two long answers drawn")
    assert page.text_content("#status").startswith("A: 2048 tokens · B: 2048 tokens")
    a = post_json(server, text=LONG_A, model="random", layer=L1, head=2)
    b = post_json(server, text=LONG_B, model="random", layer=L1, head=2)
    assert len(a["tokens"]) == len(b["tokens"]) == 2048 and a["exact"]["head"] == 2
    # head view: each side its window of queries; the card: A, B and B − A of layer 1, head 2
    for s in "ab":
        qs = page.eval_on_selector_all(f"#view-head .cmp-side[data-side='{s}'] .toks.left div",
                                       "ds => ds.map(d => +d.dataset.i)")  # fmt: skip
        assert qs == list(range(48)), s
    card = "#view-head #compare-card"
    mapped = f"{card} .cmp-map[data-which='{{}}'] .hm > canvas"
    assert [page.get_attribute(card, f"data-{k}") for k in ("layer", "head")] == [L1, "2"]
    for which in ("a", "b", "diff"):
        assert page.get_attribute(mapped.format(which), "data-rows") == "2048"
    wa = unpack(a["exact"], (2048, 2048)).numpy()
    wb = unpack(b["exact"], (2048, 2048)).numpy()
    # (random weights over 2,048 keys are about 5e-4: their differences are a few 1e-3)
    m = float(abs(wb - wa).max())
    assert m > 1e-3  # the changed words changed the weights
    scale = page.eval_on_selector_all(f"{card} .cmp-map[data-which='diff'] .scale span",
                                      "s => s.map(x => x.textContent)")  # fmt: skip
    assert float(scale[1]) == pytest.approx(m, abs=0.0011)  # B − A of every cell, ±its largest
    big = np.unravel_index(abs(wb - wa).argmax(), wa.shape)
    for fy, fx in ((0.5, 0.5), (0.31, 0.83), ((big[0] + 0.5) / 2048, (big[1] + 0.5) / 2048)):
        i, j, v = _hover_value(page, mapped.format("diff"), fx, fy)
        assert v == pytest.approx(wb[i, j] - wa[i, j], abs=0.0011), (i, j)
    page.mouse.move(0, 0)
    _shot(page, "long_card")
    page.screenshot(path="/tmp/compare-long.png")
    page.locator("#view-head .cmp-pair").scroll_into_view_if_needed()
    _shot(page, "long_head")
    # model view: both grids, B − A of every head (pooled maps)
    page.click(".tab[data-view='model']")
    _responsive(page, "model view")
    assert [_side(page, "model", s, "canvas.thumb") for s in "ab"] == [8, 8]
    assert page.eval_on_selector_all("#compare-grid canvas.thumb-diff", "c => c.length") == 8
    _shot(page, "long_model")
    # the address: the texts in its fragment (the query stays short for the server)
    parts = urlsplit(page.url)
    q, h = parse_qs(parts.query), parse_qs(parts.fragment)
    assert len(parts.query) < 8000 and (h["text"], h["text2"]) == ([LONG_A], [LONG_B])
    assert (q["compare"], q["view"], q["layer"], q["head"]) == (["text"], ["model"], [L1], ["2"])
    assert page.is_hidden("#url-note")
    again, errors2, _ = _open(browser, page.url)
    _responsive(again, "reopened")
    assert again.input_value("#text") == LONG_A and again.input_value("#text2") == LONG_B
    assert again.get_attribute(".tab.active", "data-view") == "model"
    assert again.eval_on_selector_all("#compare-grid canvas.thumb-diff", "c => c.length") == 8
    again.click(".tab[data-view='head']")
    assert [again.get_attribute(card, f"data-{k}") for k in ("layer", "head")] == [L1, "2"]
    assert again.get_attribute(mapped.format("diff"), "data-rows") == "2048"
    assert again.url == page.url.replace("view=model", "view=head")
    assert errors == errors2 == [] and dialogs == []
    again.close()
    page.close()


def test_the_offline_page_does_not_offer_compare(browser, tmp_path):
    from qkv.apps.cli import main

    out = tmp_path / "view.html"
    assert main(["view", BIG, "--model", "random", "--out", str(out)]) == 0
    page, errors, dialogs = _open(browser, out.as_uri())
    assert page.is_hidden("#bar") and page.is_hidden("#compare-bar")
    scripts = page.eval_on_selector_all("script:not([type])", "s => s.length")
    own = (ROOT / "src/qkv/apps/serve/static/index.html").read_text().count("<script src=")
    assert scripts == own  # index.html's scripts, inlined
    for view in ("step", "head", "model"):
        page.click(f".tab[data-view='{view}']")
        assert page.query_selector(f"#view-{view} .cmp-side, #view-{view} #compare-card") is None
    assert page.url == out.as_uri()  # a file's address is left as it is
    assert errors == [] and dialogs == []
    page.close()
