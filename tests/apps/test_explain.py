"""qkv explain (the notes' walk) and the view/heads commands, end to end."""

import json

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


def test_view_and_heads_commands(tmp_path, capsys):
    page, png = tmp_path / "a.html", tmp_path / "a.png"
    assert (
        main(
            [
                "view",
                "The boy trains the puppy.",
                "--model",
                "random",
                "--out",
                str(page),
                "--png",
                str(png),
            ]
        )
        == 0
    )
    assert png.stat().st_size > 1000
    data = json.loads(page.read_text().split('id="qkv-data">')[1].split("</script>")[0])
    assert data["response"]["layers"][0]["q_tokens"][1] == "The"  # the explorer's page
    assert (
        main(
            [
                "view",
                "--translate",
                "The boy trains the puppy.",
                "--out",
                str(tmp_path / "t.html"),
                "--png",
                str(tmp_path / "t.svg"),
            ]
        )
        == 0
    )
    assert (tmp_path / "t-alignment.svg").exists()
    data = json.loads((tmp_path / "t.html").read_text().split('id="qkv-data">')[1]
                      .split("</script>")[0])  # fmt: skip
    resp = data["response"]
    assert resp["translation"]["steps"] > 1 and "cross" in {x["kind"] for x in resp["layers"]}
    capsys.readouterr()
    sent = "The animal didn't cross the street because it was tired."
    assert (
        main(
            [
                "heads",
                sent,
                "--token",
                "it",
                "--candidates",
                "animal",
                "street",
                "--ablate",
                "--top",
                "3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "where does 'it' look?" in out and "one head off at a time" in out
    assert (
        main(
            [
                "heads",
                sent,
                "--token",
                "it",
                "--candidates",
                "animal",
                "street",
                "--ablate",
                "1:0,2",
            ]
        )
        == 0
    )
    assert "off (Δ" in capsys.readouterr().out


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
