"""The shipped translators never stutter ("Oestestest", "Migigigiga"): qkv.generate's
RepeatGuard, greedy and beam; and numbers of two digits or more go through placeholders."""

import doctest
import re

import pytest
import torch

import qkv.generate._repeat
from qkv.data import default_data_dir, multi30k
from qkv.generate import RepeatGuard, beam_search, greedy_search
from qkv.translate import load, protect_numbers, restore_numbers

torch.set_num_threads(1)

# a unit of 1-4 letters three times in a row inside a word
STUTTER = re.compile(r"([^\W\d_]{1,4})\1{2,}")

# inputs the shipped models stuttered on without the guard (the user's report, then formal
# French and Multi30k val sentences: fr-en "chiche-kebab" -> "pabababab", "Equinox" -> "Exxxx")
LOOPS = {
    "fr-en": [
        "Où va la fille au parapluie jaune ?",  # the report (the d256 model; this one: no loop)
        "Le ministère préconise une décentralisation administrative.",
        "Quatre personnes manifestent contre le traitement des jeunes travailleurs par Equinox.",
        "Un homme en blouse blanche fait du chiche-kebab.",
        "Un homme avec des perles de Mardi Gras autour du cou tenant une perche avec une bannière",
        "Un vieil homme avec des tatouages et des insignes de motard s'attarde un moment dans "
        "une rue en ville.",
        "Un cycliste portant un maillot jaune réalise un tour incroyable dans l'air.",
    ],
    "en-fr": [
        "Green traffic signals light up as people look at motorcycles.",
        "A man and a boy are sitting at an altar both are holding bells.",
    ],
}


@pytest.fixture(scope="module")
def translators():
    return {name: load(name) for name in ("en-fr", "fr-en")}


def stutters(text: str) -> bool:
    return any(STUTTER.search(w) for w in text.split())


def token_loop(ids: list[int]) -> bool:
    """A unit of 1-4 tokens three times in a row."""
    return any(ids[i : i + k] == ids[i + k : i + 2 * k] == ids[i + 2 * k : i + 3 * k]
               for k in range(1, 5) for i in range(len(ids) - 3 * k + 1))  # fmt: skip


# byte-level BPE spelling: "Ġ" is a leading space, "Ã©" the two bytes of "é"
VOCAB = ["<pad>", "<s>", "</s>", "<unk>", "Ġgi", "gi", "g", "gig", "Ġs", "s", "ss", "ssk",
         "Ġthe", "Ġdog", "Ġ1", "0", "00", "Ġ4", "ĠÃ©", "Ã©", "Ġest", "est", "ab"]  # fmt: skip
ID = {t: i for i, t in enumerate(VOCAB)}


def banned(guard: RepeatGuard, *tokens: str) -> set[str]:
    out = guard.banned(torch.tensor([[ID[t] for t in tokens]]))
    return set() if out is None else {VOCAB[i] for i in out[1].tolist()}


def test_token_units_written_three_times_are_banned():
    g = RepeatGuard(VOCAB)
    assert banned(g, "Ġthe", "Ġest") == set()  # "est" twice is allowed ("estest")
    assert banned(g, "Ġthe", "Ġest", "Ġest") == {"Ġest"}  # not a third time
    assert "est" in banned(g, "Ġest", "est")  # nor inside a word: "estestest"
    assert banned(g, "Ġthe", "Ġdog", "Ġthe", "Ġdog", "Ġthe") == {"Ġdog"}  # a unit of 2
    assert banned(g, "Ġthe", "Ġdog", "Ġthe", "Ġdog") == set()
    assert banned(g, "Ġ1", "0", "0") == set()  # "1000": digits inside a number
    assert banned(g, "Ġ4", "Ġ4") == {"Ġ4"}  # "4 4 4" is a loop
    assert banned(RepeatGuard(), "Ġdog", "Ġdog") == {"Ġdog"}  # no vocabulary: tokens only


