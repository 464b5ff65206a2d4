"""Input limits: how much text each command reads, and how longer text is cut or split.

Every entry point works on at most a stated number of tokens, so its time and memory are
bounded by the limit, never by the input:

    qkv explain   MAX_TOKENS["explain"] tokens  (of qkv.data.words.split_words; each step
                                                prints T × T numbers per head)
    qkv view      MAX_TOKENS["view"] tokens     (the page holds layers × heads × T² weights)
    qkv heads     MAX_TOKENS["heads"] tokens
    qkv embed     MAX_TOKENS["embed"] tokens per sentence, MAX_SENTENCES sentences

Longer input is cut with a visible note (:func:`fit_text`), or, for translation, split into
sentences and pieces that each fit (:func:`split_to_fit`), never cut silently.

The explorer's maps (``qkv serve``'s answers, ``qkv view``'s page and the notebook view)
hold at most :data:`MAX_CELLS` weights and :data:`TOKEN_LIMIT` tokens (:func:`encoder_limit`:
fewer for a model with many heads), every float with :data:`DECIMALS` decimals. ``qkv serve``
takes longer inputs, up to :data:`LONG_TOKEN_LIMIT` tokens, and answers them with the maps
max-pooled to that size and one head exact (:mod:`qkv.apps.serve.long`).

>>> fit_text("one two three four", 2)
('one two', 4)
>>> split_to_fit("A dog runs. The cat sleeps on the mat.", 4)
['A dog runs.', 'The cat sleeps on', 'the mat.']
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

__all__ = [
    "DECIMALS",
    "LONG_TOKEN_LIMIT",
    "MAX_CELLS",
    "MAX_SENTENCES",
    "MAX_TOKENS",
    "TOKEN_LIMIT",
    "encoder_limit",
    "fit_text",
    "split_sentences",
    "split_to_fit",
]

MAX_TOKENS = {"explain": 32, "view": 128, "heads": 128, "embed": 256}
MAX_SENTENCES = 64
CHARS_PER_TOKEN = 16  # no tokenizer here makes a token of more than this many characters

# The explorer's maps (qkv.apps.serve.limits lists them with the server's other limits)
TOKEN_LIMIT = 128  # tokens in the maps (special tokens included); longer → cut, with a notice
MAX_CELLS = 320_000  # attention weights in one answer (all layers × heads × Tq × Tk)
DECIMALS = 3  # decimals of every float in an answer
# qkv serve: a longer input (up to the model's positions) is answered with pooled maps
LONG_TOKEN_LIMIT = 2048

_WORD = re.compile(r"\S+")
_SENTENCE_END = re.compile(r"(?<=[.!?…。！？।॥။])\s+|(?<=[。！？])(?=\S)")


def encoder_limit(n_heads_total: int) -> int:
    """Token limit of a self-attention model with ``n_heads_total`` heads (all layers): its
    maps hold at most :data:`MAX_CELLS` weights (MiniLM's 72 heads: 66 tokens)."""
    return max(8, min(TOKEN_LIMIT, math.isqrt(MAX_CELLS // max(1, n_heads_total))))


def _words(text: str) -> int:
    return len(text.split())


def fit_text(
    text: str, limit: int, count: Callable[[str], int] | None = None
) -> tuple[str, int | None]:
    """The longest prefix of ``text`` (whole words where it can) with ``count(prefix) <= limit``.

    ``count`` gives a text's length in tokens (default: whitespace words). Returns
    ``(prefix, None)`` when ``text`` fits, else ``(prefix, n_words)`` with ``n_words`` the
    length of the whole input in words, for the notice. ``count`` (a tokenizer) only ever
    sees at most ``limit`` words and ``CHARS_PER_TOKEN × limit`` characters, so the work
    after this call is bounded by ``limit``, not by the input.
    """
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    count = count or _words
    cut = text
    for i, m in enumerate(_WORD.finditer(text)):
        if i == limit:  # keep the first `limit` words
            cut = text[: m.start()]
            break
    cut = cut[: CHARS_PER_TOKEN * limit]
    n = count(cut)
    while n > limit and cut:
        keep = min(len(cut) - 1, max(1, int(len(cut) * limit / n * 0.95)))
        space = cut.rfind(" ", 0, keep + 1)
        cut = cut[:space] if space > keep // 2 else cut[:keep]
        n = count(cut)
    cut = cut.rstrip()
    if cut == text.strip():
        return text, None
    return cut, sum(1 for _ in _WORD.finditer(text))


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text``: split after ``. ! ? …`` and the full stops of other scripts
    (``。 ！ ？ । ။``); empty pieces dropped."""
    return [s.strip() for s in _SENTENCE_END.split(text) if s and s.strip()]


def split_to_fit(
    text: str, max_tokens: int, count: Callable[[str], int] | None = None
) -> list[str]:
    """``text`` as consecutive pieces of at most ``max_tokens`` tokens each: its sentences,
    and a sentence too long for the limit cut into word runs that fit. Nothing is dropped
    (joining the pieces with spaces gives the words of ``text`` back).

    For translation: translate each piece and join the results, instead of cutting the
    input at the model's length.
    """
    count = count or _words
    out: list[str] = []
    for sentence in split_sentences(text):
        rest = sentence
        while rest:
            piece, _ = fit_text(rest, max_tokens, count)
            if not piece:  # one "word" longer than the limit: cut it by characters
                piece = rest[: max(1, len(rest) // 2)]
                while count(piece) > max_tokens and len(piece) > 1:
                    piece = piece[: len(piece) // 2]
            out.append(piece)
            rest = rest[len(piece) :].lstrip()
    return out
