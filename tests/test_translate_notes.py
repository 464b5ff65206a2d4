"""Notes on input the shipped translators do not know (qkv.translate_notes): they fire on the
stress set (tests/data/translate_stress.tsv) and stay silent on ordinary captions."""

import doctest
import warnings
from pathlib import Path

import pytest
import torch

import qkv.translate_notes
from qkv.apps.cli import main
from qkv.data import default_data_dir, multi30k
from qkv.translate import load, warning_text
from qkv.translate_notes import guess_language, source_notes

torch.set_num_threads(1)

STRESS = Path(__file__).parent / "data" / "translate_stress.tsv"
KINDS = {"unseen", "numbers", "language", "question"}


def stress_rows() -> list[tuple[str, set[str], str]]:
    rows = []
    for line in STRESS.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            model, notes, text, _where = line.split("\t")
            rows.append((model, set() if notes == "-" else set(notes.split(",")), text))
    return rows


@pytest.fixture(scope="module")
def translators():
    return {name: load(name) for name in ("en-fr", "fr-en")}


def test_the_stress_set_is_what_it_says():
    rows = stress_rows()
    assert len(rows) >= 100 and all(notes <= KINDS for _, notes, _ in rows)
    for kind in KINDS:  # every kind, for both models
        assert {m for m, notes, _ in rows if kind in notes} == {"en-fr", "fr-en"}
    assert sum(not notes for _, notes, _ in rows) >= 20  # and ordinary sentences


def test_notes_fire_on_the_stress_set_and_only_there(translators):
    wrong = []
    for model, expected, text in stress_rows():
        tr = translators[model]
        got = {n["code"] for n in source_notes(tr.tokenizer, text, tr.src)}
        if not expected <= got or (not expected and got):
            wrong.append((model, text, sorted(expected), sorted(got)))
    assert wrong == []


@pytest.mark.skipif(default_data_dir() is None, reason="Multi30k not found")
@pytest.mark.parametrize("name", ["en-fr", "fr-en"])
def test_silent_on_ordinary_captions(translators, name):
    """Measured: 192 of the first 200 val sentences get no note, for each model (96%; the
    thresholds were tuned on val from sentence 200 on)."""
    tr = translators[name]
    src = [s for s, _ in multi30k("val", tr.src, tr.tgt)[:200]]
    silent = sum(not tr.check(s) for s in src)
    assert silent >= 0.95 * len(src), silent


def test_a_line_gets_one_note_naming_each_thing_that_is_unusual(translators, capsys):
    tr = translators["en-fr"]
    assert [n["code"] for n in tr.check("Where are the 12 dogs going?")] == ["numbers", "question"]
    assert tr.check("  ") == [] and tr.check("A dog runs on the beach.") == []
    notes = tr.check("Un chien court dans le parc.")
    assert notes == [{"code": "language", "looks": "fr", "reads": "en"}]
    assert warning_text(notes[0]) == "This looks like French, but this model reads English."
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr(["Where are the 12 dogs going?", "A dog runs on the beach."])
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and said[0].startswith("line 1: Numbers may be copied wrong")
    assert "A question" in said[0]
    assert main(["translate", "Miguel and Ana walk their dog in the park."]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("qkv translate: note: The model has not seen")
    assert "(Miguel, Ana)" in err[0]


def test_an_unseen_note_is_not_said_twice(translators):
    """Words falling apart into bytes give the "pieces" warning; "unseen" would repeat it."""
    codes = [n["code"] for n in translators["en-fr"].check("Xqzvb wkrtp jjzqx blorf vvqk.")]
    assert "pieces" in codes and "unseen" not in codes


def test_language_guess_and_doctests():
    assert guess_language("Ein Hund läuft im Park.") == {"en": 0, "fr": 0, "de": 4}
    assert guess_language("A dog runs in the park.")["en"] == 2  # "dog", "the"
    tok = load("en-fr").tokenizer
    assert source_notes(tok, "Un chien.", None) == []  # no source language: no language note
    assert doctest.testmod(qkv.translate_notes).failed == 0
