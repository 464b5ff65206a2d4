"""The in-page engine on the other models, against the Python API in Debian's chromium (as
test_engine_translate.py does for en-fr): the tiny random model (its encoder view and its
translation, heads off, the probe), all-MiniLM-L6-v2 in fp32 (the
pronoun probe of the notes' sentence) and fr-en (a greedy translation; a sentence it
stutters on without qkv translate's RepeatGuard, greedy and beam 5, written as qkv translate
writes it; a sentence's notes as the server's)."""

from __future__ import annotations

import re
import warnings

import pytest
from engine_helpers import build, check, harness, lens_refusal, registry_entry

from serve_helpers import playwright_or_skip

playwright_or_skip()

IT = "The animal didn't cross the street because it was too tired."
# formal French, no name and no digit (qkv translate sends those through placeholders): fr-en
# writes "Poticicic" (greedy), "weigigighing" (beam 5) without the RepeatGuard
STUTTER = "Le ministère préconise une décentralisation administrative."
LOOP = re.compile(r"([^\W\d_]{1,4})\1\1")  # a unit of letters written 3 times in a row


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return build(tmp_path_factory, ["random", "minilm", "fr-en"])


@pytest.fixture(scope="module")
def page(site):
    with harness(site) as p:
        yield p


def test_files_small_and_in_the_precision_python_uses(site):
    """No file over 95 MB; MiniLM's weights in fp32, fr-en's in fp16 as shipped (4 and 2
    bytes a parameter, give or take the small tensors kept inside the graphs)."""
    import torch

    from qkv.apps.web.export import MAX_FILE_BYTES
    from qkv.inspect.loaders import load
    from qkv.translate import load as load_translator

    assert max(f.stat().st_size for f in site.rglob("*") if f.is_file()) <= MAX_FILE_BYTES
    params = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    minilm = (site / "models" / "minilm" / "weights.bin").stat().st_size
    assert 0.98 < minilm / (4 * params(load("minilm").model)) <= 1.0
    fr_en = load_translator("fr-en").model
    assert all(p.dtype == torch.float32 for p in fr_en.parameters())  # widened from fp16
    assert 0.98 < (site / "models" / "fr-en" / "weights.bin").stat().st_size / (2 * params(fr_en)) <= 1.01


@pytest.mark.parametrize("body", [
    {"text": "The boy trains the puppy.", "model": "random"},
    {"text": IT, "model": "random", "layer": "encoder.layers.1.self_attn", "head": 3,
     "ablate": [["encoder.layers.0.self_attn", 1]],
     "probe": {"token": "it", "candidates": ["animal", "street"]}},
    {"text": "The boy trains the puppy.", "model": "random", "translate": True},
    {"text": IT, "model": "random", "translate": True, "layer": "decoder.layers.1.self_attn",
     "head": 2, "ablate": [["decoder.layers.0.cross_attn", 0]]},
    {"text": " ".join(["The dog runs after a red ball in the park."] * 22), "model": "random",
     "layer": "encoder.layers.1.self_attn", "head": 2},
], ids=["encoder", "encoder-heads-off-probe", "translation", "translation-heads-off",
        "long"])  # fmt: skip
def test_random_model_as_python(page, body):
    with registry_entry("random") as entry:
        check(page, entry, body)


LONG = ("A man in a blue shirt is riding a red bike down the long street with his small brown "
        "dog next to the old market. Two women sit on a bench in the park and talk while "
        "children play football on the grass behind them near the river. " * 3)


@pytest.mark.parametrize("piece", [0, 4])
def test_long_translation_in_pieces_as_python(page, piece):
    """A text past the maps' limit is split as the server splits it, every piece translated,
    the maps those of the piece asked for."""
    with registry_entry("random") as entry:
        ours = check(page, entry, {"text": LONG, "model": "random", "translate": True,
                                   "piece": piece})  # fmt: skip
    assert len(ours["translation"]["pieces"]) > 4 and ours["translation"]["piece"] == piece


def test_harness_loads_the_engine_scripts():
    """engine_harness.html loads qkv.apps.web.export.ENGINE_SCRIPTS, in their order."""
    import re
    from pathlib import Path

    from qkv.apps.web.export import ENGINE_SCRIPTS

    html = (Path(__file__).parent / "engine_harness.html").read_text()
    scripts = re.findall(r'<script src="([^"]+)"></script>', html)
    assert [s for s in scripts if s not in ("engine.js", "engine_harness.js")] == ENGINE_SCRIPTS


def test_minilm_as_python(page):
    with registry_entry("minilm") as entry:
        ours = check(page, entry, {"text": IT, "model": "minilm", "layer": "encoder.layers.4.self_attn",
                                   "head": 11, "probe": {"token": "it", "candidates": ["animal", "street"]}})
    assert ours["probe"]["rows"], "the probe found the pronoun"


# the notes' sentence in the five scripts the notes are written in
FIVE_SCRIPTS = ["The boy trains the puppy.", "ကောင်လေးက ခွေးကလေးကို လေ့ကျင့်ပေးတယ်။",
                "Cậu bé huấn luyện chú chó con.", "ছেলেটি কুকুরছানাকে প্রশিক্ষণ দেয়।", "男孩训练小狗。"]  # fmt: skip


