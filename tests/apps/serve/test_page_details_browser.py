"""What a reader of the explorer sees in the details (Debian's chromium against a real
server on 127.0.0.1): a long text translated in pieces as ``qkv translate`` does, token labels
that fit their map and thin out where cells are narrow, no download buttons over an empty
view, numbers without ``-.00``, an empty text caught in the page, and every word of the page
in the reader's language."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from serve_helpers import expect_download, page_ready, page_text, post_json, serving

pytest.importorskip("uvicorn")
ROOT = Path(__file__).resolve().parents[3]  # the repository (this is tests/apps/serve/)
ARTIFACTS = ROOT / "tests" / "artifacts"
STRINGS = json.loads((ROOT / "src/qkv/apps/serve/static/i18n/strings.json").read_text())
LANGS = ["en", "my", "vi", "bn", "zh"]
BOY = "The boy trains the puppy."
# 41 words, 51 tokens for en-fr: one sentence longer than the 48 source tokens its maps hold
LONG = ("Several enthusiastic tourists wearing colorful backpacks are photographing the "
        "magnificent cathedral while street musicians perform traditional melodies, elderly "
        "vendors arrange baskets of oranges, and curious children chase pigeons across the "
        "crowded marketplace, admiring all the fresh fruit, watching everything around them.")  # fmt: skip

# every fillText on a canvas, with where it landed (the transform applied): the browser's
# own record of the labels and numbers a map draws
RECORD_TEXT = """
const fill = CanvasRenderingContext2D.prototype.fillText;
CanvasRenderingContext2D.prototype.fillText = function (text, x, y, ...rest) {
  const m = this.getTransform();
  (this.canvas.__texts = this.canvas.__texts || []).push({ text: String(text), font: this.font,
    x: m.a * x + m.c * y + m.e, y: m.b * x + m.d * y + m.f, angle: Math.atan2(m.b, m.a) * 180 / Math.PI });
  return fill.call(this, text, x, y, ...rest);
};
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """random, the tiny translator, the shipped en-fr, and MiniLM (an encoder, no translation)."""
    with serving(tmp_path_factory, "serve-details", minilm=True) as url:
        yield url


def _open(browser, url: str, height: int = 900, downloads: bool = False):
    """``open_page`` with the canvas text recorder installed before the page's scripts run."""
    page = browser.new_page(viewport={"width": 1280, "height": height}, accept_downloads=downloads)
    page.add_init_script(RECORD_TEXT)
    errors, requests = [], []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url) if "/api/" in r.url else None)
    page.goto(url)
    page_ready(page)
    return page, errors, requests


def _texts(page, canvas: str) -> list[dict]:
    return page.eval_on_selector(canvas, "c => c.__texts || []")


def _shot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"details_{name}.png"), full_page=True)


# ---------- 1. a long text is translated in pieces, as qkv translate does ----------


def test_a_long_sentence_is_translated_in_pieces_with_a_note(server, browser):
    """A sentence longer than the maps' 48 source tokens is not cut (and the translation no
    longer loops on a cut clause): it is split by the function ``qkv translate`` uses
    (qkv.limits.split_to_fit), each piece translated, the translations joined; the page says
    so in every language and a click on a piece shows that piece's maps."""
    from qkv.limits import split_to_fit
    from qkv.translate import load

    d = post_json(server, text=LONG, model="en-fr", translate=True)
    tr = d["translation"]
    tok = load("en-fr").tokenizer
    count = lambda s: len(tok.encode(s)) + 1  # noqa: E731  (+ </s>, as the maps count it)
    assert count(LONG) > d["limit"] == 48
    want = split_to_fit(LONG, d["limit"], count)
    assert [p["source"] for p in tr["pieces"]] == want and len(want) == 2
    assert " ".join(want).split() == LONG.split()  # nothing dropped
    assert d["truncated"] is False and "2 pieces" in d["notice"]
    assert tr["text"] == " ".join(p["text"] for p in tr["pieces"])
    for p in tr["pieces"]:  # each piece as the explorer translates it alone
        alone = post_json(server, text=p["source"], model="en-fr", translate=True)
        assert alone["translation"]["text"] == p["text"] and not alone["translation"]["pieces"]
    assert d["text"] == want[0] and tr["piece"] == 0
    two = post_json(server, text=LONG, model="en-fr", translate=True, piece=1)
    assert two["text"] == want[1] and two["translation"]["piece"] == 1
    assert two["translation"]["text"] == tr["text"]
    assert post_json(server, text=BOY, model="en-fr", translate=True)["translation"]["pieces"] == []

    page, errors, _ = _open(browser, f"{server}/?model=en-fr&translate=1&view=trans")
    page.fill("#text", LONG)
    page.press("#text", "Enter")
    page_ready(page)
    rows = page.eval_on_selector_all("#pieces tr[data-piece]", "rs => rs.map(r => r.textContent)")
    assert [r.startswith(str(i + 1)) for i, r in enumerate(rows)] == [True, True]
    assert page.text_content("#view-trans .intro").endswith(tr["text"])
    _shot(page, "pieces")
    for lang in LANGS:
        page.select_option("#lang", lang)
        note = STRINGS[lang]["notice.split"].format(n=2, limit=48, piece=1, cmd="qkv translate")
        assert note in page.text_content("#notice"), lang
    page.select_option("#lang", "en")
    page.click("#pieces tr[data-piece='1']")
    page_ready(page)
    assert page.get_attribute("#pieces tr.chosen", "data-piece") == "1"
    assert STRINGS["en"]["notice.split"].format(
        n=2, limit=48, piece=2, cmd="qkv translate"
    ) in page.text_content("#notice")
    src = page.eval_on_selector("#view-trans .hm > canvas", "c => +c.dataset.cols")
    assert src == len(two["tokens"])  # the cross-attention's columns: piece 2's source
    assert errors == []
    page.close()


