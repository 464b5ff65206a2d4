"""A 2,048-token text in the explorer, in a real browser (Debian's chromium via Playwright)
against a real server: every view draws it on canvas within a deadline, hover shows the exact
value of the cell under the pointer (the API's packed map, decoded as the page decodes it),
and the head view shows a window of queries (downloads: test_export_browser.py)."""

from __future__ import annotations

import json
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import numpy as np
import pytest

import deadline
from serve_helpers import open_page, playwright_or_skip, post_json
from serve_helpers import page_ready as _ready

playwright_or_skip()
pytest.importorskip("uvicorn")

from qkv.apps.serve.long import unpack  # noqa: E402
from serve_helpers import english_left, page_text  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]  # the repository (this is tests/apps/serve/)
ARTIFACTS = ROOT / "tests" / "artifacts"
LONG = " ".join(f"w{i % 97}" for i in range(2046))  # [CLS] + 2,046 words + [SEP]: 2,048 tokens


def _shot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"long_{name}.png"))


def _as_page_shows(v: float) -> str:
    """``v`` as the page writes it: stored in a Float32Array, then ``toFixed(3)`` (ties away
    from zero, on the exact binary value)."""
    f = Decimal(float(np.float32(v)))
    s = str(f.quantize(Decimal("0.001"), rounding=ROUND_HALF_UP))
    return s.lstrip("-") if not s.strip("-0.") else s.replace("-", "\u2212")  # export.js fmt()


def _timed(page, what: str, act, ready_selector: str, base: float = 20.0) -> None:
    """``act()``, then wait until ``ready_selector`` is there: within ``base`` seconds of a
    quiet machine (scaled by the load; skip if it was saturated, fail if it was idle)."""
    d = deadline.Deadline(base, what)
    act()
    page.wait_for_selector(ready_selector, timeout=1000 * base * max(1.0, d.max_scale) * 3)
    _ready(page)
    if d.expired():
        d.give_up(f"{d.elapsed():.1f} s")


def _hover(page, canvas: str, fx: float, fy: float) -> tuple[int, int, str]:
    """Move the mouse to (fx, fy) of the map's cells in ``canvas``: the tooltip's cell and value."""
    page.locator(canvas).scroll_into_view_if_needed()
    box = page.locator(canvas).bounding_box()
    rows, cols = (int(page.get_attribute(canvas, a)) for a in ("data-rows", "data-cols"))
    assert rows > 128 and cols > 128  # a long map: no labels, the cells fill the canvas
    page.mouse.move(box["x"] + fx * box["width"], box["y"] + fy * box["height"])
    page.wait_for_selector("#tip:not([hidden])")
    i, j = map(int, page.get_attribute("#tip", "data-cell").split(","))
    return i, j, page.text_content("#tip").rsplit("= ", 1)[1]