def test_letters_written_three_times_inside_a_word_are_banned():
    g = RepeatGuard(VOCAB)
    # "gigi": every token that starts with "gi" would make "gigigi"; "g" alone not yet
    assert banned(g, "Ġgi", "gi") == {"gi", "gig"}
    assert banned(g, "Ġs", "s") == {"s", "ss", "ssk"}  # "ss" + "s..." is "sss"
    assert banned(g, "Ġgi", "gi", "Ġthe") == set()  # a new word starts afresh
    assert banned(g, "ĠÃ©", "Ã©") == {"Ã©"}  # "éé" + "é": letters are characters, not bytes
    assert banned(g, "Ġ1", "00") == set()  # digits are not letters: "1000" is fine


def test_doctests():
    assert doctest.testmod(qkv.generate._repeat).failed == 0


@pytest.mark.parametrize("name", ["fr-en", "en-fr"])
@pytest.mark.parametrize("beam", [1, 5])
def test_inputs_that_stuttered_no_longer_do(translators, name, beam):
    tr = translators[name]
    tr.repeat_guard = tr.name_placeholders = False  # the guard alone (names would be copied)
    try:
        before = tr(LOOPS[name], beam=beam)
        tr.repeat_guard = True
        after = tr(LOOPS[name], beam=beam)
    finally:
        tr.repeat_guard = tr.name_placeholders = True
    assert sum(map(stutters, before)) >= len(before) // 2, before  # the inputs do stutter
    assert not any(map(stutters, after)), after
    # the generated tokens too: no unit of 1-4 tokens three times in a row
    ids = [tr.tokenizer.encode(s) + [tr.tokenizer.eos_id] for s in LOOPS[name]]
    src = torch.zeros(len(ids), max(map(len, ids)), dtype=torch.long)
    for i, s in enumerate(ids):
        src[i, : len(s)] = torch.tensor(s)
    guard = RepeatGuard.for_tokenizer(tr.tokenizer)
    if beam == 1:
        out = greedy_search(tr.model, src, no_repeat_ngram=4, repeat_guard=guard)
    else:
        out = beam_search(tr.model, src, beam_size=beam, no_repeat_ngram=4, repeat_guard=guard)
    for row in out.tolist():
        row = [t for t in row if t > 3]
        assert not token_loop(row), tr.tokenizer.decode(row)


@pytest.mark.skipif(default_data_dir() is None, reason="Multi30k not found")
@pytest.mark.parametrize("name", ["en-fr", "fr-en"])
def test_greedy_translations_without_a_loop_are_unchanged(translators, name):
    """Greedy decoding takes the most likely token; the guard only removes tokens that would
    complete a loop, so a translation that had none comes out the same."""
    tr = translators[name]
    src = [s for s, _ in multi30k("val", tr.src, tr.tgt)[:100]]
    tr.repeat_guard = False
    try:
        before = tr(src, beam=1)
    finally:
        tr.repeat_guard = True
    after = tr(src, beam=1)
    for b, a in zip(before, after):
        if not stutters(b) and not token_loop(tr.tokenizer.encode(b)):
            assert a == b


def test_numbers_go_through_placeholders():
    assert protect_numbers("At 10:45, 3 dogs and dog0 pass bus 38.") == (
        "At 5, 3 dogs and dog0 pass bus 4.", {"5": "10:45", "4": "38"})  # fmt: skip
    text, back = protect_numbers(" ".join(str(10 + i) for i in range(9)))
    assert text == "5 3 4 6 9 8 2 17 18" and len(back) == 7  # the placeholders ran out
    assert restore_numbers("numéro 5 et numéro 4", {"5": "10", "4": "38"}) == \
        "numéro 10 et numéro 38"  # fmt: skip
    assert restore_numbers("numéro 5 et numéro 5", {"5": "10", "4": "38"}) is None
    assert restore_numbers("numéro", {"5": "10"}) is None


@pytest.mark.parametrize(
    ("name", "text", "number"),
    [("en-fr", "A cyclist with number 213 rides up a hill.", "213"),
     ("fr-en", "Un coureur portant le numéro 42 franchit la ligne d'arrivée.", "42")],
)  # fmt: skip
def test_the_shipped_models_copy_numbers_through_placeholders(translators, name, text, number):
    tr = translators[name]
    tr.number_placeholders = False
    try:
        plain = tr(text)
    finally:
        tr.number_placeholders = True
    assert number not in re.findall(r"\d+", plain), plain  # "23", "122": copied wrong
    assert number in re.findall(r"\d+", tr(text))
