"""Sources as people type them, not as captions are written: longer, lower-case, with typos.

Multi30k's sources are single, well-formed captions. A translator trained on them alone
writes nonsense for two sentences in one line, or for a caption with a typo. Two uses of the
same transformations:

- :func:`noise_pairs`: extra *training* pairs (the originals stay): two pairs joined into
  one, sources lower-cased or given a typo, the targets kept clean;
- :func:`stress_sets`: *evaluation* sets built from a held-out split (val), one per kind,
  to measure how a model generalises without choosing anything on a test set.

Every choice comes from ``random.Random(seed)``: the same call gives the same pairs.

>>> pairs = [("A dog runs.", "Un chien court."), ("Two men sit.", "Deux hommes assis.")]
>>> noise_pairs(pairs, seed=0, join=1.0, typos=0.0, lower=0.0)[0]
('Two men sit. A dog runs.', 'Deux hommes assis. Un chien court.')
>>> sorted(stress_sets(pairs, seed=0))
['caps', 'joined', 'lower', 'typos']
"""

from __future__ import annotations

import random

__all__ = ["STRESS_KINDS", "joined", "noise_pairs", "stress_sets", "typo"]

STRESS_KINDS = ("joined", "caps", "typos", "lower")


def typo(sentence: str, rng: random.Random) -> str:
    """``sentence`` with one keyboard slip in a word of 3+ letters: two letters swapped, a
    letter dropped or a letter doubled (as is, when no word is long enough)."""
    words = sentence.split(" ")
    long = [i for i, w in enumerate(words) if sum(c.isalpha() for c in w) >= 3]
    if not long:
        return sentence
    i = rng.choice(long)
    w = words[i]
    letters = [j for j, c in enumerate(w) if c.isalpha()]
    j = rng.choice(letters[:-1])  # a letter with a letter after it
    kind = rng.randrange(3)
    if kind == 0 and w[j + 1].isalpha():
        w = w[:j] + w[j + 1] + w[j] + w[j + 2 :]
    elif kind == 1:
        w = w[:j] + w[j + 1 :]
    else:
        w = w[: j + 1] + w[j:]
    words[i] = w
    return " ".join(words)


def joined(a: tuple[str, str], b: tuple[str, str]) -> tuple[str, str]:
    """Two pairs as one: sources and targets each joined with a space."""
    return f"{a[0].strip()} {b[0].strip()}", f"{a[1].strip()} {b[1].strip()}"


def noise_pairs(
    pairs: list[tuple[str, str]],
    *,
    seed: int,
    join: float = 0.15,
    typos: float = 0.15,
    lower: float = 0.1,
) -> list[tuple[str, str]]:
    """Extra training pairs for ``pairs`` (targets kept clean): ``join · N`` pairs of two
    random pairs joined, ``typos · N`` sources with one typo, ``lower · N`` sources
    lower-cased. Add them to the training data; the originals stay."""
    rng = random.Random(seed)
    n = len(pairs)
    out = []
    if n >= 2:
        for _ in range(round(join * n)):
            i, j = rng.sample(range(n), 2)
            out.append(joined(pairs[i], pairs[j]))
    for i in rng.sample(range(n), min(n, round(typos * n))):
        out.append((typo(pairs[i][0], rng), pairs[i][1]))
    for i in rng.sample(range(n), min(n, round(lower * n))):
        out.append((pairs[i][0].lower(), pairs[i][1]))
    return out


def stress_sets(pairs: list[tuple[str, str]], *, seed: int) -> dict[str, list[tuple[str, str]]]:
    """Evaluation sets from held-out ``pairs`` (val), one per kind of :data:`STRESS_KINDS`:

    - ``joined``: consecutive pairs joined two by two (sentences of ~2× the usual length);
    - ``caps``: sources and references in capitals (as ``qkv.translate`` writes a line given
      in capitals);
    - ``typos``: one typo in each source (:func:`typo`), references as they are;
    - ``lower``: sources lower-cased, references as they are.
    """
    rng = random.Random(seed)
    return {
        "joined": [joined(pairs[i], pairs[i + 1]) for i in range(0, len(pairs) - 1, 2)],
        "caps": [(s.upper(), t.upper()) for s, t in pairs],
        "typos": [(typo(s, rng), t) for s, t in pairs],
        "lower": [(s.lower(), t) for s, t in pairs],
    }
