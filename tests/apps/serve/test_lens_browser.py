"""The Lens view in a real browser (Debian's chromium via Playwright) on a real server: what
the page shows is the numbers of ``POST /api/lens`` (the layer × position table of top
tokens, every head's effect on the prediction, the selected head's tokens beside its map),
a click on a column re-attributes that position, the view is in the reader's language, and
its downloads carry the lens. Screenshots in tests/artifacts/lens_*.png."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from serve_helpers import open_page, page_ready, playwright_or_skip, post_json

playwright_or_skip()  # skips the module without chromium or Playwright (fails on CI)
pytest.importorskip("uvicorn")
from serve_helpers import english_left, page_text  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
ARTIFACTS = ROOT / "tests" / "artifacts"
STRINGS = json.loads((ROOT / "src/qkv/apps/serve/static/i18n/strings.json").read_text())
BOY = "The boy trains the puppy."
URL = "/?model=en-fr&translate=1&text=The+boy+trains+the+puppy.&view=lens"


def _lens(server: str, **body) -> dict:
    return post_json(server, "/api/lens", **body)


def _ready(page) -> None:
    page_ready(page)
    page.wait_for_selector("#view-lens[data-state='ready']")


def _fmt(v: float) -> str:  # export.js fmt(): 3 decimals (1 from 100 up), a minus sign, no "-0"
    s = f"{v:.1f}" if abs(v) >= 100 else f"{v:.3f}"
    return s.lstrip("-") if not s.strip("-0.") else s.replace("-", "\u2212")


def _shot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"lens_{name}.png"), full_page=True)


def test_lens_view_shows_the_apis_numbers(server, browser):
    page, errors, dialogs, outside = open_page(browser, server + URL, height=1100, downloads=True)
    _ready(page)
    assert page.is_visible(".tab[data-view='lens']")
    api = _lens(server, text=BOY, model="en-fr", translate=True, beam=1, ablate=[], top_k=5)
    # the table: a row per layer, a column per decoder input, each cell the lens's top token
    cells = page.eval_on_selector_all(
        "table.lens-table tr[data-layer]",
        "rs => rs.map(r => [...r.querySelectorAll('td')].map(td => [td.textContent, +td.dataset.p]))",
    )
    assert [[c[0] for c in row] for row in cells] == [
        [cell[0] for cell in row] for row in api["lens"]["tokens"]
    ]
    assert [[c[1] for c in row] for row in cells] == [
        [p[0] for p in row] for row in api["lens"]["probs"]
    ]
    heads = page.eval_on_selector_all(
        "#lens-heads td[data-head]",
        "ts => ts.map(t => [t.dataset.layer, +t.dataset.head, t.textContent])",
    )
    assert sorted(heads) == sorted(
        [h["layer"], h["head"], _fmt(h["target"])] for h in api["dla"]["heads"]
    )
    # hover a cell: the top k with their probabilities
    page.hover("table.lens-table tr[data-layer='decoder.layers.1'] td[data-pos='2']")
    tip = page.text_content("#tip")
    first = api["lens"]["tokens"][2][2][0]
    assert f"1. {first}  {_fmt(api['lens']['probs'][2][2][0])}" in tip
    # pick a head: its tokens pushed up and down, and its attention map beside them
    page.click("#lens-heads td[data-layer='decoder.layers.2.cross_attn'][data-head='1']")
    _ready(page)
    h = next(
        x
        for x in api["dla"]["heads"]
        if x["layer"] == "decoder.layers.2.cross_attn" and x["head"] == 1
    )
    up = page.eval_on_selector_all(
        "#lens-push .bars[data-dir='up'] > div:not(.hint)",
        "rs => rs.map(r => [r.querySelector('.t').textContent, r.querySelector('.num').textContent])",
    )
    assert up == [[tok, _fmt(v)] for tok, v in h["up"]]
    down = page.eval_on_selector_all(
        "#lens-push .bars[data-dir='down'] .t", "ts => ts.map(t => t.textContent)"
    )
    assert down == [tok for tok, _ in h["down"]]
    assert page.is_visible(".lens-map canvas")
    assert page.input_value("#layer") == "decoder.layers.2.cross_attn"
    _shot(page, "en")
    # a click on a column attributes that position
    page.click("table.lens-table th.pos[data-pos='2']")
    _ready(page)
    api2 = _lens(server, text=BOY, model="en-fr", translate=True, beam=1, ablate=[], top_k=5,
                 position=2)  # fmt: skip
    assert page.get_attribute("table.lens-table th.sel", "data-pos") == "2"
    got = page.eval_on_selector_all(
        "#lens-heads td[data-head]",
        "ts => ts.map(t => [t.dataset.layer, +t.dataset.head, t.textContent])",
    )
    assert sorted(got) == sorted(
        [x["layer"], x["head"], _fmt(x["target"])] for x in api2["dla"]["heads"]
    )
    assert api2["predicted"] in page.text_content("#lens-dla p")
    # downloads: the CSV is the table's top-1 probabilities, the JSON the whole lens
    with page.expect_download() as info:
        page.click("#view-lens .export[data-format='csv']")
    csv = Path(info.value.path()).read_text(encoding="utf-8").splitlines()
    assert csv[0].startswith("layer \\ position,") and len(csv) == 1 + len(api2["lens"]["layers"])
    first_row = csv[1].split(",")
    assert first_row[0] == "embeddings"
    assert [float(x) for x in first_row[1:]] == [p[0] for p in api2["lens"]["probs"][0]]
    with page.expect_download() as info:
        page.click("#view-lens .export[data-format='json']")
    shown = json.loads(Path(info.value.path()).read_text(encoding="utf-8"))["shown"]["lens"]
    assert shown["lens"] == api2["lens"] and shown["position"] == 2
    with page.expect_download() as info:
        page.click("#view-lens .export[data-format='svg']")
    svg = Path(info.value.path()).read_text(encoding="utf-8")
    assert "logit lens" in svg and "<script" not in svg
    # a model without a decoder: no Lens tab, and the view says why
    page.select_option("#model", "random")
    page_ready(page)
    assert not page.is_visible(".tab[data-view='lens']")
    assert page.get_attribute("#view-lens", "data-state") == "none"
    assert errors == [] and dialogs == [] and outside == []


@pytest.mark.parametrize("lang", ["zh", "my", "vi", "bn"])
def test_lens_view_is_in_the_readers_language(server, browser, lang):
    page, errors, _, _ = open_page(browser, f"{server}{URL}&lang={lang}", height=1100)
    _ready(page)
    page.click("#lens-heads td[data-layer='decoder.layers.1.self_attn'][data-head='0']")
    _ready(page)
    assert page.is_visible("#lens-push")
    assert page.text_content(".tab[data-view='lens']") == STRINGS[lang]["tab.lens"]
    text = page_text(page)
    assert english_left(STRINGS, lang, text) == [], text
    _shot(page, lang)
    assert errors == []


def test_a_transformers_decoder_only_model(browser, tmp_path):
    """A local transformers Llama (tiny, random): the Lens tab is there for causal maps, its
    table is the API's, and a head of the grid opens its tokens and its map."""
    pytest.importorskip("transformers")
    from test_serve_lens import _llama_dir

    from qkv.apps.serve.app import create_app
    from qkv.apps.serve.models import default_registry
    from serve_helpers import one_thread, running_server

    reg = default_registry({"llama": str(_llama_dir(tmp_path / "llama"))})
    with one_thread(), running_server(create_app(reg)) as port:
        server = f"http://127.0.0.1:{port}"
        page, errors, _, _ = open_page(
            browser, f"{server}/?model=llama&text=the+boy+trains+the+puppy"
        )
        assert page.is_visible(".tab[data-view='lens']")
        page.click(".tab[data-view='lens']")
        _ready(page)
        api = _lens(server, text="the boy trains the puppy", model="llama", translate=False,
                    beam=1, ablate=[], top_k=5)  # fmt: skip
        cells = page.eval_on_selector_all(
            "table.lens-table tr[data-layer]",
            "rs => rs.map(r => [...r.querySelectorAll('td')].map(td => td.textContent))",
        )
        assert cells == [[cell[0] for cell in row] for row in api["lens"]["tokens"]]
        page.click("#lens-heads td[data-layer='model.layers.1.self_attn'][data-head='2']")
        _ready(page)
        assert page.is_visible("#lens-push") and page.is_visible(".lens-map canvas")
        _shot(page, "llama")
    assert errors == []


