"""Fonts for token labels in any script: a fallback list of installed Noto fonts.

Matplotlib (≥ 3.6) falls back along ``font.family`` glyph by glyph, so one label may mix
Latin, Myanmar, Bengali and Chinese. Debian's ``fonts-noto-core`` and ``fonts-noto-cjk``
provide the families below (``scripts/setup-system.sh`` installs them); missing ones are
skipped, DejaVu Sans (bundled with matplotlib) comes last.

Matplotlib draws glyphs without complex-script shaping, so Myanmar and Bengali syllables
show every glyph but not always the ligatures a browser would form; the HTML viewer shapes
them properly.
"""

from __future__ import annotations

from functools import lru_cache

__all__ = ["FALLBACK_FAMILIES", "font_families", "font_files", "missing_glyphs"]

FALLBACK_FAMILIES = [
    "Noto Sans",
    "Noto Sans Myanmar",
    "Noto Sans Bengali",
    "Noto Sans Devanagari",
    "Noto Sans Arabic",
    "Noto Sans Hebrew",
    "Noto Sans Thai",
    "Noto Sans Georgian",
    "Noto Sans Armenian",
    "Noto Sans Ethiopic",
    "Noto Sans Tamil",
    "Noto Sans Khmer",
    "Noto Sans CJK SC",
    "Noto Sans CJK JP",
    "DejaVu Sans",
]


@lru_cache(maxsize=1)
def font_families() -> list[str]:
    """The families of :data:`FALLBACK_FAMILIES` that matplotlib finds on this machine."""
    from matplotlib import font_manager

    have = {f.name for f in font_manager.fontManager.ttflist}
    return [f for f in FALLBACK_FAMILIES if f in have] or ["DejaVu Sans"]


def font_files() -> list[str]:
    """The regular font file of each family in :func:`font_families`, in fallback order."""
    from matplotlib import font_manager

    return [
        font_manager.findfont(font_manager.FontProperties(family=f), fallback_to_default=False)
        for f in font_families()
    ]


def missing_glyphs(text: str) -> set[str]:
    """Characters of ``text`` (whitespace aside) that no font in the fallback list covers."""
    from fontTools.ttLib import TTCollection, TTFont

    cmaps = []
    for path in font_files():
        fonts = TTCollection(path).fonts[:1] if path.lower().endswith(".ttc") else [TTFont(path)]
        cmaps.extend(f.getBestCmap() or {} for f in fonts)
    return {c for c in text if not c.isspace() and not any(ord(c) in m for m in cmaps)}
