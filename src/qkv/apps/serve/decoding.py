"""The explorer's translations as ``qkv translate`` makes them: its guards and its notes.

A qkv translator in the explorer is decoded with the settings of the
:class:`qkv.translate.Translator` that ``qkv.translate.load`` builds for it (its
``generation.json`` over :mod:`qkv.translate`'s defaults: ``no_repeat_ngram`` and the
:class:`~qkv.generate.RepeatGuard`), so the page shows the translation the command writes,
and never a stutter ("gigigi") the command would not write. Its notes are those of
:meth:`~qkv.translate.Translator.check` on the text the explorer translates (long, many
pieces, words it has not seen, numbers, another language, a question), as codes the page says
in its reader's language.

The in-page engine (``qkv.apps.web``) decodes and notes the same way in JavaScript, from what
:func:`page_settings` writes into its manifest: one source for both.
"""

from __future__ import annotations

from qkv.translate import LONG_SENTENCE_WORDS, PIECES_PER_WORD, WARNINGS, Translator
from qkv.translate import source_warnings as _source_warnings
from qkv.translate import warning_text as _warning_text
from qkv.translate_notes import (
    LANGUAGE_MIN_HITS,
    LANGUAGE_NAMES,
    LANGUAGE_WORDS,
    MANY_PIECES_WORDS,
    NOTES,
    UNSEEN_PIECES,
    UNSEEN_WORDS,
)
from qkv.translate_notes import source_notes as _source_notes

__all__ = ["notes", "page_settings", "translator_of"]


def translator_of(loaded) -> Translator:
    """The :class:`~qkv.translate.Translator` of a qkv translator's ``Loaded``: the one it
    was loaded as (``qkv serve``'s registry loads translators with ``qkv.translate.load``),
    else one with :mod:`qkv.translate`'s defaults (a directory opened another way)."""
    tr = getattr(loaded, "translator", None)
    if tr is None:
        tr = Translator(loaded.full_model, loaded.tokenizer)
    return tr


def notes(loaded, text: str) -> dict:
    """``warnings``: why ``text`` may be translated badly, as
    :meth:`~qkv.translate.Translator.check` says it (``[{"code": ...}]``; the page says each
    in its reader's language), and ``note``: the same in English for API clients, or
    ``None``.

    The explorer translates the text as it is written, not in sentence case, so a line in
    capitals gets no ``caps`` note (its words then come out as unknown pieces, and say so).
    """
    if loaded.tokenizer is None:  # the random tiny model: nothing was learned from any data
        return {"warnings": [], "note": None}
    tr = translator_of(loaded)
    found = _source_warnings(loaded.tokenizer, text)
    pieces = any(n["code"] == "pieces" for n in found)  # says what "unseen" would say
    found += [n for n in _source_notes(loaded.tokenizer, text, tr.src)
              if not (pieces and n["code"] == "unseen")]  # fmt: skip
    return {"warnings": found, "note": " ".join(map(_warning_text, found)) or None}


def page_settings(loaded) -> dict:
    """What the in-page engine needs to decode and note as :func:`notes` and the server do:
    the guards (``no_repeat_ngram``, ``repeat_guard``) and ``notes`` (the model's source
    language, the thresholds and word lists of :mod:`qkv.translate_notes`, the English
    sentences)."""
    tr = translator_of(loaded)
    return {
        "no_repeat_ngram": tr.no_repeat_ngram,
        "repeat_guard": tr.repeat_guard,
        "notes": {
            "src": tr.src, "long_words": LONG_SENTENCE_WORDS, "pieces_per_word": PIECES_PER_WORD,
            "unseen_pieces": UNSEEN_PIECES, "unseen_words": UNSEEN_WORDS,
            "many_pieces_words": MANY_PIECES_WORDS, "language_min_hits": LANGUAGE_MIN_HITS,
            "language_words": {k: v.split() for k, v in LANGUAGE_WORDS.items()},
            "language_names": LANGUAGE_NAMES, "text": {**WARNINGS, **NOTES},
        },
    }  # fmt: skip
