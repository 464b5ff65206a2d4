"""The explorer's download buttons in a real browser (Debian's chromium via Playwright): every
view gives SVG (parsed: token labels, one cell per weight), PNG (3× the SVG's pixels), JSON (the
API's numbers for that layer and head) and CSV (key tokens across, a query per row); the same
buttons in ``qkv view``'s offline page and in the notebook view; a 2,048-token text stays
bounded."""

from __future__ import annotations

import csv
import io
import json
import struct
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from serve_helpers import playwright_or_skip

ROOT = Path(__file__).resolve().parents[3]  # the repository (this is tests/apps/serve/)
ARTIFACTS = ROOT / "tests" / "artifacts"
SVG_NS = "{http://www.w3.org/2000/svg}"
TEXT = "The boy trains the puppy."
PRONOUN = "The animal didn't cross the street because it was tired."
HOSTILE = 'The <b>boy</b> & "his" puppy\'s </svg> ]]> dog.'

sync_api = playwright_or_skip()
pytest.importorskip("uvicorn")

from serve_helpers import expect_download, open_page, post_json  # noqa: E402
from serve_helpers import page_ready as _ready  # noqa: E402


def _open(browser, url):
    return open_page(browser, url, downloads=True)[:2]  # (page, errors)


def _download(page, view: str, fmt: str, frame=None) -> tuple[str, bytes]:
    where = frame or page
    d = expect_download(page, where.locator(f"#view-{view} .export-bar button[data-format='{fmt}']"))
    data = Path(d.path()).read_bytes()
    if fmt in ("png", "svg"):  # kept to look at
        ARTIFACTS.mkdir(exist_ok=True)
        (ARTIFACTS / f"download_{view}.{fmt}").write_bytes(data)
    return d.suggested_filename, data


def _svg(data: bytes) -> ET.Element:
    assert data.startswith(b"<?xml")
    return ET.fromstring(data)  # well-formed XML, or this raises


def _texts(root: ET.Element) -> list[str]:
    return [t.text or "" for t in root.iter(f"{SVG_NS}text")]


def _cells(root: ET.Element, key: str = "weights") -> list[ET.Element]:
    """The rects of the cells of the matrix ``key`` (one per entry)."""
    (g,) = [g for g in root.iter(f"{SVG_NS}g") if g.get("data-key") == key]
    (cells,) = [c for c in g.iter(f"{SVG_NS}g") if c.get("class") == "cells"]
    return list(cells.iter(f"{SVG_NS}rect"))


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert data[37:41] == b"pHYs"  # the print resolution, right after IHDR
    return struct.unpack(">II", data[16:24])


def _layer(resp: dict, name: str) -> dict:
    return next(x for x in resp["layers"] if x["name"] == name)


def _check_data(fmt_json: bytes, fmt_csv: bytes, resp: dict) -> dict:
    """JSON: the API's numbers for its layer and head; CSV: the same matrix, labelled."""
    got = json.loads(fmt_json)
    lay = _layer(resp, got["layer"])
    want = lay["weights"][lay["heads"].index(got["head"])]
    assert got["weights"] == want  # exactly, not approximately
    assert got["q_tokens"] == lay["q_tokens"] and got["k_tokens"] == lay["k_tokens"]
    assert got["tokens"] == resp["tokens"] and got["model"] == resp["model"]
    rows = list(csv.reader(io.StringIO(fmt_csv.decode("utf-8"), newline="")))
    assert rows[0] == ["query \\ key", *lay["k_tokens"]]
    assert [r[0] for r in rows[1:]] == lay["q_tokens"]
    assert [[float(v) for v in r[1:]] for r in rows[1:]] == want
    return got


