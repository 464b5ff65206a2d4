"""The in-page engine decodes with qkv translate's guards, in Debian's chromium: the shipped
fr-en model exported by ``qkv.apps.web.export``, run by ONNX Runtime Web, on a sentence it
stutters on without the RepeatGuard ("gicicicic", "rectctctctation"): the page's answer is
the server's (every field, every weight: ``engine_helpers.check``) and its translation is
``qkv translate``'s, greedy and beam 5; and a sentence with notes gets the server's notes."""

from __future__ import annotations

import re
import warnings

import pytest
from engine_helpers import build, check, harness, registry_entry

from serve_helpers import playwright_or_skip

playwright_or_skip()

# formal French, no name and no digit (qkv translate sends those through placeholders)
STUTTER = "Le gouvernement a annoncé des réformes constitutionnelles."
LOOP = re.compile(r"([^\W\d_]{1,4})\1\1")  # a unit of letters written 3 times in a row


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    with harness(build(tmp_path_factory, ["fr-en"])) as p:
        yield p


@pytest.fixture(scope="module")
def entry():
    with registry_entry("fr-en") as e:
        yield e


@pytest.mark.parametrize("beam", [1, 5])
def test_the_page_writes_what_qkv_translate_writes(page, entry, beam):
    from qkv.generate import translate as decode

    tr = entry.loaded.translator  # qkv.translate.load("fr-en"): what qkv translate runs
    unguarded = decode(tr.model, tr.tokenizer, [STUTTER], beam_size=beam,
                       no_repeat_ngram=tr.no_repeat_ngram)[0]  # fmt: skip
    assert LOOP.search(unguarded), unguarded
    ours = check(page, entry, {"text": STUTTER, "model": "fr-en", "translate": True, "beam": beam})
    text = ours["translation"]["text"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the sentence's note ("many pieces"), said on stderr
        command = tr(STUTTER, beam=beam)
    assert text == command and text != unguarded and not LOOP.search(text)


def test_the_page_notes_as_the_server(page, entry):
    body = {"text": "Jean et Marie promènent leur chien à 7 heures ?", "model": "fr-en",
            "translate": True}  # fmt: skip
    ours = check(page, entry, body)
    assert [w["code"] for w in ours["translation"]["warnings"]] == ["unseen", "numbers", "question"]
    assert ours["translation"]["warnings"] == entry.loaded.translator.check(body["text"])