def test_a_2048_token_text(browser, tmp_path):
    """A 2,048-token text on a decoder-only model (the tiny Llama, 4,096 positions): the
    table is a window of positions under a strip of all of them, a late position is picked
    and attributed, its cell is the model's own top token, and the page stays responsive."""
    transformers = pytest.importorskip("transformers")
    import time

    import torch
    from test_serve_lens import WORDS, _llama_dir

    from qkv.apps.serve.app import create_app
    from qkv.apps.serve.models import default_registry
    from serve_helpers import one_thread, running_server

    path = _llama_dir(tmp_path / "long", positions=4096)
    text = " ".join(WORDS[i * 7 % len(WORDS)] for i in range(2047))  # <s> + 2,047 words
    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert ids.shape[1] == 2048
    model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    with torch.no_grad():
        want = tok.convert_ids_to_tokens(model.eval()(input_ids=ids).logits[0].argmax(-1))

    def responsive(what: str) -> float:  # a round trip to the page's script
        t0 = time.perf_counter()
        page.evaluate("() => document.querySelectorAll('#view-lens td').length")
        took = time.perf_counter() - t0
        assert took < 3, (what, took)
        return took

    reg = default_registry({"long": str(path)})
    with one_thread(), running_server(create_app(reg)) as port:
        server = f"http://127.0.0.1:{port}"
        page, errors, dialogs, _ = open_page(browser, f"{server}/?model=long&view=lens",
                                             downloads=True)  # fmt: skip
        page.fill("#text", text)
        page.press("#text", "Enter")
        _ready(page)
        assert page.text_content("#status").startswith("2048 tokens")
        responsive("drawn")
        # the window: 20 positions around the last, under the strip of all 2,048
        assert page.get_attribute("canvas.lens-overview", "data-positions") == "2048"
        pos = page.eval_on_selector_all("#view-lens th.pos", "ts => ts.map(t => +t.dataset.pos)")
        assert pos == list(range(2048 - 20, 2048))
        assert page.get_attribute("table.lens-table th.sel", "data-pos") == "2047"
        assert page.eval_on_selector_all("#view-lens td", "ts => ts.length") < 200
        # move the window (slider: kept as it is, so that a drag goes on) and attribute a late
        # position
        page.eval_on_selector("#lens-win", "s => { s.dataset.same = 'yes'; }")
        page.fill("#lens-win", "1490")
        responsive("window moved")
        assert "1490–1509" in page.text_content("#lens-win-label")
        assert page.get_attribute("#lens-win", "data-same") == "yes"
        page.click("table.lens-table th.pos[data-pos='1500']")
        _ready(page)
        responsive("position 1500 attributed")
        assert page.get_attribute("table.lens-table th.sel", "data-pos") == "1500"
        last = "table.lens-table tr[data-layer='model.layers.1'] td[data-pos='1500']"
        assert page.text_content(last) == want[1500]
        assert f"“{want[1500]}”" in page.text_content("#lens-dla p")
        page.hover(last)
        assert f"1. {want[1500]}  " in page.text_content("#tip")
        # the strip (a pixel: about 2 positions): hover names the cell under the pointer and
        # its top token, a click moves the window there
        box = page.locator("canvas.lens-overview").bounding_box()
        page.mouse.move(box["x"] + box["width"] * 300.5 / 2048, box["y"] + box["height"] - 2)
        tip = page.text_content("#tip")
        j = int(re.search(r"(\d+) \(", tip)[1])
        assert abs(j - 300) <= 2 and tip.startswith("model.layers.1,") and f": {want[j]}  " in tip
        page.mouse.click(box["x"] + box["width"] * 300.5 / 2048, box["y"] + 2)
        first = page.eval_on_selector("table.lens-table th.pos", "t => +t.dataset.pos")
        assert first == j - 10
        responsive("window moved by the strip")
        # a head: its exact map (asked for), the attributed row outlined
        page.click("#lens-heads td[data-layer='model.layers.1.self_attn'][data-head='2']")
        _ready(page)
        page.wait_for_selector("#view-lens .lens-map canvas")
        assert page.get_attribute("#view-lens .lens-map canvas", "data-rows") == "2048"
        responsive("head map drawn")
        page.fill("#lens-win", "1490")
        page.screenshot(path="/tmp/lens-long.png")
        # downloads: the CSV holds every position, the picture the table's window
        with page.expect_download() as info:
            page.click("#view-lens .export[data-format='csv']")
        csv = Path(info.value.path()).read_text(encoding="utf-8").splitlines()
        assert len(csv) == 4 and all(len(row.split(",")) == 1 + 2048 for row in csv[1:])
        with page.expect_download() as info:
            page.click("#view-lens .export[data-format='svg']")
        svg = Path(info.value.path()).read_text(encoding="utf-8")
        assert "(positions 1490–1509 of 2048)" in svg and 'data-cols="20"' in svg
        _shot(page, "long")
        page.locator("#view-lens .lens-map").scroll_into_view_if_needed()
        _shot(page, "long_map")
        for lang in ("my", "vi", "bn", "zh"):  # the window's words too
            page.select_option("#lang", lang)
            assert STRINGS[lang]["lens.slider"] == page.get_attribute("#lens-win", "aria-label")
            assert english_left(STRINGS, lang, page_text(page)) == [], lang
        assert errors == [] and dialogs == []
        page.close()