def test_every_view_downloads_svg_png_json_csv(server, browser):
    page, errors = _open(browser, f"{server}/?model=random&text={TEXT}")
    page.select_option("#layer", "encoder.layers.1.self_attn")
    _ready(page)
    page.select_option("#head", "2")
    _ready(page)
    resp = post_json(server, text=TEXT, model="random", layer="encoder.layers.1.self_attn", head=2)
    lay = _layer(resp, "encoder.layers.1.self_attn")
    T = len(lay["q_tokens"])
    for view in ("step", "head", "model", "work"):
        page.click(f".tab[data-view='{view}']")
        _ready(page)
        assert page.locator(f"#view-{view} .export-bar button").all_text_contents() == [
            "SVG", "PNG", "JSON", "CSV"]  # fmt: skip
        if view == "step":
            _shot(page, "export_step")
        files = {fmt: _download(page, view, fmt) for fmt in ("svg", "png", "json", "csv")}
        for fmt, (name, _) in files.items():
            assert name == f"qkv_random_encoder.layers.1.self_attn_h2_{view}.{fmt}"
        got = _check_data(files["json"][1], files["csv"][1], resp)
        assert (got["view"], got["layer"], got["head"]) == (view, lay["name"], 2)
        svg = _svg(files["svg"][1])
        texts = _texts(svg)
        W, H = int(svg.get("width")), int(svg.get("height"))
        assert _png_size(files["png"][1]) == (3 * W, 3 * H)  # print resolution
        if view == "step":  # every card of the screen, the weights one cell per weight
            assert [m["key"] for m in got["shown"]["step"]["matrices"]][-4:] == [
                "weights", "output", "concat", "wo"]  # fmt: skip
            assert len(_cells(svg)) == T * T
            assert all(t in texts for t in lay["q_tokens"])
        elif view == "head":  # a line per nonzero weight of the heads on
            lines = list(svg.iter(f"{SVG_NS}line"))
            assert len(lines) == sum(v > 0 for r in lay["weights"][2] for v in r)
            left = [t.text for t in svg.iter(f"{SVG_NS}text") if t.get("class") == "tok-q"]
            assert left == lay["q_tokens"]
        elif view == "model":  # a thumbnail per layer × head, the tokens under them
            thumbs = [g for g in svg.iter(f"{SVG_NS}g") if g.get("class") == "thumb"]
            assert len(thumbs) == 2 * 4 and len(got["shown"]["layers"]) == 2
            assert all(tok in " ".join(texts) for tok in lay["q_tokens"])
        else:  # the probe's table as a map, and the selected head's map
            assert len(_cells(svg)) == T * T
    _shot(page, "export_work")
    page.fill("#text", PRONOUN)  # the probe answers: its table becomes a map in the picture
    page.press("#text", "Enter")
    _ready(page)
    files = {fmt: _download(page, "work", fmt) for fmt in ("svg", "json")}
    resp = post_json(server, text=PRONOUN, model="random", layer="encoder.layers.1.self_attn", head=2,
                 probe={"token": "it", "candidates": ["animal", "street"]})  # fmt: skip
    got = json.loads(files["json"][1])
    assert got["shown"]["probe"] == resp["probe"] and resp["probe"]["rows"]
    assert len(_cells(_svg(files["svg"][1]), "probe")) == 2 * len(resp["probe"]["rows"])
    page.click(".tab[data-view='head']")
    _ready(page)
    _shot(page, "export_head")
    page.select_option("#lang", "my")  # the buttons' words come from strings.json
    label = page.text_content("#view-head .export-label")
    strings = json.loads(
        (ROOT / "src/qkv/apps/serve/static/i18n/strings.json").read_text()
    )
    assert label == strings["my"]["export.download"]
    assert page.get_attribute("#view-head button[data-format='csv']", "title") == strings["my"][
        "export.csv"]  # fmt: skip
    _shot(page, "export_head_my")
    assert errors == []
    page.close()


def test_translation_view_exports_the_cross_attention_shown(server, browser):
    page, errors = _open(browser, f"{server}/?model=tiny-fr&translate=1"
                                  "&text=the%20boy%20trains%20the%20puppy&view=trans")  # fmt: skip
    page.fill("#step-slider", "1")
    page.dispatch_event("#step-slider", "input")
    files = {fmt: _download(page, "trans", fmt) for fmt in ("svg", "json", "csv")}
    resp = post_json(server, text="the boy trains the puppy", model="tiny-fr", translate=True)
    got = _check_data(files["json"][1], files["csv"][1], resp)
    assert got["kind"] == "cross" and got["shown"]["step"] == 1
    assert got["q_tokens"] == resp["translation"]["target_tokens"]
    dec = got["shown"]["decoder_self"]
    assert len(dec["weights"]) == 2 and dec["query"] == resp["translation"]["decoder_inputs"][1]
    assert files["json"][0].endswith(f"_{got['layer']}_h{got['head']}_trans.json")
    svg = _svg(files["svg"][1])
    assert len(_cells(svg)) == len(got["q_tokens"]) * len(got["k_tokens"])
    dimmed = [r for r in _cells(svg) if r.get("fill-opacity") == "0.15"]  # rows not yet written
    assert len(dimmed) == (len(got["q_tokens"]) - 2) * len(got["k_tokens"])
    assert f"the boy trains the puppy → {resp['translation']['text']}" in _texts(svg)
    _shot(page, "export_trans")
    assert errors == []
    page.close()


def test_hostile_tokens_are_escaped_in_the_svg(server, browser):
    page, errors = _open(browser, f"{server}/?model=random")
    page.fill("#text", HOSTILE)
    page.press("#text", "Enter")
    _ready(page)
    for view in ("step", "head"):
        page.click(f".tab[data-view='{view}']")
        _ready(page)
        svg = _svg(_download(page, view, "svg")[1])  # parses: every token escaped
        labels = [t.text for t in svg.iter(f"{SVG_NS}text") if t.get("class") == "tok-q"]
        assert {"<", ">", "&", '"', "'", "/", "svg", "]"} <= set(labels)
    _, data = _download(page, "head", "csv")
    rows = list(csv.reader(io.StringIO(data.decode("utf-8"), newline="")))
    assert '"' in rows[0] and "&" in rows[0]
    assert page.eval_on_selector_all("svg, img, iframe", "x => x.length") == 0
    assert errors == []
    page.close()


