"""Words of a sentence, by script: the toy tokenizer of ``qkv explain`` and the tour.

No vocabulary and no download: the tokens come from the writing system itself.

==========================  ==============================================================
script                      one token is
==========================  ==============================================================
spaced scripts (Latin,      a run of letters, marks and digits (``don't`` and
Cyrillic, Greek, Arabic,    ``well-known`` stay one word); each punctuation run is its
Devanagari, Bengali, ...)   own token
Han, Hiragana, Katakana     one character (Chinese and Japanese write no spaces)
Burmese (Myanmar)           one syllable: break before a consonant that is neither stacked
                            (after ``္``) nor killed (followed by ``်``, optionally after
                            ``့``), and before independent vowels, digits and ``၊ ။``
Thai, Lao, Khmer            about a syllable: a consonant with its vowel signs and tone
                            marks, a leading vowel (``เ แ โ ใ ไ``) with the consonant after
                            it, a stacked consonant (Khmer ``្``) with the one above, and a
                            lone consonant after a vowel as its final (``เด็ก``, ``ក្មេង``).
                            Final consonants are not written as such in these scripts, so
                            some breaks are off by a letter (``สวัสดี`` → ``ส วัส ดี``);
                            exact syllables or words need a dictionary
==========================  ==============================================================

A combining mark stays with the character it is written on (a token starts with a mark
only where a space separates the two). Nothing but spaces is dropped.

>>> split_words("The boy trains the puppy.")
['The', 'boy', 'trains', 'the', 'puppy', '.']
>>> split_words("男孩训练小狗。")
['男', '孩', '训', '练', '小', '狗', '。']
>>> split_words("မင်္ဂလာပါ")
['မင်္ဂ', 'လာ', 'ပါ']
>>> split_words("Le garçon dresse le chiot…")
['Le', 'garçon', 'dresse', 'le', 'chiot', '…']
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ["count_words", "first_words", "split_words"]

# Characters written one per token.
_HAN_KANA = (
    (0x2E80, 0x2FDF),  # CJK radicals, Kangxi radicals
    (0x3005, 0x3007),  # 々 〆 〇
    (0x3040, 0x30FF),  # Hiragana, Katakana
    (0x31F0, 0x31FF),  # Katakana phonetic extensions
    (0x3400, 0x4DBF),  # CJK extension A
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0xF900, 0xFAFF),  # CJK compatibility ideographs
    (0xFF66, 0xFF9F),  # half-width Katakana
    (0x20000, 0x3134F),  # CJK extensions B-G
)
_THAI, _LAO, _KHMER = (0x0E00, 0x0E7F), (0x0E80, 0x0EFF), (0x1780, 0x17FF)
_MYANMAR = ((0x1000, 0x109F), (0xA9E0, 0xA9FF), (0xAA60, 0xAA7F))

# Burmese syllables (after the well-known "sylbreak" rule): a break before a consonant that is
# not stacked (preceded by virama U+1039) and not killed (followed by asat U+103A or virama,
# possibly after the dot below U+1037), and before independent vowels, digits and punctuation.
_MY_BREAK = re.compile(
    r"(?<!\u1039)(?=[\u1000-\u1021](?![\u1037]?[\u103A\u1039]))"
    r"|(?=[\u1023-\u102A\u103F\u1040-\u1049\u104A-\u104F])"
)
# Thai/Lao leading vowels (written before the consonant they follow in speech).
_LEADING = frozenset("\u0e40\u0e41\u0e42\u0e43\u0e44\u0ec0\u0ec1\u0ec2\u0ec3\u0ec4")
# Thai/Lao vowels written after the consonant that are letters (Lo), not marks.
_FOLLOWING = frozenset("\u0e30\u0e32\u0e33\u0e45\u0eb0\u0eb2\u0eb3")
_KHMER_COENG = "\u17d2"
_VOWELS = frozenset(
    [chr(c) for c in range(0x0E30, 0x0E48) if c not in range(0x0E3A, 0x0E40)]  # Thai
    + [chr(c) for c in range(0x0EB0, 0x0EC5) if c not in range(0x0EBD, 0x0EC0)]  # Lao
    + [chr(c) for c in range(0x17B6, 0x17C6)]  # Khmer dependent vowels
)
_CLOSING = frozenset("\u0e30\u0e33\u0eb0\u0eb3")  # ะ ำ: a syllable that takes no final
_FINAL_MARKS = frozenset("\u0e4c\u0ecc\u17cb\u17cc\u17cd")  # killers on a final consonant
_CONSONANTS = frozenset(
    [chr(c) for c in range(0x0E01, 0x0E2F)]  # Thai ก..ฮ
    + [chr(c) for c in range(0x0E81, 0x0EAF)]  # Lao
    + [chr(c) for c in range(0x1780, 0x17A3)]  # Khmer
)
_WORD_JOINERS = frozenset("'’-")  # inside a word: don't, aujourd’hui, well-known


def _script(ch: str) -> str:
    o = ord(ch)
    if any(a <= o <= b for a, b in _HAN_KANA):
        return "han"
    if any(a <= o <= b for a, b in _MYANMAR):
        return "my"
    if _THAI[0] <= o <= _LAO[1]:
        return "th"
    if _KHMER[0] <= o <= _KHMER[1]:
        return "km"
    return ""


def _is_mark(ch: str) -> bool:
    return unicodedata.category(ch)[0] == "M" or ch in "\u200c\u200d"  # marks, ZWNJ, ZWJ


def _myanmar(run: str) -> list[str]:
    return [s for s in _MY_BREAK.split(run) if s]


def _clusters(run: str) -> list[str]:
    """Thai, Lao, Khmer, about syllables: a new cluster at each base letter, except a letter
    after a leading vowel or a Khmer coeng; marks and following vowels join the cluster before
    them; then a lone consonant after an open cluster joins it as its final."""
    out: list[str] = []
    for ch in run:
        joins = out and (
            _is_mark(ch)
            or ch in _FOLLOWING
            or out[-1][-1] in _LEADING
            or out[-1][-1] == _KHMER_COENG
            or ch == _KHMER_COENG
        )
        if joins:
            out[-1] += ch
        else:
            out.append(ch)
    # A lone consonant after an open cluster (one with a vowel and no final yet) is its final
    # consonant: เด็ + ก → เด็ก, ក្មេ + ង → ក្មេង. Once closed, the next consonant starts anew.
    merged: list[str] = []
    closed = True
    for c in out:
        lone = c[0] in _CONSONANTS and all(ch in _FINAL_MARKS for ch in c[1:])
        if lone and not closed and merged:
            merged[-1] += c
            closed = True
        else:
            merged.append(c)
            closed = not _VOWELS.intersection(c) or c[-1] in _CLOSING
    return merged


def split_words(text: str) -> list[str]:
    """The tokens of ``text`` (NFC-normalised), by script; see the module's table.

    >>> split_words("ကောင်လေး ကျင့်တယ်။")
    ['ကောင်', 'လေး', 'ကျင့်', 'တယ်', '။']
    >>> split_words("don't stop!!")
    ["don't", 'stop', '!!']
    """
    text = unicodedata.normalize("NFC", text)
    out: list[str] = []
    kind = ""  # what the token being built is: "w" word, "p" punctuation, "my"/"th"/"km" runs
    buf = ""

    def flush() -> None:
        nonlocal buf, kind
        if buf:
            if kind == "my":
                out.extend(_myanmar(buf))
            elif kind in ("th", "km"):
                out.extend(_clusters(buf))
            else:
                out.append(buf)
        buf, kind = "", ""

    for i, ch in enumerate(text):
        if ch.isspace():
            flush()
            continue
        if _is_mark(ch) and buf:  # a mark stays with what it is written on
            buf += ch
            continue
        script = _script(ch)
        cat = unicodedata.category(ch)[0]
        if script == "han":
            flush()
            buf, kind = ch, "han"  # one character per token; a following mark may still join
        elif script:
            if kind != script:
                flush()
            buf += ch
            kind = script
        elif cat in "LNM":
            if kind != "w":
                flush()
            buf += ch
            kind = "w"
        elif (
            ch in _WORD_JOINERS
            and kind == "w"
            and i + 1 < len(text)
            and unicodedata.category(text[i + 1])[0] in "LN"
        ):
            buf += ch  # an apostrophe or hyphen between letters
        else:  # punctuation and symbols: a run of the same character is one token
            if not (kind == "p" and buf[-1] == ch):
                flush()
            buf += ch
            kind = "p"
    flush()
    return out


def count_words(text: str) -> int:
    """``len(split_words(text))``: the length that ``qkv explain``'s limit counts.

    >>> count_words("男孩训练小狗。")
    7
    """
    return len(split_words(text))


def first_words(text: str, limit: int, *, chars_per_word: int = 32) -> tuple[str, bool]:
    """``(prefix, was_cut)``: the NFC text up to the end of its ``limit``-th token.

    Only the first ``limit × chars_per_word`` characters are read, so the work is bounded by
    ``limit``; a text whose first tokens are longer than that is cut inside a token.

    >>> first_words("男孩训练小狗。", 3)
    ('男孩训', True)
    >>> first_words("The boy  trains", 2)
    ('The boy', True)
    >>> first_words("a b", 5)
    ('a b', False)
    """
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    text = unicodedata.normalize("NFC", text)
    head = text[: limit * chars_per_word]
    words = split_words(head)
    if len(words) <= limit:
        return (text, False) if len(head) == len(text) else (head.rstrip(), True)
    end = 0
    for w in words[:limit]:  # the words are the text's non-space characters, in order
        end = head.index(w, end) + len(w)
    return head[:end], True