def test_a_2048_token_text_in_every_view(server, browser):
    resp = post_json(server, text=LONG, model="random")
    assert len(resp["tokens"]) == 2048 and not resp["truncated"] and resp["limit"] == 2048
    ex = resp["exact"]
    exact = unpack(ex, tuple(ex["shape"])).numpy()  # (2048, 2048): layer 0, head 0
    page, errors, dialogs, outside = open_page(browser, f"{server}/?model=random")
    page.fill("#text", LONG)
    _timed(page, "2,048 tokens computed and drawn step by step", lambda: page.press("#text", "Enter"),
           "#view-step .card[data-key='weights'] .hm > canvas", base=60)  # fmt: skip
    assert page.text_content("#status").startswith("2048 tokens")
    assert "pooled" in page.text_content("#notice")
    keys = page.eval_on_selector_all("#view-step .card", "cs => cs.map(c => c.dataset.key)")
    assert keys == ["x", "q", "k", "v", "scores", "scaled", "mask", "masked", "weights",
                    "output", "concat", "wo"]  # fmt: skip
    canvas = "#view-step .card[data-key='weights'] .hm > canvas"
    for fx, fy in ((0.5, 0.5), (0.13, 0.77), (0.99, 0.01)):
        i, j, shown = _hover(page, canvas, fx, fy)
        assert shown == _as_page_shows(exact[i, j]), (i, j, shown, exact[i, j])
    i, j, shown = _hover(page, "#view-step .card[data-key='masked'] .hm > canvas", 0.3, 0.6)
    assert abs(float(shown.replace("\u2212", "-"))) < 1000  # the masked scores: finite here (no mask in an encoder)
    _shot(page, "step")

    # model view: the pooled thumbnails, and the selected head exact under them
    _timed(page, "the model view of 2,048 tokens", lambda: page.click(".tab[data-view='model']"),
           "#exact-card .hm > canvas")  # fmt: skip
    assert page.eval_on_selector_all("canvas.thumb", "cs => cs.length") == 2 * 4
    k = resp["layers"][0]["pooled"]["k"]
    assert k == 16 and len(resp["layers"][0]["weights"][0]) == 2048 // k
    _shot(page, "model")
    i, j, shown = _hover(page, "#exact-card .hm > canvas", 0.61, 0.42)
    assert shown == _as_page_shows(exact[i, j]), (i, j, shown)
    _shot(page, "model_exact")

    # head view: a window of 48 queries, each with its strongest keys
    _timed(page, "the head view of 2,048 tokens", lambda: page.click(".tab[data-view='head']"),
           "#win-slider")  # fmt: skip
    qs = page.eval_on_selector_all(".toks.left div", "ds => ds.map(d => +d.dataset.i)")
    assert qs == list(range(48))
    page.fill("#win-slider", "1000")
    page.dispatch_event("#win-slider", "change")
    qs = page.eval_on_selector_all(".toks.left div", "ds => ds.map(d => +d.dataset.i)")
    assert qs == list(range(1000, 1048))
    page.click(".toks.left div[data-i='1010']")  # pinned: its lines and blocks only
    top = resp["top"]
    want = dict(zip(top["index"][0][1010], top["weights"][0][1010]))
    keys = page.eval_on_selector_all(".toks.right div", "ds => ds.map(d => +d.dataset.j)")
    blocks = page.eval_on_selector_all(".blocks span", "s => s.map(x => +x.dataset.v)")
    assert set(want) <= set(keys)
    assert {j: v for j, v in zip(keys, blocks) if v} == pytest.approx(want, abs=1e-9)
    _shot(page, "head")

    # another head: asked for, and the step view draws it
    _timed(page, "head 2 of 2,048 tokens", lambda: page.select_option("#head", "2"),
           "#view-head #win-slider", base=60)  # fmt: skip
    page.click(".tab[data-view='step']")
    assert "head 2 of 4" in page.text_content("#view-step .intro")
    resp2 = post_json(server, text=LONG, model="random", head=2)
    exact2 = unpack(resp2["exact"], (2048, 2048)).numpy()
    i, j, shown = _hover(page, canvas, 0.25, 0.25)
    assert shown == _as_page_shows(exact2[i, j])
    assert dialogs == [] and errors == [] and outside == []
    page.close()


def test_a_model_with_fewer_positions_says_so(server, browser):
    """The tiny translator's encoder has 256 positions: the text stops at 255 tokens and the
    notice says why; the long answer's views speak the reader's language."""
    strings = json.loads((ROOT / "src/qkv/apps/serve/static/i18n/strings.json").read_text())
    page, errors, _, _ = open_page(browser, f"{server}/?model=tiny-fr&lang=vi")
    page.fill("#text", LONG)
    page.press("#text", "Enter")
    _ready(page)
    d = post_json(server, text=LONG, model="tiny-fr")
    assert (d["limit"], d["positions"], d["truncated"]) == (255, 256, True)
    want = strings["vi"]["notice.cutPositions"].format(n=len(d["tokens"]), limit=255, positions=256)
    assert want in page.text_content("#notice")
    for view in ("step", "head", "model"):  # a long answer's words: all in the reader's language
        page.click(f".tab[data-view='{view}']")
        _ready(page)
        assert english_left(strings, "vi", page_text(page)) == [], view
    assert errors == []
    page.close()