def test_csv_labels_cannot_run_as_formulas(server, browser):
    """A token label starting with = + - @ gets a leading quote in the CSV (OWASP: CSV
    injection); the numbers are left as they are."""
    text = "=1+2 @x -y"
    page, errors = _open(browser, f"{server}/?model=random")
    page.fill("#text", text)
    page.press("#text", "Enter")
    _ready(page)
    resp = post_json(server, text=text, model="random")
    toks = resp["layers"][0]["k_tokens"]
    assert {"=", "+", "@", "-"} <= set(toks)
    _, data = _download(page, "step", "csv")
    rows = list(csv.reader(io.StringIO(data.decode("utf-8"), newline="")))
    safe = ["'" + x if x[0] in "=+-@" else x for x in toks]
    assert rows[0] == ["query \\ key", *safe] and [r[0] for r in rows[1:]] == safe
    assert [[float(v) for v in r[1:]] for r in rows[1:]] == resp["layers"][0]["weights"][0]
    assert errors == []
    page.close()


def test_qkv_view_page_and_notebook_have_the_buttons(browser, tmp_path):
    from qkv.apps.cli import main
    from qkv.inspect import capture
    from qkv.inspect.tiny import TinyEncoder

    out = tmp_path / "view.html"
    assert main(["view", TEXT, "--model", "random", "--out", str(out)]) == 0
    resp = json.loads(out.read_text().split('id="qkv-data">')[1].split("</script>")[0])["response"]
    page, errors = _open(browser, out.as_uri())  # file://, offline, the page's strict CSP
    for view in ("step", "head", "model"):
        page.click(f".tab[data-view='{view}']")
        files = {fmt: _download(page, view, fmt) for fmt in ("svg", "png", "json", "csv")}
        _check_data(files["json"][1], files["csv"][1], resp)
        _svg(files["svg"][1])
        _png_size(files["png"][1])
    _shot(page, "export_offline")
    assert errors == []
    page.close()

    enc = TinyEncoder()
    toks, ids = enc.tokenize("The animal didn't cross the street because it was tired .")
    maps = capture(enc, ids, tokens=toks)
    nb = tmp_path / "nb.html"
    nb.write_text(f"<!DOCTYPE html><html><body>{maps._repr_html_()}</body></html>")
    page = browser.new_page(viewport={"width": 1280, "height": 800}, accept_downloads=True)
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(nb.as_uri())
    frame = page.frame_locator("iframe")
    frame.locator("body[data-ready='1']").wait_for()
    name, data = _download(page, "step", "csv", frame)
    rows = list(csv.reader(io.StringIO(data.decode("utf-8"), newline="")))
    assert rows[0][1:] == toks and [r[0] for r in rows[1:]] == toks
    got = torch.tensor([[float(v) for v in r[1:]] for r in rows[1:]])
    assert torch.allclose(got, maps.weights[0][0], atol=6e-4)  # rounded to 3 decimals
    name, data = _download(page, "step", "png", frame)
    _png_size(data)
    assert errors == []
    page.close()


def _shot(page, name):
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"))


# last: its 2,048-token page is the heaviest this browser draws
def test_a_2048_token_text_gives_bounded_files(server, browser):
    words = " ".join(f"w{i % 50}" for i in range(2048))
    resp = post_json(server, text=words, model="random")
    # cut to 2,048 tokens and answered long: every map pooled (qkv.apps.serve.long)
    assert resp["truncated"] and len(resp["tokens"]) == resp["limit"] == 2048
    page, errors = _open(browser, f"{server}/?model=random")
    page.fill("#text", words)
    page.press("#text", "Enter")
    _ready(page)
    sizes = {}
    for view in ("step", "model"):
        page.click(f".tab[data-view='{view}']")
        _ready(page)
        for fmt in ("svg", "png", "json", "csv"):
            name, data = _download(page, view, fmt)
            sizes[name] = len(data)
            if fmt == "json":
                got = json.loads(data)
                assert got["truncated"] and len(got["tokens"]) == resp["limit"]
                assert "cut" in got["notice"]
                # the map as the API sent it: pooled to 128 × 128, a label per block
                assert len(got["weights"]) == len(got["q_tokens"]) == 128
    print("\n" + "\n".join(f"{n}: {s / 1e6:.2f} MB" for n, s in sizes.items()))
    assert max(sizes.values()) < 16_000_000
    assert all(s < 2_000_000 for n, s in sizes.items() if n.endswith((".csv", "step.json")))
    assert errors == []
    page.close()
