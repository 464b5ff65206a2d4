"""One head's map as SVG/JSON/CSV (``qkv.capture.export``, ``AttentionMaps.to_*``, ``qkv view
--svg/--json/--csv``): the numbers kept, tokens escaped, sizes bounded; token labels on the
matplotlib pictures; readable piece labels (no ``##.``) on the tour's alignment picture."""

from __future__ import annotations

import csv
import io
import json
import xml.etree.ElementTree as ET

import pytest
import torch

from qkv.apps.cli import main
from qkv.capture.export import (
    MAX_EXPORT_TOKENS,
    PICTURE_MAX_SIDE,
    ExportTooLarge,
    HeadMap,
    head_map,
    to_csv,
    to_svg,
    xml_text,
)
from qkv.inspect import AttentionMaps
from qkv.inspect.plot import MAX_LABELS, plot_alignment, plot_grid, plot_head

SVG = "{http://www.w3.org/2000/svg}"
HOSTILE = ["<script>", "a&b", '"q"', "it's", "x,y", " sp ", "]]>", "\x00\x1b", "\ud800", "é漢"]


def _maps(tokens: list[str], heads: int = 2, layers: int = 2) -> AttentionMaps:
    T = len(tokens)
    torch.manual_seed(0)
    ws = [torch.softmax(torch.randn(heads, T, T), -1) for _ in range(layers)]
    return AttentionMaps(ws, [f"enc.{i}" for i in range(layers)], ["self"] * layers,
                         [list(range(heads))] * layers, [tokens] * layers, [tokens] * layers)  # fmt: skip


def _cells(root: ET.Element) -> list[ET.Element]:
    (g,) = [g for g in root.iter(f"{SVG}g") if g.get("class") == "cells"]
    return list(g.iter(f"{SVG}rect"))


def _labels(root: ET.Element, cls: str) -> list[str]:
    return [t.text or "" for t in root.iter(f"{SVG}text") if t.get("class") == cls]


def test_json_csv_svg_keep_the_numbers_and_escape_tokens():
    maps = _maps(HOSTILE)
    w = maps.select("enc.1", 1)
    hm = head_map(maps, "enc.1", 1)
    data = json.loads(maps.to_json("enc.1", 1))
    assert (data["layer"], data["kind"], data["head"]) == ("enc.1", "self", 1)
    assert data["q_tokens"] == data["k_tokens"] == HOSTILE
    assert data["weights"] == hm.weights
    assert torch.allclose(torch.tensor(data["weights"]), w, atol=5e-5)
    rows = list(csv.reader(io.StringIO(maps.to_csv("enc.1", 1), newline="")))
    assert rows[0] == ["query \\ key", *HOSTILE] and [r[0] for r in rows[1:]] == HOSTILE
    assert [[float(v) for v in r[1:]] for r in rows[1:]] == hm.weights
    root = ET.fromstring(maps.to_svg("enc.1", 1).encode("utf-8", "surrogatepass"))  # parses
    assert len(_cells(root)) == len(HOSTILE) ** 2
    shown = [xml_text(t).replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
             .replace("&quot;", '"').replace("&#39;", "'") for t in HOSTILE]  # fmt: skip
    assert _labels(root, "tok-q") == shown and _labels(root, "tok-k") == shown
    assert shown[7] == "\ufffd\ufffd" and shown[8] == "\ufffd"  # no XML-illegal characters
    assert to_csv(hm) == maps.to_csv("enc.1", 1) and to_svg(hm) == maps.to_svg("enc.1", 1)


def test_csv_text_cells_cannot_start_a_formula():
    """OWASP's CSV injection: a token label starting with = + - @ tab or CR gets a leading
    quote, so a spreadsheet shows it as text; numbers (negative ones too) stay numbers."""
    toks = ["=SUM(A1)", "+1", "-", "@x", "\tcmd", "\rx", "a=b", "'q"]
    T = len(toks)
    w = [[-0.5 if i == j else 0.25 for j in range(T)] for i in range(T)]  # a difference map
    hm = HeadMap("enc.0", "self", 0, toks, toks, w)
    rows = list(csv.reader(io.StringIO(to_csv(hm), newline="")))
    safe = ["'=SUM(A1)", "'+1", "'-", "'@x", "'\tcmd", "'\rx", "a=b", "'q"]
    assert rows[0] == ["query \\ key", *safe] and [r[0] for r in rows[1:]] == safe
    assert [[float(v) for v in r[1:]] for r in rows[1:]] == w  # numbers as they were
    assert rows[1][1] == "-0.5"
    maps = _maps(toks)
    assert list(csv.reader(io.StringIO(maps.to_csv(), newline="")))[0][1:] == safe


