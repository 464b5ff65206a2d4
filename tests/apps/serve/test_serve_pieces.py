"""``POST /api/attention`` with ``translate`` on a text longer than the maps' source limit:
split as ``qkv translate`` splits a long line (:func:`qkv.limits.split_to_fit`), every piece
translated and the translations joined, the maps of one piece (``piece``); for qkv's
translators, the random toy and a transformers encoder-decoder alike."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("starlette")
pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402

from qkv.apps.serve.app import create_app  # noqa: E402
from qkv.apps.serve.limits import MAX_PIECES  # noqa: E402
from qkv.limits import split_to_fit  # noqa: E402
from serve_helpers import one_thread, registry  # noqa: E402

# 41 words, 51 tokens for en-fr: one sentence longer than the 48 source tokens its maps hold
# (it used to be cut after "across the", and its translation looped on the cut clause)
LONG = ("Several enthusiastic tourists wearing colorful backpacks are photographing the "
        "magnificent cathedral while street musicians perform traditional melodies, elderly "
        "vendors arrange baskets of oranges, and curious children chase pigeons across the "
        "crowded marketplace, admiring all the fresh fruit, watching everything around them.")  # fmt: skip
HF_WORDS = "the a boy girl dog puppy trains runs sees . , it was tired street animal".split()


def _marian_dir(root):
    """A tiny random Marian model with a word-level tokenizer (no downloads)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    import hf_tiny

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + HF_WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
        eos_token="</s>",
    )  # fmt: skip
    torch.manual_seed(0)
    hf_tiny.marian(len(vocab)).eval().save_pretrained(root / "marian")
    fast.save_pretrained(root / "marian")
    return root / "marian"


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-pieces")
    reg = registry(root, minilm=False)
    reg.add_dir("marian", _marian_dir(root))
    return reg


@pytest.fixture(scope="module")
def client(reg):
    with one_thread(), TestClient(create_app(reg)) as c:
        yield c


def post(client, **body) -> dict:
    r = client.post("/api/attention", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_long_sentence_is_split_as_qkv_translate_splits_it(client, reg):
    d = post(client, text=LONG, model="en-fr", translate=True)
    tr, limit = d["translation"], d["limit"]
    encode = reg.get("en-fr").loaded.encode  # tokens with </s>, as the maps count them
    count = lambda s: len(encode(s)[0])  # noqa: E731
    assert count(LONG) > limit == 48
    want = split_to_fit(LONG, limit, count)  # the function qkv translate splits a line with
    assert [p["source"] for p in tr["pieces"]] == want and len(want) == 2
    assert " ".join(want).split() == LONG.split()  # nothing dropped
    assert all(count(p) <= limit for p in want)
    assert tr["text"] == " ".join(p["text"] for p in tr["pieces"])
    assert d["truncated"] is False and "translated in 2 pieces" in d["notice"]
    assert d["text"] == want[0] and tr["piece"] == 0 and d["tokens"] == encode(want[0])[0]
    for p in tr["pieces"]:  # each piece translated as if it were sent alone
        assert (
            post(client, text=p["source"], model="en-fr", translate=True)["translation"]["text"]
            == p["text"]
        )
    # the maps of the second piece; the translation is the whole text's still
    two = post(client, text=LONG, model="en-fr", translate=True, piece=1)
    assert two["text"] == want[1] and two["translation"]["piece"] == 1
    assert two["translation"]["text"] == tr["text"]
    assert two["layers"][-1]["k_tokens"] == encode(want[1])[0]  # cross-attention: its source
    # a piece past the last shows the last; the field itself is bounded
    assert post(client, text=LONG, model="en-fr", translate=True, piece=5)["text"] == want[1]
    r = client.post("/api/attention", json={"text": LONG, "model": "en-fr", "translate": True,
                                            "piece": MAX_PIECES})  # fmt: skip
    assert r.status_code == 400 and "piece" in r.json()["error"]
    # a text that fits is one piece, as before
    short = post(client, text="The boy trains the puppy.", model="en-fr", translate=True)
    assert short["translation"]["pieces"] == [] and short["notice"] is None


def test_beam_greedy_and_heads_off_cover_every_piece(client):
    d = post(client, text=LONG, model="en-fr", translate=True, beam=2,
             ablate=[["decoder.layers.0.self_attn", 0]])  # fmt: skip
    tr = d["translation"]
    assert len(tr["pieces"]) == 2 and tr["text"] == " ".join(p["text"] for p in tr["pieces"])
    alone = [post(client, text=p["source"], model="en-fr", translate=True, beam=2,
                  ablate=[["decoder.layers.0.self_attn", 0]]) for p in tr["pieces"]]  # fmt: skip
    assert tr["greedy_text"] == " ".join(a["translation"]["greedy_text"] for a in alone)
    base = " ".join(a["ablation"]["baseline"]["translation"] for a in alone)
    assert d["ablation"]["baseline"]["translation"] == base


def test_at_most_max_pieces_then_the_rest_is_cut(client):
    text = " ".join(f"word{i % 50}." for i in range(3000))  # 3,000 one-word sentences
    d = post(client, text=text, model="tiny-fr", translate=True)
    tr = d["translation"]
    assert len(tr["pieces"]) == MAX_PIECES and d["truncated"] is True
    assert "left out" in d["notice"]
    joined = " ".join(p["source"] for p in tr["pieces"]).split()
    assert joined == text.split()[: len(joined)]  # the first pieces, in order


@pytest.mark.parametrize("model", ["random", "marian"])
def test_other_translators_split_too(client, reg, model):
    words = [w for w in HF_WORDS if w.isalpha()] if model == "marian" else ["the", "dog", "runs"]
    # four sentences of 20 words (the tiny Marian has 64 positions: a piece of the maps' 48
    # source tokens could decode past them)
    text = " ".join(
        " ".join(words[(i + j) % len(words)] for j in range(20)) + " ." for i in range(4)
    )
    d = post(client, text=text, model=model, translate=True)
    tr = d["translation"]
    assert len(tr["pieces"]) >= 2 and d["truncated"] is False
    assert " ".join(p["source"] for p in tr["pieces"]).split() == text.split()
    assert tr["text"] == " ".join(p["text"] for p in tr["pieces"])
    assert len(d["tokens"]) <= d["limit"]
    last = post(client, text=text, model=model, translate=True, piece=len(tr["pieces"]) - 1)
    assert last["text"] == tr["pieces"][-1]["source"] and last["translation"]["text"] == tr["text"]
    assert json.dumps(d)  # plain JSON
