"""A translation's notes (``Translator.check``'s: unknown words, numbers, another language, a
question, a long sentence, many pieces) in the explorer, in a real browser (Debian's chromium
via Playwright) against a real server: each said in the reader's language, its fields filled
in (the words listed, the languages named in that language), no English left on the page,
redrawn when the language changes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import quote

import pytest

pytest.importorskip("uvicorn")
from serve_helpers import english_left, open_page, page_text  # noqa: E402
from serve_helpers import page_ready as _ready  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]  # the repository (this is tests/apps/serve/)
ARTIFACTS = ROOT / "tests" / "artifacts"
STRINGS = json.loads((ROOT / "src/qkv/apps/serve/static/i18n/strings.json").read_text())
LANGS = ["en", "my", "vi", "bn", "zh"]
LONG = " ".join(["A man in a blue shirt is riding a bike down the street"] * 4) + "."
# (text, the notes' keys and their fields as the page fills them in)
CASES = [
    ("John and Maria walk their dog at 7 o'clock?",
     [("warn.unseen", {"words": "John, Maria"}), ("warn.numbers", {}), ("warn.question", {})]),
    ("Un homme et une femme marchent avec le chien.",
     [("warn.language", {"looks": "lang.fr", "reads": "lang.en"})]),
    (LONG, [("warn.long", {"words": "52"})]),
    ("Xylophonists juxtapose quixotic zeugmas.", [("warn.pieces", {})]),
]  # fmt: skip


def said(lang: str, key: str, fields: dict) -> str:
    """The note as the page says it in ``lang``: a language's name in that language."""
    text = STRINGS[lang][key]
    for k, v in fields.items():
        text = text.replace("{" + k + "}", STRINGS[lang][v] if v.startswith("lang.") else v)
    return text


def piece(text: str) -> str:
    """The longest part of a string between its placeholders (what only it says)."""
    return max(re.split(r"\{\w+\}", text), key=len).strip()


def test_translation_notes_in_every_language(server, browser):
    ARTIFACTS.mkdir(exist_ok=True)
    text, _ = CASES[0]
    page, errors, dialogs, outside = open_page(
        browser, f"{server}/?model=en-fr&translate=1&text={quote(text)}&lang=en")
    for i, (text, notes) in enumerate(CASES):
        if i:
            page.select_option("#lang", "en")
            page.fill("#text", text)
            page.press("#text", "Enter")
            _ready(page)
        for lang in LANGS:  # the same answer, redrawn in each language
            page.select_option("#lang", lang)
            shown = " ".join(page.text_content("#notice").split())
            for key, fields in notes:
                assert " ".join(said(lang, key, fields).split()) in shown, (lang, key, shown)
            others = {k for k in STRINGS["en"] if k.startswith("warn.")} - {k for k, _ in notes}
            assert not [k for k in others if piece(STRINGS[lang][k]) in shown], (lang, shown)
            if lang != "en":
                assert english_left(STRINGS, lang, page_text(page)) == [], (lang, text)
            if i == 0 and lang in ("en", "my", "zh"):
                page.screenshot(path=str(ARTIFACTS / f"serve_notes_{lang}.png"))
    assert errors == [] and dialogs == [] and outside == []
    page.close()