def test_sizes_are_bounded():
    # above PICTURE_MAX_SIDE a picture draws block means, and says so
    n = 300
    maps = _maps([f"t{i}" for i in range(n)], heads=1, layers=1)
    svg = maps.to_svg()
    root = ET.fromstring(svg)
    k = -(-n // PICTURE_MAX_SIDE)
    assert len(_cells(root)) == (-(-n // k)) ** 2 and "mean of 3×3 weights" in svg
    assert json.loads(maps.to_json())["picture"]["block"] == k
    assert len(maps.to_csv()) < 3_000_000
    # a 2,048-token map is refused, with the limit and what to do
    big = AttentionMaps([torch.full((1, 2048, 2048), 1 / 2048)], ["l"], ["self"], [[0]],
                        [["w"] * 2048], [["w"] * 2048])  # fmt: skip
    for method in (big.to_json, big.to_csv, big.to_svg):
        with pytest.raises(ExportTooLarge, match=f"at most {MAX_EXPORT_TOKENS} tokens per side"):
            method()
    with pytest.raises(KeyError, match="head 5"):
        head_map(big, 0, 5)


def test_qkv_view_writes_svg_json_csv(tmp_path, capsys):
    out = {fmt: tmp_path / f"h.{fmt}" for fmt in ("svg", "json", "csv")}
    text = 'The boy <b>trains</b> "the" puppy & co.'
    args = ["view", text, "--model", "random", "--out", str(tmp_path / "v.html"),
            "--layer", "1", "--head", "2"]  # fmt: skip
    assert main(args + [a for f, p in out.items() for a in (f"--{f}", str(p))]) == 0
    page = (tmp_path / "v.html").read_text()
    resp = json.loads(page.split('id="qkv-data">')[1].split("</script>")[0])["response"]
    lay = resp["layers"][1]
    got = json.loads(out["json"].read_text())
    assert (got["layer"], got["head"], got["model"]) == (lay["name"], 2, "random")
    assert got["weights"] == lay["weights"][2] and got["tokens"] == resp["tokens"]
    rows = list(csv.reader(io.StringIO(out["csv"].read_text(), newline="")))
    assert rows[0][1:] == lay["k_tokens"] and len(rows) == 1 + len(lay["q_tokens"])
    root = ET.fromstring(out["svg"].read_bytes())
    assert len(_cells(root)) == len(lay["q_tokens"]) * len(lay["k_tokens"])
    assert _labels(root, "tok-q") == lay["q_tokens"] and "<" in _labels(root, "tok-k")
    assert "SVG of encoder.layers.1.self_attn head 2 written" in capsys.readouterr().out
    # default: the page's first selection; a 2,048-token text is cut to the page's limit
    words = " ".join(f"w{i % 50}" for i in range(2048))
    assert main(["view", words, "--out", str(tmp_path / "b.html"), "--json", str(out["json"]),
                 "--csv", str(out["csv"]), "--svg", str(out["svg"])]) == 0  # fmt: skip
    got = json.loads(out["json"].read_text())
    assert got["layer"] == "encoder.layers.0.self_attn" and got["head"] == 0
    assert got["truncated"] and len(got["q_tokens"]) == 128
    sizes = {f: p.stat().st_size for f, p in out.items()}
    assert sizes["json"] < 500_000 and sizes["csv"] < 500_000 and sizes["svg"] < 2_000_000
    # bad choices: one line, nothing written
    capsys.readouterr()
    for extra in (["--layer", "9", "--svg", str(tmp_path / "x.svg")],
                  ["--layer", "nope", "--csv", str(tmp_path / "x.csv")],
                  ["--head", "7", "--json", str(tmp_path / "x.json")],
                  ["--head", "1"], ["--svg", str(tmp_path / "x.png")]):  # fmt: skip
        assert main(["view", "x", "--out", str(tmp_path / "x.html"), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("qkv view: error:"), err
    assert not list(tmp_path.glob("x.*"))


def _ticks(ax, axis: str) -> list[str]:
    labels = ax.get_xticklabels() if axis == "x" else ax.get_yticklabels()
    return [t.get_text() for t in labels]


def test_pictures_label_rows_and_columns_with_tokens():
    toks = ["The", "boy", "$x$", "trains", "the", "puppy", "."]
    maps = _maps(toks)
    fig = plot_grid(maps)
    axes = [a for a in fig.axes if a.get_images()]
    assert len(axes) == 2 * 2
    first_col = [a for a in axes if _ticks(a, "y")]
    assert len(first_col) == 2 and all(_ticks(a, "y") == toks for a in first_col)
    bottom = [a for a in axes if _ticks(a, "x")]  # shared keys: under the bottom row
    assert len(bottom) == 2 and all(_ticks(a, "x") == toks for a in bottom)
    ax = plot_head(maps, "enc.0", 1).axes[0]
    assert _ticks(ax, "x") == toks and _ticks(ax, "y") == toks
    # long inputs: every n-th token, at most MAX_LABELS per axis, still the right ones
    long = [f"w{i}" for i in range(150)]
    big = _maps(long, heads=1, layers=1)
    step = -(-150 // MAX_LABELS)
    ax = [a for a in plot_grid(big).axes if a.get_images()][0]
    assert _ticks(ax, "y") == long[::step] and list(ax.get_yticks()) == list(range(0, 150, step))
    ax = plot_head(big, 0, 0).axes[0]
    assert _ticks(ax, "x") == long[::step] and len(_ticks(ax, "x")) <= MAX_LABELS


def test_grid_of_a_translation_labels_each_layer():
    from qkv.inspect import capture
    from qkv.inspect.tiny import TinySeq2Seq

    src_t = ["The", "boy", "trains", "the", "puppy", "."]
    tgt_t = ["<s>", "Le", "garçon", "entraîne", "le", "chiot"]
    maps = capture(TinySeq2Seq(n_heads=2), torch.arange(5, 11)[None], torch.arange(3, 9)[None],
                   tokens=tgt_t, source_tokens=src_t)  # fmt: skip
    fig = plot_grid(maps)
    rows = [a for a in fig.axes if a.get_images() and _ticks(a, "y")]
    assert len(rows) == len(maps)  # keys differ by layer: each layer's first map has both axes
    for i, ax in enumerate(rows):
        assert _ticks(ax, "y") == maps.q_tokens[i] and _ticks(ax, "x") == maps.k_tokens[i]


def test_tour_alignment_shows_punctuation_not_continuation_marks():
    pytest.importorskip("tokenizers")
    from qkv.capture.maps import merge_steps
    from qkv.inspect.translation import piece_labels, record_translation
    from qkv.translate import load

    tr = load("en-fr")
    rec = record_translation(tr.model, tr.tokenizer, "The boy trains the puppy.", beam=tr.beam,
                             length_penalty=tr.length_penalty)  # fmt: skip
    ax = plot_alignment(merge_steps(rec.steps)).axes[0]  # the tour's translation-alignment.png
    assert _ticks(ax, "x") == ["The", "boy", "trains", "the", "puppy", ".", "</s>"]
    assert _ticks(ax, "y")[-2:] == [".", "</s>"]
    assert not any(t.startswith("##") and not t[2:].isalnum() for t in _ticks(ax, "y"))
    ids = tr.tokenizer.encode("dit: « bonjour », 3.5 km")
    assert piece_labels(tr.tokenizer, ids) == [
        "dit", ":", "␣", "«", "(«)", "bon", "##j", "##our", "␣", "»", "(»)", ",", "3", ".",
        "##5", "k", "##m"]  # fmt: skip