# ---------- 2. token labels: room for the longest, every k-th where cells are narrow ----------

# the ink of a label (#222, anti-aliased) in the outermost pixels of a canvas: a label cut off
EDGE_INK = """c => {
  const g = c.getContext("2d"), W = c.width, H = c.height;
  const dark = (d) => { for (let k = 0; k < d.length; k += 4) if (d[k + 3] > 100 && Math.max(d[k], d[k + 1], d[k + 2]) < 140) return true; return false; };
  return { top: dark(g.getImageData(0, 0, W, 2).data), right: dark(g.getImageData(W - 2, 0, 2, H).data) };
}"""


def _labels(texts: list[dict]) -> tuple[list[dict], list[dict]]:
    """The row labels (level) and the column labels (rotated) among a map's drawn texts."""
    labels = [t for t in texts if t["font"].startswith("11px")]
    return (
        [t for t in labels if abs(t["angle"]) < 1],
        [t for t in labels if abs(t["angle"] + 60) < 1],
    )


def test_column_labels_fit_their_map_and_thin_out(server, browser):
    """A short text: every label drawn whole (nothing of `[SEP]` or a long word cut at the
    map's top or right edge). A text of about 60 tokens: columns labelled too, every k-th
    label where the cells are narrower than the font, never two on top of each other."""
    short = "The mmmmmmmmmmmm trains the puppy."
    page, errors, _ = _open(browser, f"{server}/?model=random&text={short}")
    canvas = "#view-step .card[data-key='weights'] .hm > canvas"
    C = int(page.get_attribute(canvas, "data-cols"))
    rows, cols = _labels(_texts(page, canvas))
    assert C == 8 and [t["text"] for t in cols][-1] == "[SEP]" and len(cols) == len(rows) == C
    assert page.eval_on_selector(canvas, EDGE_INK) == {"top": False, "right": False}
    page.locator(canvas).scroll_into_view_if_needed()
    page.locator(canvas).screenshot(path=str(ARTIFACTS / "details_labels_short.png"))

    words = ("A man in a blue shirt and a woman in a red dress are walking along a busy street "
             "in the city while children play near a fountain and an old man sells fresh fruit "
             "from a wooden cart, and two dogs are sleeping in the warm sun beside a small red "
             "bicycle.")  # fmt: skip
    page.fill("#text", words)
    page.press("#text", "Enter")
    page_ready(page)
    C = int(page.get_attribute(canvas, "data-cols"))
    assert 55 <= C <= 70
    rows, cols = _labels(_texts(page, canvas))
    every_c, every_r = (int(page.get_attribute(canvas, f"data-{k}-labels")) for k in ("col", "row"))
    assert every_c >= 2 and every_r >= 2  # thinned out
    assert len(cols) == math.ceil(C / every_c) and len(rows) == math.ceil(C / every_r)
    gap = min(b["x"] - a["x"] for a, b in zip(cols, cols[1:]))  # along the map's top
    assert gap * math.sin(math.pi / 3) >= 11  # two rotated labels never overlap (11 px font)
    assert min(b["y"] - a["y"] for a, b in zip(rows, rows[1:])) >= 11
    assert page.eval_on_selector(canvas, EDGE_INK) == {"top": False, "right": False}
    page.locator(canvas).scroll_into_view_if_needed()
    page.locator(canvas).screenshot(path=str(ARTIFACTS / "details_labels_long.png"))
    # the labels stand where their cells are: hover under the last column label, beside the
    # last row label, and the tooltip names that cell
    box = page.locator(canvas).bounding_box()
    page.mouse.move(box["x"] + cols[-1]["x"], box["y"] + rows[-1]["y"])
    page.wait_for_selector("#tip:not([hidden])")
    want = f"{every_r * (len(rows) - 1)},{every_c * (len(cols) - 1)}"
    assert page.get_attribute("#tip", "data-cell") == want
    assert errors == []
    page.close()


