"""The HTML viewer in a real headless browser (Debian's chromium driven by Playwright)."""

import os
from pathlib import Path

import pytest
import torch

from qkv.inspect import capture, capture_steps
from qkv.inspect.html import render_html, write_html
from qkv.inspect.tiny import TinyEncoder, TinySeq2Seq

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).parent / "artifacts"
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
    assert page.eval_on_selector_all("script", "s => s.length") == 2
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
