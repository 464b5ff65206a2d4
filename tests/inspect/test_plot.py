"""Pictures: PNG and SVG written, and no glyph missing for Myanmar, Bengali, Vietnamese, Chinese."""

import logging
import warnings

import pytest
import torch

from qkv.inspect import AttentionMaps, capture
from qkv.inspect.fonts import font_families, missing_glyphs
from qkv.inspect.plot import plot_alignment, plot_grid, plot_head, save
from qkv.inspect.tiny import TinySeq2Seq

SENTENCES = {
    "my": "ကလေးက ခွေးကလေးကို လေ့ကျင့်ပေးတယ်။",
    "bn": "ছেলেটি কুকুরছানাটিকে প্রশিক্ষণ দেয়।",
    "vi": "Cậu bé huấn luyện chú chó con.",
    "zh": "男孩训练小狗。",
}


def _maps(tokens):
    T = len(tokens)
    w = torch.softmax(torch.randn(2, T, T), -1)
    return AttentionMaps(
        [w, w.flip(0)],
        ["enc.0", "enc.1"],
        ["self", "self"],
        [[0, 1]] * 2,
        [tokens] * 2,
        [tokens] * 2,
    )


def _glyph_warnings(fn, caplog):
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        fn()
    msgs = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    return [m for m in msgs if "missing from" in m or "Glyph" in m]


@pytest.mark.parametrize("lang", sorted(SENTENCES))
def test_labels_in_any_script_have_every_glyph(lang, tmp_path, caplog):
    text = SENTENCES[lang]
    assert missing_glyphs(text) == set(), f"fonts {font_families()} lack glyphs"
    tokens = text.split()
    if lang == "zh":
        tokens = list(text)
    fig = plot_head(_maps(tokens), 0, 1)
    assert _glyph_warnings(lambda: save(fig, tmp_path / f"{lang}.png"), caplog) == []
    assert (tmp_path / f"{lang}.png").stat().st_size > 1000


def test_missing_glyph_would_be_noticed(tmp_path, caplog):
    """Control: with DejaVu alone, Myanmar warns, so the check above can fail."""
    import matplotlib

    fig = plot_head(_maps(SENTENCES["my"].split()), 0, 0)
    with matplotlib.rc_context({"font.family": ["DejaVu Sans"]}):
        from matplotlib.figure import Figure

        f2 = Figure()
        f2.text(0.1, 0.5, SENTENCES["my"])
        assert _glyph_warnings(lambda: f2.savefig(tmp_path / "x.png"), caplog)
    assert fig is not None


def test_grid_head_alignment_png_and_svg(tmp_path):
    model = TinySeq2Seq(n_heads=2)
    src_t = ["The", "boy", "trains", "the", "puppy", "."]
    tgt_t = ["<s>", "Le", "garçon", "entraîne", "le", "chiot"]
    src = torch.arange(5, 11)[None]
    tgt = torch.arange(3, 9)[None]
    maps = capture(model, src, tgt, tokens=tgt_t, source_tokens=src_t)
    fig = plot_grid(maps, tmp_path / "grid.png")
    assert len([a for a in fig.axes if a.get_images()]) == 6 * 2
    plot_grid(maps, tmp_path / "grid.svg")
    fig = plot_alignment(maps, path=tmp_path / "align.svg")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == src_t
    assert [t.get_text() for t in ax.get_yticklabels()] == tgt_t
    img = ax.get_images()[0].get_array()
    want = maps.weights[maps.index("decoder.layers.1.cross_attn")].mean(0)
    assert torch.allclose(torch.as_tensor(img.data), want)
    plot_head(maps, "encoder.layers.0.self_attn", 1, tmp_path / "head.png")
    for name in ("grid.png", "grid.svg", "align.svg", "head.png"):
        assert (tmp_path / name).stat().st_size > 1000
    assert (tmp_path / "grid.svg").read_text().lstrip().startswith("<?xml")
    with pytest.raises(ValueError, match=".png or .svg"):
        save(fig, tmp_path / "x.jpg")
    with pytest.raises(ValueError, match="no cross-attention"):
        plot_alignment(maps.filter(kind="self"))


def test_fonts_found_with_a_stale_font_cache(tmp_path, caplog, monkeypatch):
    """matplotlib's cached font list predates the Noto fonts: qkv adds them before drawing."""
    from matplotlib import font_manager

    from qkv.inspect import fonts

    fm = font_manager.fontManager
    stale = [f for f in fm.ttflist if not f.name.startswith("Noto")]
    assert len(stale) < len(fm.ttflist), "the Noto fonts are not installed here"
    monkeypatch.setattr(fm, "ttflist", stale)  # as loaded from a fontlist-*.json built before
    fm._findfont_cached.cache_clear()
    fonts.font_families.cache_clear()
    try:
        assert "Noto Sans Myanmar" not in {f.name for f in fm.ttflist}  # stale, as described
        families = fonts.font_families()
        assert {"Noto Sans Myanmar", "Noto Sans Bengali", "Noto Sans CJK SC"} <= set(families)
        for lang in ("my", "bn", "zh"):
            text = SENTENCES[lang]
            assert missing_glyphs(text) == set()
            tokens = list(text) if lang == "zh" else text.split()
            fig = plot_head(_maps(tokens), 0, 1)
            assert (
                _glyph_warnings(lambda f=fig, x=lang: save(f, tmp_path / f"{x}.png"), caplog) == []
            )
    finally:
        monkeypatch.undo()
        fm._findfont_cached.cache_clear()
        fonts.font_families.cache_clear()
