"""Tense augmentation: English progressive captions rewritten to the simple present."""

from collections import Counter

import pytest

from qkv.data import default_data_dir, multi30k
from qkv.data.augment import present_tense_pairs, simple_present, third_person, word_counts

WORDS = Counter(
    "train trains ride sit run lie watch carry play have fall be go swim dive hug".split()
)


@pytest.mark.parametrize(
    "base,third",
    [("train", "trains"), ("watch", "watches"), ("carry", "carries"), ("play", "plays"),
     ("have", "has"), ("go", "goes"), ("fix", "fixes"), ("kiss", "kisses")],
)  # fmt: skip
def test_third_person(base, third):
    assert third_person(base) == third


@pytest.mark.parametrize(
    "sentence,expected",
    [
        ("The boy is training the puppy.", "The boy trains the puppy."),
        ("Two dogs are running and a man is riding a horse.",
         "Two dogs run and a man rides a horse."),
        ("A girl is sitting while a boy is swimming", "A girl sits while a boy swims"),
        ("A dog is lying in the grass.", "A dog lies in the grass."),
        ("A man is falling.", "A man falls."),
        ("She is diving.", "She dives."),
        ("A man who is watching a child who is carrying a box",
         "A man who watches a child who carries a box"),
    ],
)  # fmt: skip
def test_progressive_becomes_simple_present(sentence, expected):
    assert simple_present(sentence, WORDS) == expected


@pytest.mark.parametrize(
    "sentence",
    [
        "A dog is being washed.",  # passive
        "They are going to swim.",  # future
        "A man is zorbing down a hill.",  # "zorb" never occurs: not invented
        "A man sitting on a bench.",  # no auxiliary
        "The king is a sovereign.",  # no -ing verb
        "Is he playing?",  # capitalised question: left alone
    ],
)
def test_left_alone(sentence):
    assert simple_present(sentence, WORDS) is None


def test_pairs_keep_targets_and_only_add_rewritten_sources():
    pairs = [("A boy is hugging a dog.", "Un garçon serre un chien."),
             ("Bears hug and play.", "Les ours s'embrassent et jouent."),  # attests the bases
             ("Kids are zorbing.", "Des enfants font du zorbing."),  # "zorb" is not attested
             ("Kids are playing.", "Des enfants jouent.")]  # fmt: skip
    assert present_tense_pairs(pairs) == [("A boy hugs a dog.", "Un garçon serre un chien."),
                                          ("Kids play.", "Des enfants jouent.")]  # fmt: skip


def test_word_counts_are_lowercased_words():
    assert word_counts(["A dog, a DOG.", "dogs"]) == Counter({"a": 2, "dog": 2, "dogs": 1})


@pytest.mark.skipif(default_data_dir() is None, reason="Multi30k not found")
def test_multi30k_augmentation_size_and_sample():
    pairs = multi30k("train", "en", "fr")
    extra = present_tense_pairs(pairs)
    assert 0.2 * len(pairs) < len(extra) < 0.4 * len(pairs)
    sources = {s for s, _ in extra}
    assert "A man sits on a bicycle laden down with boxes." in sources
    assert not any(" is " + w in s for s in sources for w in ("sitting", "standing", "playing"))
