"""Fonts for token labels in any script: a fallback list of installed Noto fonts.

Matplotlib (≥ 3.6) falls back along ``font.family`` glyph by glyph, so one label may mix
Latin, Myanmar, Bengali and Chinese. Debian's ``fonts-noto-core`` and ``fonts-noto-cjk``
provide the families below (``scripts/setup-system.sh`` installs them); missing ones are
skipped, DejaVu Sans (bundled with matplotlib) comes last.

Matplotlib keeps a cached list of the system's fonts (``fontlist-*.json``); a cache built
before the Noto fonts were installed does not know them. :func:`add_missing_fonts` finds the
files of any fallback family the list lacks (``fc-list``, then Debian's font directories) and
adds them, once per process, before the first picture is drawn.

Matplotlib draws glyphs without complex-script shaping, so Myanmar and Bengali syllables
show every glyph but not always the ligatures a browser would form; the HTML viewer shapes
them properly.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from functools import lru_cache

__all__ = ["FALLBACK_FAMILIES", "add_missing_fonts", "font_families", "font_files",
           "missing_glyphs"]  # fmt: skip

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


# where Debian (fonts-noto-core, fonts-noto-cjk) and other distributions put the Noto fonts
FONT_DIRS = ("/usr/share/fonts/truetype/noto", "/usr/share/fonts/opentype/noto",
             "/usr/share/fonts/noto", "/usr/share/fonts/noto-cjk",
             "/usr/share/fonts/google-noto*", "/usr/local/share/fonts")  # fmt: skip


def _files_of(family: str) -> list[str]:
    """Regular-weight font files of ``family`` on this machine (fc-list, else known paths)."""
    files: list[str] = []
    if shutil.which("fc-list"):
        try:
            out = subprocess.run(
                ["fc-list", "--format", "%{file}\n", f":family={family}:style=Regular"],
                capture_output=True, text=True, timeout=20, check=False,
            ).stdout  # fmt: skip
            files = [f for f in out.splitlines() if f and os.path.isfile(f)]
        except (OSError, subprocess.SubprocessError):
            files = []
    if not files:
        stem = family.replace(" ", "")
        if "CJK" in stem:  # one collection holds every CJK family
            stem = stem[: stem.index("CJK") + 3]
        for d in FONT_DIRS:
            for pattern in (f"{stem}-Regular.tt[fc]", f"{stem}-Regular.otf"):
                files += glob.glob(os.path.join(d, "**", pattern), recursive=True)
    return sorted(set(files))


def add_missing_fonts(manager=None) -> list[str]:
    """Add to matplotlib's font list (``manager``, default the global one) the installed fonts
    of every :data:`FALLBACK_FAMILIES` family it lacks, as a stale font cache would.
    Returns the files added."""
    from matplotlib import font_manager

    manager = manager or font_manager.fontManager
    have = {f.name for f in manager.ttflist}
    added: list[str] = []
    for family in FALLBACK_FAMILIES:
        if family in have:
            continue
        for path in _files_of(family):
            if path in added:
                continue
            try:
                manager.addfont(path)
            except (OSError, RuntimeError, ValueError):  # unreadable font file: skip it
                continue
            added.append(path)
        have = {f.name for f in manager.ttflist}
    return added


@lru_cache(maxsize=1)
def font_families() -> list[str]:
    """The families of :data:`FALLBACK_FAMILIES` that matplotlib finds on this machine (after
    :func:`add_missing_fonts`)."""
    from matplotlib import font_manager

    add_missing_fonts()
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