@pytest.mark.parametrize("text", FIVE_SCRIPTS)
def test_minilm_in_five_scripts_as_python(page, text):
    """MiniLM's tokens and every weight of every layer and head on the notes' sentence in
    English, Burmese, Vietnamese, Bengali and Chinese."""
    with registry_entry("minilm") as entry:
        ours = check(page, entry, {"text": text, "model": "minilm"})
    assert len(ours["tokens"]) > 3


def test_minilm_long_as_python(page):
    """MiniLM past 66 tokens: a long answer (pooled maps, the selected head packed)."""
    with registry_entry("minilm") as entry:
        ours = check(page, entry, {"text": " ".join([IT] * 6), "model": "minilm"})
    assert ours["layers"][0]["pooled"]["k"] > 1 and ours["exact"]["enc"] == "u16"


def test_fr_en_greedy_as_python(page):
    with registry_entry("fr-en") as entry:
        ours = check(page, entry, {"text": "Deux chiens jouent dans la neige.", "model": "fr-en",
                                   "translate": True})
    assert ours["translation"]["text"]


@pytest.mark.parametrize("beam", [1, 5])
def test_fr_en_writes_what_qkv_translate_writes(page, beam):
    """The page's guards are qkv translate's: the server's answer (every field, every weight),
    qkv translate's translation, no stutter."""
    from qkv.generate import translate as decode

    with registry_entry("fr-en") as entry:
        tr = entry.loaded.translator  # qkv.translate.load("fr-en"): what qkv translate runs
        unguarded = decode(tr.model, tr.tokenizer, [STUTTER], beam_size=beam,
                           no_repeat_ngram=tr.no_repeat_ngram)[0]  # fmt: skip
        assert LOOP.search(unguarded), unguarded
        body = {"text": STUTTER, "model": "fr-en", "translate": True, "beam": beam}
        text = check(page, entry, body)["translation"]["text"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the sentence's note ("many pieces"), said on stderr
        command = tr(STUTTER, beam=beam)
    assert text == command and text != unguarded and not LOOP.search(text)


def test_fr_en_notes_as_the_server(page):
    body = {"text": "Jean et Marie promènent leur chien à 7 heures ?", "model": "fr-en",
            "translate": True}  # fmt: skip
    with registry_entry("fr-en") as entry:
        notes = check(page, entry, body)["translation"]["warnings"]
        assert notes == entry.loaded.translator.check(body["text"])
    assert [n["code"] for n in notes] == ["unseen", "numbers", "question"]


def test_health_as_the_server(page):
    """The models and limits the server's /api/health gives: the site's models (this one has
    no en-fr), named by their manifests."""
    from qkv.apps.serve import limits
    from qkv.apps.serve.models import default_registry

    ours = page.evaluate("window.engine.health()")
    assert [{**m, "loaded": False} for m in ours["models"]] == \
        [m for m in default_registry().info() if m["name"] != "en-fr"]  # fmt: skip
    assert ours["limits"] == {
        "tokens": limits.TOKEN_LIMIT, "translate_tokens": limits.TRANSLATE_LIMIT,
        "body_bytes": limits.MAX_BODY_BYTES, "cells": limits.MAX_CELLS, "beam": limits.MAX_BEAM,
        "long_tokens": limits.LONG_TOKEN_LIMIT, "long_bytes": limits.MAX_LONG_BYTES,
        "pieces": limits.MAX_PIECES}  # fmt: skip
    assert limits.target_limit(10**6) == 80  # the engine's TARGET_LIMIT


@pytest.mark.parametrize("name", ["minilm", "random"])
def test_lens_refused_as_the_server(page, name):
    """The lens reads a translator's decoder: MiniLM and the random model are refused, with the
    server's status and message."""
    from qkv.apps.serve.compute_lens import lens_answer, parse_lens
    from qkv.apps.serve.limits import BadRequest

    body = {"text": "A dog runs.", "model": name, "translate": name == "random"}
    with registry_entry(name) as entry, pytest.raises(BadRequest) as err:
        lens_answer(entry, parse_lens(body))
    ours = lens_refusal(page, body)
    assert ours == [400, str(err.value)]


def test_requests_at_once_as_one_by_one(page):
    """The page asks for A and B at once when comparing: answers as if asked one by one
    (ONNX Runtime's WebAssembly runs one call at a time; interleaved, it failed)."""
    from qkv.apps.serve.compute import attention
    from qkv.apps.serve.limits import parse_request

    bodies = [{"text": t, "model": m, "translate": m != "minilm"}
              for t, m in (("The boy trains the puppy.", "random"), ("A dog runs.", "random"),
                           ("Un chien court.", "fr-en"), ("A dog.", "minilm"))]  # fmt: skip
    ours = page.evaluate("(bodies) => Promise.all(bodies.map((b) => window.engine.attention(b)))",
                         bodies)  # fmt: skip
    for body, got in zip(bodies, ours, strict=True):
        with registry_entry(body["model"]) as entry:
            want = attention(entry, parse_request(body))
        assert got["tokens"] == want["tokens"]
        assert (got.get("translation") or {}).get("text") == (want.get("translation") or {}).get("text")
