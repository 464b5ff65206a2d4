"""The translators that ship inside qkv: by name, with their cards, and the notes' sentence."""

import json
import os
import re

import pytest
import torch

from qkv.apps.train import bleu_chrf
from qkv.data import default_data_dir, multi30k
from qkv.models.shipped import shipped
from qkv.translate import load

torch.set_num_threads(1)
needs_data = pytest.mark.skipif(
    default_data_dir() is None and os.environ.get("CI") != "true", reason="Multi30k not found"
)
NOTES_FR = re.compile(r"Le garçon (entraîne|dresse) le chiot\.")


def test_a_simple_sentence_both_ways():
    assert load("en-fr")("Two dogs play in the snow.") == "Deux chiens jouent dans la neige."
    back = load("fr-en")("Deux chiens jouent dans la neige.")  # French has one present tense
    assert re.fullmatch(r"Two dogs (play|are playing) in the snow\.", back), back


def test_both_directions_ship_with_a_card_and_fit_the_budget():
    models = shipped()
    assert {"en-fr", "fr-en"} <= set(models)
    total = 0
    for name, d in models.items():
        card = (d / "README.md").read_text(encoding="utf-8")
        for needed in ("Command", "commit", "Machine", "Training time", "parameter",
                       "| val |", "| test_2016_flickr |", "| test_2017_flickr |", "beam"):  # fmt: skip
            assert needed in card, (name, needed)
        total += sum(f.stat().st_size for f in d.iterdir())
        gen = json.loads((d / "generation.json").read_text())
        assert (gen["src"], gen["tgt"]) == tuple(name.split("-"))
    assert total < 60e6


@pytest.mark.parametrize("beam", [1, 5])
def test_the_notes_sentence(beam):
    assert NOTES_FR.fullmatch(load("en-fr")("The boy trains the puppy.", beam=beam))


@needs_data
@pytest.mark.parametrize("name", ["en-fr", "fr-en"])
def test_bleu_of_the_first_200_equals_the_card(name):
    tr = load(name)
    tr.name_placeholders = False  # the card's figure is the model's (names: test_translate_names)
    card = json.loads((tr.path / "scores.json").read_text())
    pairs = multi30k("test_2016_flickr", tr.src, tr.tgt)[:200]
    bleu, _ = bleu_chrf(tr([s for s, _ in pairs], beam=1), [t for _, t in pairs])
    assert bleu == pytest.approx(card["test_2016_flickr_first200_greedy_bleu"], abs=0.01)


@needs_data
def test_int8_keeps_the_bleu_of_the_card():
    """int8 linear layers (qkv.kernels.int8): BLEU on the card's 200 sentences within 0.5."""
    tr = load("en-fr", int8=True)
    card = json.loads((tr.path / "scores.json").read_text())
    pairs = multi30k("test_2016_flickr", tr.src, tr.tgt)[:200]
    bleu, _ = bleu_chrf(tr([s for s, _ in pairs], beam=1), [t for _, t in pairs])
    assert abs(bleu - card["test_2016_flickr_first200_greedy_bleu"]) < 0.5


def test_a_sentence_in_capitals_is_translated_and_put_back_in_capitals():
    """A caption in capitals used to come out as "Une bande de MAS PSILOIINIIITATATOREEE...":
    the captions the model learned from have almost no capitals."""
    tr = load("en-fr")
    with pytest.warns(UserWarning, match="all in capitals"):
        out = tr("THE BOY TRAINS THE PUPPY.")
    assert NOTES_FR.fullmatch(out.lower().capitalize()), out  # "LE GARÇON ENTRAÎNE LE CHIOT."
    assert out == out.upper()


LONG = ("A man sits on a bench holding his dog and looking at the water, while a boy and his "
        "younger brother playing together at the playground and a woman in blue looks in a "
        "black leather bag while sitting on a bench during a sunny afternoon while people and "
        "limousines passed behind her.")  # fmt: skip


@pytest.mark.parametrize("beam", [1, 5])
def test_a_long_sentence_is_flagged_and_does_not_loop(beam):
    """53 words, longer than any training caption: greedy decoding used to loop ("tandis
    qu'elle regarde une aire de jeux, tandis qu'elle regarde...") to the length limit."""
    tr = load("en-fr")
    with pytest.warns(UserWarning, match="This sentence has 53 words"):
        out = tr(LONG, beam=beam)
    ids = tr.tokenizer.encode(out)
    grams = [tuple(ids[i : i + 4]) for i in range(len(ids) - 3)]
    assert len(grams) == len(set(grams)), out
    assert len(ids) < 1.5 * len(tr.tokenizer.encode(LONG)), out
