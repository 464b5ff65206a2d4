"""qkv.data.noise: the extra training pairs and the stress sets, deterministic and as said."""

import random

import pytest

from qkv.data.noise import STRESS_KINDS, noise_pairs, stress_sets, typo

PAIRS = [(f"A dog number {i} runs on the grass.", f"Un chien numéro {i} court sur l'herbe.")
         for i in range(40)]  # fmt: skip


def _edit_distance(a: str, b: str) -> int:
    d = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, d[0] = d[0], i
        for j, cb in enumerate(b, 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (ca != cb))
    return d[-1]


@pytest.mark.parametrize("seed", range(30))
def test_a_typo_is_one_slip_in_one_word(seed):
    s = "Two young children play with a ball near the water."
    t = typo(s, random.Random(seed))
    changed = [(a, b) for a, b in zip(s.split(" "), t.split(" ")) if a != b]
    assert len(t.split(" ")) == len(s.split(" ")) and len(changed) <= 1
    if changed:  # a swap of two equal letters changes nothing
        (a, b), = changed
        assert 1 <= _edit_distance(a, b) <= 2 and sum(c.isalpha() for c in a) >= 3
    assert typo("A b c.", random.Random(seed)) == "A b c."  # no word of 3+ letters


def test_noise_pairs_counts_targets_and_seed():
    extra = noise_pairs(PAIRS, seed=1, join=0.25, typos=0.5, lower=0.25)
    assert len(extra) == 10 + 20 + 10
    assert extra == noise_pairs(PAIRS, seed=1, join=0.25, typos=0.5, lower=0.25)
    assert extra != noise_pairs(PAIRS, seed=2, join=0.25, typos=0.5, lower=0.25)
    targets = {t for _, t in PAIRS}
    joined, typos, lower = extra[:10], extra[10:30], extra[30:]
    for s, t in joined:  # two different pairs, each side joined in the same order
        a, b = t.split(". ", 1)
        assert a + "." in targets and b in targets and a + "." != b
        assert s.count("A dog number") == 2
    assert all(t in targets and s != t for s, t in typos + lower)
    assert all(s == s.lower() for s, _ in lower)


def test_stress_sets_from_held_out_pairs():
    sets = stress_sets(PAIRS, seed=0)
    assert tuple(sets) == STRESS_KINDS
    assert len(sets["joined"]) == 20 and sets["joined"][0] == (
        f"{PAIRS[0][0]} {PAIRS[1][0]}", f"{PAIRS[0][1]} {PAIRS[1][1]}")
    assert sets["caps"][3] == (PAIRS[3][0].upper(), PAIRS[3][1].upper())
    assert [t for _, t in sets["typos"]] == [t for _, t in PAIRS]
    assert sum(s != o for (s, _), (o, _) in zip(sets["typos"], PAIRS)) > 30
    assert sets["lower"][5] == (PAIRS[5][0].lower(), PAIRS[5][1])