# ---------- 3. no download buttons over an empty view ----------


def test_no_downloads_over_an_empty_translation_view(server, browser):
    """MiniLM does not translate: its Translation tab says how to get a translation, and offers
    nothing to download; the other views keep their buttons, and a translator's has them."""
    page, errors, _ = _open(browser, f"{server}/?model=minilm&text={BOY}&view=trans")
    assert STRINGS["en"]["trans.none"] in page.text_content("#view-trans")
    assert page.query_selector("#view-trans .export-bar") is None
    for view in ("step", "head", "model"):
        page.click(f".tab[data-view='{view}']")
        page_ready(page)
        assert page.query_selector(f"#view-{view} .export-bar") is not None, view
    page.select_option("#model", "en-fr")  # a translator: "translate" is ticked
    page_ready(page)
    page.click(".tab[data-view='trans']")
    assert page.query_selector("#view-trans .export-bar") is not None
    assert errors == []
    page.close()


# ---------- 4. numbers: 0.00, never -.00; a minus sign ----------


def test_difference_map_writes_zero_and_minus_signs(server, browser):
    """B − A of two sentences on the random model: values that round to zero are written
    0.00 in their cells (never -.00 or -0.00), negative ones −0.12 (a minus sign), the
    same in the tooltip and the colour scale."""
    url = (f"{server}/?model=random&view=head&compare=text&text=The+boy+trains+the+puppy."
           "&text2=The+boy+trains+the+kitten.")  # fmt: skip
    page, errors, _ = _open(browser, url)
    diff = "#compare-card .cmp-map[data-which='diff'] .hm > canvas"
    page.wait_for_selector(diff)
    cells = [t["text"] for t in _texts(page, diff) if not t["font"].startswith("11px")]
    assert len(cells) == 8 * 8
    assert all(re.fullmatch(r"−?\d\.\d\d", c) for c in cells), cells
    assert "0.00" in cells and not any(re.fullmatch(r"−0\.00", c) for c in cells)
    assert any(c.startswith("−") for c in cells)  # B is lower somewhere
    scale = page.eval_on_selector_all("#compare-card .cmp-map[data-which='diff'] .scale span",
                                      "s => s.map(x => x.textContent)")  # fmt: skip
    assert scale[0].startswith("−") and "-" not in "".join(scale)
    api = page.evaluate(
        "() => [-0.0004, -0.001, -0.12, 0.004].map((v) => [qkvExport.fmt(v), qkvExport.cellText(v)])"
    )
    assert api == [["0.000", "0.00"], ["−0.001", "0.00"], ["−0.120", "−0.12"], ["0.004", "0.00"]]
    page.locator("#compare-card").screenshot(path=str(ARTIFACTS / "details_diff.png"))
    assert errors == []
    page.close()


# ---------- 5. an empty text never leaves the page ----------


@pytest.mark.parametrize("lang", LANGS)
def test_an_empty_text_is_caught_in_the_page(server, browser, lang):
    """Run with an empty (or blank) text: a note in the reader's language (in place of the
    maps, as an error is), no request, no console error. The server still refuses one with a
    JSON 400."""
    page, errors, requests = _open(browser, f"{server}/?model=random&text={BOY}&lang={lang}")
    asked = len(requests)
    for text in ("", "   "):
        page.fill("#text", text)
        page.press("#text", "Enter")
        page.click("#run")
        page_ready(page)
        assert page.text_content("#notice") == STRINGS[lang]["error.emptyText"]
        assert not page.is_hidden("#notice")
    page.wait_for_timeout(300)
    assert len(requests) == asked and errors == []
    assert page.text_content("#view-step") == STRINGS[lang]["error.emptyText"]
    page.fill("#text", BOY)  # and a text again: its maps
    page.press("#text", "Enter")
    page_ready(page)
    assert page.query_selector("#view-step .card[data-key='weights']") is not None
    assert STRINGS[lang]["error.emptyText"] not in page.text_content("#notice")
    assert len(requests) == asked + 1
    if lang == "en":
        _shot(page, "empty")
        body = post_json(server, text="", model="random")
        assert body == {"error": "text must contain at least one non-space character"}
    page.close()


