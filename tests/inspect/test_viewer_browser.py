"""The HTML viewer in a real headless browser (Debian's chromium driven by Playwright)."""

import csv
import io
import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from qkv.inspect import capture, capture_steps
from qkv.inspect.html import render_html, write_html
from qkv.inspect.tiny import TinyEncoder, TinySeq2Seq

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"  # tests/artifacts
XSS = "<script>alert(1)</script>"

if not os.path.exists(CHROMIUM):
    if os.environ.get("CI") == "true":
        raise RuntimeError(f"{CHROMIUM} missing in CI: run scripts/setup-system.sh")
    pytest.skip(
        f"{CHROMIUM} not installed (scripts/setup-system.sh installs it)", allow_module_level=True
    )
sync_api = pytest.importorskip("playwright.sync_api")


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        yield b
        b.close()


def _open(browser, path):
    page = browser.new_page(viewport={"width": 1100, "height": 800})
    errors, dialogs = [], []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.goto(path.as_uri())
    page.wait_for_selector("body[data-ready='1']")
    return page, errors, dialogs


def test_head_view_lines_hover_and_xss(browser, tmp_path):
    enc = TinyEncoder(d_model=24, n_heads=3, n_layers=2)
    words = "The animal didn't cross the street because it was tired ."
    toks, ids = enc.tokenize(words)
    toks[5] = XSS  # a hostile token: must show as text
    maps = capture(enc, ids, tokens=toks)
    path = write_html(maps, tmp_path / "page.html", title="test </script><b>x</b>")
    page, errors, dialogs = _open(browser, path)

    page.select_option("#layer", "1")
    for h in (0, 2):  # keep head 1 only
        page.uncheck(f"input.head-toggle[data-head='{h}']")
    lines = page.eval_on_selector_all(
        "#head-view line.attn",
        "ls => ls.map(l => [+l.dataset.layer, +l.dataset.head, +l.dataset.q, +l.dataset.k,"
        " +l.getAttribute('stroke-opacity'), l.getAttribute('visibility')])",
    )
    w = maps.weights[1][1]  # layer 1, head 1: (T, T)
    assert {(ly, h) for ly, h, *_ in lines} == {(1, 1)}
    assert len(lines) == int((w.round(decimals=4) > 0).sum())
    for _, _, q, k, op, vis in lines:
        assert op == pytest.approx(float(w[q, k]), abs=1e-4) and vis == "visible"

    it = toks.index("it")
    page.hover(f"#head-view text.tok-q[data-i='{it}']")
    shown = page.eval_on_selector_all(
        "#head-view line.attn[visibility='visible']", "ls => ls.map(l => +l.dataset.q)"
    )
    assert set(shown) == {it} and len(shown) == int((w[it].round(decimals=4) > 0).sum())

    # XSS token is on screen as text, no element was injected, no alert fired
    labels = page.eval_on_selector_all("#head-view text.tok-q", "ts => ts.map(t => t.textContent)")
    assert labels[5] == XSS
    assert page.eval_on_selector_all("script", "s => s.length") == 3  # data, export.js, the viewer
    assert page.title() == "test </script><b>x</b>"
    # side panel: one row per head of the selected layer
    assert page.eval_on_selector_all("#stats tbody tr", "r => r.length") == 3
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "viewer_head.png"), full_page=True)
    assert dialogs == [] and errors == []
    page.close()


def test_model_view_alignment_and_steps(browser, tmp_path):
    model = TinySeq2Seq(n_heads=2)
    src_t = ["The", "boy", "trains", "the", "puppy", "."]
    src = torch.arange(5, 11)[None]
    steps = capture_steps(
        model,
        src,
        run=model.greedy,
        max_len=4,
        source_tokens=src_t,
        tokens=["<s>", "a", "b", "c", "d"],
    )
    path = write_html(None, tmp_path / "s2s.html", steps=steps)
    page, errors, dialogs = _open(browser, path)
    page.click("#tab-model")
    thumbs = page.eval_on_selector_all("canvas.thumb", "cs => cs.length")
    assert thumbs == 6 * 2
    page.click("canvas.thumb[data-layer='3'][data-head='1']")  # decoder.layers.0.cross_attn
    heads = page.eval_on_selector_all(
        "#head-view line.attn", "ls => [...new Set(ls.map(l => l.dataset.head))]"
    )
    assert heads == ["1"]
    page.click("#tab-align")
    cells = page.eval_on_selector_all(
        "#align-view rect.cell",
        "rs => rs.map(r => [+r.dataset.q, +r.dataset.k, +r.getAttribute('fill-opacity')])",
    )
    assert page.input_value("#layer") == "3"
    ticks = page.eval_on_selector_all("#align-view text.tok-k", "ts => ts.map(t => t.textContent)")
    assert ticks == src_t
    from qkv.inspect import merge_steps

    whole = merge_steps(steps)
    w = whole.select("decoder.layers.0.cross_attn", 1)
    assert len(cells) == w.numel()
    for q, k, op in cells:
        assert op == pytest.approx(float(w[q, k]), abs=1e-4)
    # decoding steps: step 2 of decoder.layers.0.self_attn has one query over 3 keys
    page.select_option("#step", "3")
    page.select_option("#layer", "0")
    page.click("#tab-head")
    qs = page.eval_on_selector_all("#head-view text.tok-q", "ts => ts.map(t => t.textContent)")
    ks = page.eval_on_selector_all("#head-view text.tok-k", "ts => ts.map(t => t.textContent)")
    assert qs == ["b"] and ks == ["<s>", "a", "b"]
    assert page.is_visible("#head-view") and page.is_hidden("#model-view")
    assert page.is_hidden("#align-view")
    page.screenshot(path=str(ARTIFACTS / "viewer_steps.png"), full_page=True)
    assert dialogs == [] and errors == []
    page.close()


