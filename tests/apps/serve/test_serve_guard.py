"""``qkv serve`` translates as ``qkv translate`` does: the same guards (no_repeat_ngram and the
RepeatGuard, from the model's Translator), so a sentence the fr-en model stutters on
without the guard gets the command's guarded translation from the API, greedy and beam; and
the API's notes are those of ``Translator.check``."""

from __future__ import annotations

import os
import re

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("starlette")
pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402

from qkv.apps.cli import main  # noqa: E402
from qkv.apps.serve.app import create_app  # noqa: E402
from qkv.apps.serve.models import default_registry  # noqa: E402
from serve_helpers import one_thread  # noqa: E402

# Formal French, no name and no digit (qkv translate sends those through placeholders): the
# fr-en model writes "The Poticicic is praying a decorative decorative area." (greedy) and
# "The farmer is weigigighing an almark." (beam 5) without the guard
STUTTER = "Le ministère préconise une décentralisation administrative."
LOOP = re.compile(r"([^\W\d_]{1,4})\1\1")  # a unit of letters written 3 times in a row


@pytest.fixture(scope="module")
def client():
    with one_thread(), TestClient(create_app(default_registry())) as c:
        yield c


def translate(client, text: str, beam: int, model: str = "fr-en") -> dict:
    r = client.post("/api/attention", json={"text": text, "model": model, "translate": True,
                                            "beam": beam})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["translation"]


@pytest.mark.parametrize("beam", [1, 5])
def test_the_api_writes_what_qkv_translate_writes_and_no_stutter(client, capsys, beam):
    from qkv.generate import translate as decode
    from qkv.translate import load

    tr = load("fr-en")
    assert tr.length_penalty == 1.0  # the explorer's; fr-en's own too: beam 5 is comparable
    unguarded = decode(tr.model, tr.tokenizer, [STUTTER], beam_size=beam,
                       no_repeat_ngram=tr.no_repeat_ngram)[0]  # fmt: skip
    assert LOOP.search(unguarded), unguarded  # the sentence does stutter without the guard
    capsys.readouterr()
    assert main(["translate", "--model", "fr-en", "--beam", str(beam), STUTTER]) == 0
    command = capsys.readouterr().out.strip()
    api = translate(client, STUTTER, beam)
    assert api["text"] == command and api["text"] != unguarded
    assert not LOOP.search(api["text"]), api["text"]
    if beam > 1:  # every hypothesis the table shows is guarded too
        assert api["beams"] and not any(LOOP.search(b["text"]) for b in api["beams"])
        assert api["greedy_text"] == translate(client, STUTTER, 1)["text"]


@pytest.mark.parametrize(("model", "text", "codes"), [
    ("en-fr", "John and Maria walk their dog at 7 o'clock?", ["unseen", "numbers", "question"]),
    ("en-fr", "Un homme et une femme marchent avec le chien.", ["language"]),
    ("fr-en", STUTTER, ["pieces"]),
    ("fr-en", "Un chien court dans l'herbe.", []),
])  # fmt: skip
def test_the_api_notes_are_translator_check(client, model, text, codes):
    from qkv.translate import load, warning_text

    tr = load(model)
    out = translate(client, text, 1, model)
    assert [w["code"] for w in out["warnings"]] == codes
    assert out["warnings"] == tr.check(text)
    assert out["note"] == (" ".join(map(warning_text, tr.check(text))) or None)


def test_a_translator_directory_decodes_with_its_own_settings(tmp_path):
    """``--model NAME=DIR``: a qkv translator directory is read by qkv.translate.load, so its
    generation.json's guards hold in the explorer as in ``qkv translate --model DIR``."""
    import json
    import shutil

    from qkv.apps.serve.compute import attention
    from qkv.apps.serve.limits import parse_request
    from qkv.apps.serve.models import Registry
    from qkv.models.shipped import shipped_dir

    d = tmp_path / "fr-en-noguard"
    shutil.copytree(shipped_dir("fr-en"), d)
    gen = json.loads((d / "generation.json").read_text())
    (d / "generation.json").write_text(json.dumps({**gen, "repeat_guard": False}))
    reg = Registry()
    reg.add_dir("plain", d)
    entry = reg.get("plain")
    assert entry.loaded.translator.repeat_guard is False
    with torch.no_grad():
        out = attention(entry, parse_request({"text": STUTTER, "model": "plain", "translate": True}))
    assert LOOP.search(out["translation"]["text"])  # its own setting: no guard, the stutter