# ---------- 6. every word of the page in the reader's language ----------

# words of the page's interface that a reader of another language must not meet in English
# (technical terms a language keeps, such as "token" or "logit", are not in the list); an
# English term in parentheses after the reader's own word, "ဘီမ် (beam)", is a gloss
UI_WORDS = ["head", "heads", "beam", "greedy", "search", "layer", "layers", "step", "steps",
            "weights", "translation", "translate", "compare", "download", "hypothesis",
            "chosen", "score", "mouse", "pixel", "slider", "decoding", "switch", "probe"]  # fmt: skip
GLOSS = re.compile(r"\([A-Za-z][A-Za-z ,\-]*\)")
NAME = re.compile(r"\b[\w-]+(?:\.[\w-]+)+\b")  # layer and model names: data


def _english_words(text: str) -> list[str]:
    text = NAME.sub(" ", GLOSS.sub(" ", text))
    return sorted({w for w in re.findall(r"[A-Za-z]+", text) if w.lower() in UI_WORDS})


@pytest.mark.parametrize("lang", ["my", "vi", "bn", "zh"])
def test_no_english_ui_word_in_another_language(server, browser, lang):
    """Each view, a beam search, a head switched off, a long text split in pieces and an
    empty text, in ``lang``: not one English UI word ("head", "beam", ...) in what the reader
    sees (tooltips and accessible names included; tokens and translations are data)."""
    page, errors, _ = _open(browser, f"{server}/?model=en-fr&translate=1&text={BOY}&lang={lang}")
    seen: dict[str, list[str]] = {}

    def check(where: str) -> None:
        found = _english_words(page_text(page))
        if found:
            seen[where] = found

    for view in ("step", "head", "model", "trans", "work", "lens"):
        page.click(f".tab[data-view='{view}']")
        page_ready(page)
        if view == "lens":
            page.wait_for_selector("#view-lens[data-state='ready']")
        check(view)
    page.click(".tab[data-view='trans']")
    page.select_option("#beam", "2")
    page_ready(page)
    page.wait_for_selector("#beams")
    check("beam 2")
    page.click(".tab[data-view='work']")
    page.uncheck("input.switch[data-layer='decoder.layers.0.self_attn'][data-head='0']")
    page.click("#ablate-run")
    page_ready(page)
    check("a head off")
    page.click(".tab[data-view='trans']")
    page.fill("#text", LONG)
    page.press("#text", "Enter")
    page_ready(page)
    page.wait_for_selector("#pieces")
    check("pieces")
    page.fill("#text", "")
    page.press("#text", "Enter")
    check("empty text")
    page.fill("#text", BOY)
    page.select_option("#model", "minilm")
    page_ready(page)
    for view in ("step", "head", "model", "trans"):
        page.click(f".tab[data-view='{view}']")
        page_ready(page)
        check(f"minilm {view}")
    if lang in ("my", "vi"):
        _shot(page, f"lang_{lang}")
    assert seen == {}, seen
    assert errors == []
    page.close()


@pytest.mark.parametrize("lang", ["my", "vi"])
def test_downloaded_pictures_are_in_the_readers_language(server, browser, lang):
    """The SVG of the head view (the heads' legend), the model view (its column heads) and the
    probe (its verdict) in ``lang``: no English UI word outside the token labels."""
    import xml.etree.ElementTree as ET

    page, errors, _ = _open(browser, f"{server}/?model=random&lang={lang}&text="
                            "The+animal+didn't+cross+the+street+because+it+was+tired.",
                            downloads=True)  # fmt: skip
    seen = {}
    for view in ("head", "model", "work", "step"):
        page.click(f".tab[data-view='{view}']")
        page_ready(page)
        button = page.locator(f"#view-{view} .export-bar button[data-format='svg']").first
        svg = ET.fromstring(Path(expect_download(page, button).path()).read_bytes())
        words = [t.text or "" for t in svg.iter("{http://www.w3.org/2000/svg}text")
                 if t.get("class") not in ("tok-q", "tok-k")]  # fmt: skip
        found = _english_words("\n".join(words))
        if found:
            seen[view] = found
    assert seen == {}, seen
    assert errors == []
    page.close()