def test_script_close_in_tokens_cannot_break_out():
    from qkv.inspect import AttentionMaps

    toks = ["</script>", "<!--", "a&b", "\u2028"]
    m = AttentionMaps([torch.full((1, 4, 4), 0.25)], ["l"], ["self"], [[0]], [toks], [toks])
    page = render_html(m)
    body = page.split('id="qkv-data">')[1].split("</script>")[0]
    assert "<" not in body and ">" not in body and "&" not in body and "\u2028" not in body


def _download(page, fmt: str) -> tuple[str, bytes]:
    with page.expect_download() as info:
        page.click(f"#downloads .export-bar button[data-format='{fmt}']")
    return info.value.suggested_filename, Path(info.value.path()).read_bytes()


def test_the_page_has_the_explorers_downloads(browser, tmp_path):
    """The tour's page (``write_html``) downloads SVG/PNG/JSON/CSV with the explorer's export.js:
    the head view's heads, the model view's grid, the alignment view's mean of the heads ticked."""
    enc = TinyEncoder(d_model=24, n_heads=3, n_layers=2)
    toks, ids = enc.tokenize("The animal didn't cross the street because it was tired .")
    toks[2] = "=cmd|' /C calc'!A0"  # a formula-like token: text in the CSV
    maps = capture(enc, ids, tokens=toks)
    path = write_html(maps, tmp_path / "page.html")
    page = browser.new_page(viewport={"width": 1100, "height": 800}, accept_downloads=True)
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.as_uri())
    page.wait_for_selector("body[data-ready='1']")
    page.select_option("#layer", "1")
    page.uncheck("input.head-toggle[data-head='1']")  # heads 0 and 2 on
    assert page.locator("#downloads .export-bar button").all_text_contents() == [
        "SVG", "PNG", "JSON", "CSV"]  # fmt: skip
    on_screen = json.loads(page.text_content("#qkv-data"))["views"][0]["layers"][1]
    name, data = _download(page, "json")
    got = json.loads(data)
    assert name == f"qkv_page_{maps.layers[1]}_h0_head.json"
    assert (got["layer"], got["head"], got["view"]) == (maps.layers[1], 0, "head")
    assert got["weights"] == on_screen["weights"][0]  # the page's numbers, exactly
    assert [h["head"] for h in got["shown"]["heads_on"]] == [0, 2]
    _, svg = _download(page, "svg")
    lines = list(ET.fromstring(svg).iter("{http://www.w3.org/2000/svg}line"))
    assert len(lines) == sum(v > 0 for h in (0, 2) for r in on_screen["weights"][h] for v in r)
    _, png = _download(page, "png")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    # the screen's lines have the files' head colours
    colours = page.eval_on_selector_all(
        "#head-view line.attn", "ls => [...new Set(ls.map(l => l.getAttribute('stroke')))]"
    )
    assert colours == ["#2557c7", "#2b8a3e"]  # export.js HEAD_COLORS[0], [2]
    _, data = _download(page, "csv")
    rows = list(csv.reader(io.StringIO(data.decode(), newline="")))
    assert rows[0][3] == "'" + toks[2] and rows[3][0] == "'" + toks[2]  # no formula
    assert [[float(v) for v in r[1:]] for r in rows[1:]] == on_screen["weights"][0]

    page.click("#tab-align")  # the matrix drawn: the mean of heads 0 and 2
    name, data = _download(page, "json")
    got = json.loads(data)
    assert got["head"] == "0+2" and got["view"] == "align"
    w = on_screen["weights"]
    want = [(a + b) / 2 for r0, r2 in zip(w[0], w[2]) for a, b in zip(r0, r2)]
    assert len(got["weights"]) == len(w[0])
    assert [v for r in got["weights"] for v in r] == pytest.approx(want, abs=6e-5)  # 4 decimals
    cells = page.eval_on_selector_all("#align-view rect.cell", "rs => rs.map(r => +r.dataset.w)")
    assert cells == pytest.approx(want, abs=1e-9)  # the screen draws the same mean
    page.click("#tab-model")
    _, svg = _download(page, "svg")
    svg_groups = ET.fromstring(svg).iter("{http://www.w3.org/2000/svg}g")
    thumbs = [g for g in svg_groups if g.get("class") == "thumb"]
    assert len(thumbs) == 2 * 3
    page.screenshot(path=str(ARTIFACTS / "viewer_downloads.png"))
    assert errors == []
    page.close()
