"""Source-side tense augmentation: English captions in the simple present.

Multi30k's English captions describe pictures in the progressive ("A boy *is training* a
dog"), while people type the simple present ("The boy *trains* the puppy"). French has one
present tense for both (« entraîne »), so a caption rewritten to the simple present keeps its
French reference and teaches the model the form it rarely sees:

>>> words = Counter("a man rides and sits ; dogs run".split())
>>> simple_present("A man is riding a bike and two dogs are running.", words)
'A man rides a bike and two dogs run.'

Only ``is|are <verb>ing`` is rewritten ("is being" and "are going" are left: passives and
futures). A verb's base form comes from the ``-ing`` form (``riding`` → ride/rid,
``sitting`` → sit, ``lying`` → lie) checked against the words of the corpus itself: a base
(or its third-person form) that never occurs there is not invented, and the sentence is left
as it is.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

__all__ = ["present_tense_pairs", "simple_present", "third_person", "word_counts"]

_PROGRESSIVE = re.compile(r"\b(is|are) ([a-z]+)ing\b")
# not rewritten: "is being pulled" (a passive), "are going to" (a future), and "bring"
_SKIP = {"be", "go", "bring"}
_WORD = re.compile(r"[a-z]+")


def word_counts(sentences: Iterable[str]) -> Counter:
    """Lower-cased word counts: the evidence that a base form really is a word."""
    return Counter(w for s in sentences for w in _WORD.findall(s.lower()))


def third_person(base: str) -> str:
    """``ride`` → ``rides``, ``watch`` → ``watches``, ``carry`` → ``carries``, ``have`` → ``has``."""
    if base == "have":
        return "has"
    if base.endswith(("s", "sh", "ch", "x", "z", "o")):
        return base + "es"
    if base.endswith("y") and len(base) > 1 and base[-2] not in "aeiou":
        return base[:-1] + "ies"
    return base + "s"


def _base(stem: str, words: Counter) -> str | None:
    """The base form of ``stem + 'ing'`` best attested in ``words``, or None."""
    candidates = [stem, stem + "e"]
    if len(stem) > 2 and stem[-1] == stem[-2] and stem[-1] not in "aeiouslz":
        candidates.append(stem[:-1])  # sitting → sit, running → run (but falling → fall)
    if stem.endswith("y"):
        candidates.append(stem[:-1] + "ie")  # lying → lie
    # the base itself must occur: "teaches" alone would also vouch for "teache"
    scored = [(words[c] + words[third_person(c)], c) for c in candidates if words[c] > 0]
    return max(scored)[1] if scored else None


def simple_present(sentence: str, words: Counter) -> str | None:
    """``sentence`` with every ``is|are Ving`` in the simple present, or None if nothing was
    rewritten (no such phrase, or a verb whose base form ``words`` does not attest)."""
    changed = False

    def rewrite(m: re.Match) -> str:
        nonlocal changed
        aux, stem = m.group(1), m.group(2)
        base = _base(stem, words)
        if base is None or base in _SKIP or stem in _SKIP:
            return m.group(0)
        changed = True
        return third_person(base) if aux == "is" else base

    out = _PROGRESSIVE.sub(rewrite, sentence)
    return out if changed else None


def present_tense_pairs(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """For English-source ``pairs``: the extra pairs whose source is rewritten to the simple
    present (the target kept). Add them to the training data; the originals stay."""
    words = word_counts(s for s, _ in pairs)
    extra = []
    for src, tgt in pairs:
        new = simple_present(src, words)
        if new is not None:
            extra.append((new, tgt))
    return extra
