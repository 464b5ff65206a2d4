"""qkv explain (the notes' walk) and the view/heads commands, end to end."""

import json

import pytest
import torch
import torch.nn.functional as F

from qkv.apps.cli import main
from qkv.apps.explain import render_html, render_markdown
from qkv.apps.walk import walk_steps


def _sdpa_weights(q, k, mask=None):
    """PyTorch's SDPA with V = identity returns the attention weights themselves."""
    eye = torch.eye(k.shape[-2]).expand(*k.shape[:-1], k.shape[-2])
    return F.scaled_dot_product_attention(q, k, eye, attn_mask=mask)


def test_cross_and_causal_walk_match_pytorch():
    w = walk_steps("Le garçon dort", source="The boy sleeps here .", d_model=8, n_heads=2)
    t = w.tensors
    assert t["weights"].shape == (1, 2, 3, 5) and w.same
    torch.testing.assert_close(t["weights"], _sdpa_weights(t["q"], t["k"]), atol=1e-6, rtol=1e-5)
    w = walk_steps("a b c d", causal=True, d_model=12, n_heads=3)
    t = w.tensors
    want = _sdpa_weights(t["q"], t["k"], torch.ones(4, 4, dtype=torch.bool).tril())
    torch.testing.assert_close(t["weights"], want, atol=1e-6, rtol=1e-5)
    titles = [s.title for s in w.steps]
    assert any("causal mask" in x for x in titles) and titles[-1].startswith("10.")


def test_markdown_and_html_renderings(tmp_path):
    w = walk_steps("the <b>cat</b> sat", causal=True)
    md = render_markdown(w)
    for step in (
        "token embeddings",
        "positional",
        "Q = x W_Q",
        "scores",
        "scaled by",
        "causal mask",
        "softmax",
        "weighted sum",
        "concatenated",
        "W_O",
    ):
        assert step in md
    assert "| < |" in md and "-inf" in md and "**True**" in md  # "<" is a token of its own
    page = render_html(w)
    assert "<b>cat</b>" not in page and "&lt;b&gt;cat&lt;/b&gt;" in page
    assert "<th>&lt;</th>" in page and "<th><</th>" not in page
    assert (
        main(
            [
                "explain",
                "--text",
                "a b",
                "--cross",
                "--source",
                "x y z",
                "--out",
                str(tmp_path / "w.html"),
            ]
        )
        == 0
    )
    assert "cross-attention" in (tmp_path / "w.html").read_text()


def test_explain_terminal(capsys):
    assert main(["explain", "--text", "a b c", "--heads", "2", "--d-model", "4"]) == 0
    out = capsys.readouterr().out
    assert "3×3 = 9 scores per head" in out and "equals MultiHeadAttention.forward: True" in out


def _page_data(page) -> dict:
    """The response a `qkv view` page embeds (its explorer's data)."""
    return json.loads(page.read_text().split('id="qkv-data">')[1].split("</script>")[0])


def test_view_writes_the_page_and_png(tmp_path):
    page, png = tmp_path / "a.html", tmp_path / "a.png"
    args = ["view", "The boy trains the puppy.", "--model", "random", "--out", str(page)]
    assert main([*args, "--png", str(png)]) == 0
    assert png.stat().st_size > 1000
    assert _page_data(page)["response"]["layers"][0]["q_tokens"][1] == "The"


def test_view_translate_writes_the_alignment(tmp_path):
    page = tmp_path / "t.html"
    args = ["view", "--translate", "The boy trains the puppy.", "--out", str(page)]
    assert main([*args, "--png", str(tmp_path / "t.svg")]) == 0
    assert (tmp_path / "t-alignment.svg").exists()
    resp = _page_data(page)["response"]
    assert resp["translation"]["steps"] > 1 and "cross" in {x["kind"] for x in resp["layers"]}


@pytest.mark.parametrize(
    ("ablate", "expected"),
    [(["--top", "3"], "one head off at a time"), (["1:0,2"], "off (Δ")],
    ids=["each-head-off", "chosen-heads-off"],
)
def test_heads_probe_and_ablation(capsys, ablate, expected):
    sent = "The animal didn't cross the street because it was tired."
    args = ["heads", sent, "--token", "it", "--candidates", "animal", "street", "--ablate"]
    assert main([*args, *ablate]) == 0
    out = capsys.readouterr().out
    assert "where does 'it' look?" in out and expected in out


def test_loaders_registry(tmp_path):
    import pytest

    from qkv.inspect.loaders import DIR_LOADERS, load, register_dir

    with pytest.raises(ValueError, match="--model must be one of"):
        load("no-such-model")
    with pytest.raises(ValueError, match="no loader recognises"):
        load(str(tmp_path))
    register_dir(lambda p: load("random") if (p / "tiny.flag").exists() else None)
    try:
        (tmp_path / "tiny.flag").touch()
        assert load(str(tmp_path)).name == "random"
    finally:
        DIR_LOADERS.pop()


def test_explain_limit_counts_tokens_of_unspaced_text(tmp_path, capsys):
    paste = "男孩训练小狗。" * 200  # one whitespace "word", 1,400 tokens
    assert main(["explain", "--text", paste, "--out", str(tmp_path / "zh.md")]) == 0
    err = capsys.readouterr().err
    assert err.startswith("qkv explain: note: --text cut to its first 32 tokens")
    md = (tmp_path / "zh.md").read_text(encoding="utf-8")
    assert "→ 32 tokens ['男', '孩', '训'" in md
    assert main(["explain", "--text", "男孩训练小狗。", "--out", str(tmp_path / "ok.md")]) == 0
    assert "note" not in capsys.readouterr().err


def test_heads_table_keeps_full_layer_names_at_80_columns(monkeypatch, capsys):
    import io

    from rich.console import Console

    import qkv.apps.view as view

    buf = io.StringIO()
    monkeypatch.setattr(view, "console", Console(file=buf, width=80, color_system=None))
    assert main(["heads", "The animal didn't cross the street because it was tired."]) == 0
    lines = buf.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines)
    rows = [line for line in lines if "layers." in line]
    assert rows and all("…" not in line for line in rows)  # nothing cut
    names = {line.split()[0] for line in rows}
    assert names == {"encoder.layers.0.self_attn", "encoder.layers.1.self_attn"}  # random model
    assert "qkv heads: note: random weights" in capsys.readouterr().err  # and it says so
