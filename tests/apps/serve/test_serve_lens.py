"""``POST /api/lens`` (the Lens view) through Starlette's TestClient: the same positions as
``/api/attention``'s answer, the last layer's lens equal to the model's own predictions
(the shipped en-fr's greedy output, a transformers Llama's logits), the attributions adding
up to the logit, heads switched off writing nothing, and every bad field a JSON 4xx."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("starlette")
pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")
from starlette.testclient import TestClient  # noqa: E402

import hf_tiny  # noqa: E402
from qkv.apps.serve.app import create_app  # noqa: E402
from qkv.apps.serve.compute_lens import MAX_TOP_K  # noqa: E402
from qkv.models.shipped import shipped_dir  # noqa: E402
from serve_helpers import one_thread, registry  # noqa: E402

BOY = "The boy trains the puppy."
WORDS = "the a boy girl dog puppy trains runs sees . , it was tired street".split()
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def _llama_dir(path, positions: int = 128):
    """A tiny random Llama with a word-level tokenizer (``<s>`` first), saved offline;
    ``positions``: its ``max_position_embeddings`` (the explorer's limit is one short)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
    )
    torch.manual_seed(0)
    hf_tiny.llama(len(vocab), positions).save_pretrained(path)
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _llama_dir(tmp_path_factory.mktemp("lens") / "llama")


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    """The same Llama with 4,096 positions: a text of 2,048 tokens (the long limit) fits."""
    return _llama_dir(tmp_path_factory.mktemp("lens") / "long", positions=4096)


@pytest.fixture(scope="module")
def causal_lm(tmp_path_factory):
    """A qkv CausalLM (random weights) saved with a small trained tokenizer."""
    from qkv.data import Tokenizer
    from qkv.models import CausalLM, TransformerConfig, save_pretrained

    tok = Tokenizer.train(["the boy trains the puppy", "a dog runs"] * 10, vocab_size=300)
    torch.manual_seed(0)
    cfg = TransformerConfig(src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size,
                            d_model=32, n_heads=4, d_ff=48, n_decoder_layers=2, dropout=0.0)  # fmt: skip
    lm = CausalLM(cfg).eval()
    return save_pretrained(lm, tmp_path_factory.mktemp("lens") / "lm", tokenizer=tok), lm


@pytest.fixture(scope="module")
def client(tmp_path_factory, llama, long_llama, causal_lm):
    reg = registry(tmp_path_factory.mktemp("serve-lens"))
    reg.add_dir("llama", llama)
    reg.add_dir("long", long_llama)
    reg.add_dir("lm", causal_lm[0])
    with one_thread(), TestClient(create_app(reg)) as c:
        yield c


def lens(client, **body):
    return client.post("/api/lens", json=body)


def test_translator_lens_matches_the_translation(client):
    a = client.post("/api/attention", json={"text": BOY, "model": "en-fr", "translate": True})
    tr = a.json()["translation"]
    r = lens(client, text=BOY, model="en-fr", translate=True)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["tokens"] == tr["decoder_inputs"] and d["translation"]["text"] == tr["text"]
    L = d["lens"]
    assert L["layers"] == ["embeddings", *(f"decoder.layers.{i}" for i in range(3))]
    assert L["top_k"] == 5 and len(L["tokens"]) == 4 and len(L["tokens"][0]) == len(d["tokens"])
    # the last layer's top token at each position is what greedy decoding wrote there
    assert [cell[0] for cell in L["tokens"][-1]] == tr["target_tokens"]
    assert all(
        p[0] >= p[1] >= 0 and sum(p) <= 1.001 for row in L["probs"] for p in row
    )  # top-k, sorted, probabilities
    assert d["position"] == len(d["tokens"]) - 1 and d["predicted"] == tr["target_tokens"][-1]
    dla = d["dla"]
    assert d["dla_unavailable"] is None and "frozen" in dla["note"]
    n_heads = json.loads((shipped_dir("en-fr") / "config.json").read_text())["config"]["n_heads"]
    assert len(dla["heads"]) == 3 * 2 * n_heads and dla["check"] < 1e-3
    kinds = {h["layer"].rsplit(".", 1)[1] for h in dla["heads"]}
    assert kinds == {"self_attn", "cross_attn"}
    names = {x["name"] for x in a.json()["layers"]}
    assert {h["layer"] for h in dla["heads"]} <= names  # the page finds each head's map
    total = sum(h["target"] for h in dla["heads"]) + sum(o["target"] for o in dla["others"])
    assert total == pytest.approx(d["logit"], abs=0.001 * (len(dla["heads"]) + 12))
    for h in dla["heads"]:
        assert len(h["up"]) == len(h["down"]) == 5
        assert h["up"][0][1] >= h["up"][-1][1] and h["down"][0][1] <= h["down"][-1][1]


def test_translator_lens_equals_the_library(client):
    """The JSON is the library's lens (qkv.inspect.lens, tested against its own references)
    on the decoder inputs the attention answer lists, rounded to 3 decimals."""
    from qkv.generate import greedy_search
    from qkv.inspect.lens import lens as library_lens
    from qkv.inspect.translation import piece_labels
    from qkv.models.shipped import shipped_dir
    from qkv.translate import load_translator

    d = lens(client, text=BOY, model="en-fr", translate=True, position=2, top_k=3).json()
    model, tok = load_translator(shipped_dir("en-fr"))
    src = torch.tensor([tok.encode(BOY) + [tok.eos_id]])  # (1, S)
    with torch.no_grad():
        out = greedy_search(model.eval(), src)[0].tolist()
    tgt = [model.cfg.bos_id, *out[: out.index(tok.eos_id)]]
    assert piece_labels(tok, tgt) == d["tokens"]  # the same decoder inputs
    ref = library_lens(model, src, torch.tensor([tgt]), position=2, top_k=3)
    assert d["position"] == 2
    probs = [[[round(p, 3) for p in r] for r in a] for a in ref.top_probs.tolist()]
    assert d["lens"]["probs"] == probs
    got = {(h["layer"], h["head"]): h["target"] for h in d["dla"]["heads"]}
    assert got == {(h.layer, h.head): round(h.target, 3) for h in ref.heads}


def test_decoder_only_lens_is_the_models_prediction(client, llama):
    a = client.post("/api/attention", json={"text": "the boy trains the puppy", "model": "llama"})
    r = lens(client, text="the boy trains the puppy", model="llama", top_k=MAX_TOP_K)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["tokens"] == a.json()["tokens"] == ["<s>", "the", "boy", "trains", "the", "puppy"]
    model = transformers.AutoModelForCausalLM.from_pretrained(llama, local_files_only=True)
    tok = transformers.AutoTokenizer.from_pretrained(llama, local_files_only=True)
    ids = tok("the boy trains the puppy", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model.eval()(input_ids=ids).logits[0]  # (T, V), transformers' own
    top = logits.softmax(-1).topk(MAX_TOP_K)
    want = [tok.convert_ids_to_tokens(row) for row in top.indices.tolist()]
    assert d["lens"]["tokens"][-1] == want
    torch.testing.assert_close(torch.tensor(d["lens"]["probs"][-1]), top.values, atol=6e-4, rtol=0)
    assert d["predicted"] == want[-1][0]
    assert len(d["dla"]["heads"]) == 2 * 4 and d["dla"]["check"] < 1e-3


def test_qkv_causal_lm_lens(client, causal_lm):
    a = client.post("/api/attention", json={"text": "the boy trains", "model": "lm"}).json()
    d = lens(client, text="the boy trains", model="lm", top_k=3).json()
    assert d["tokens"] == a["tokens"] and d["tokens"][0] == "<s>"
    from qkv.inspect.loaders import load

    loaded = load(str(causal_lm[0]))
    _, (ids,) = loaded.encode("the boy trains")
    with torch.no_grad():
        top = loaded.full_model(ids)[0].softmax(-1).topk(3)  # (T, 3), the model's own
    torch.testing.assert_close(torch.tensor(d["lens"]["probs"][-1]), top.values, atol=6e-4, rtol=0)
    assert len(d["dla"]["heads"]) == 2 * 4 and d["dla"]["check"] < 1e-3


def test_heads_switched_off_write_nothing(client):
    off = [["decoder.layers.0.self_attn", 1], ["decoder.layers.2.cross_attn", 3]]
    d = lens(client, text=BOY, model="en-fr", translate=True, ablate=off).json()
    heads = {(h["layer"], h["head"]): h for h in d["dla"]["heads"]}
    for layer, head in off:
        h = heads[(layer, head)]
        assert h["target"] == 0 and all(v == 0 for _, v in h["up"] + h["down"])
    assert heads[("decoder.layers.0.self_attn", 0)]["target"] != 0


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"model": "minilm"}, 400, "model: the lens reads a decoder"),
        ({"model": "random", "translate": True}, 400, "random-weight"),
        ({"model": "en-fr"}, 400, "translate must be true"),
        ({"model": "llama", "translate": True}, 400, "does not translate"),
        (
            {"model": "en-fr", "translate": True, "top_k": 11},
            400,
            "top_k must be an integer in [1, 10]",
        ),
        ({"model": "en-fr", "translate": True, "top_k": 0}, 400, "top_k"),
        (
            {"model": "en-fr", "translate": True, "position": "2"},
            400,
            "position must be an integer",
        ),
        ({"model": "en-fr", "translate": True, "position": True}, 400, "position"),
        ({"model": "en-fr", "translate": True, "position": 99}, 400, "position must be in [0, "),
        ({"model": "en-fr", "translate": True, "ablate": [["nope", 0]]}, 400, "ablate: no layer"),
        ({"model": "nope"}, 404, "nope"),
    ],
)
def test_bad_fields_are_json_4xx_naming_them(client, body, status, words):
    r = lens(client, text=BOY, **body)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]


def test_answer_stays_bounded(client):
    """A long paste: the positions stop at the translator's limit, every cell holds at most
    MAX_TOP_K tokens, and the answer is small."""
    text = " ".join(["A man in a blue shirt is riding a bike past the old red house."] * 40)
    r = lens(client, text=text, model="en-fr", translate=True, top_k=MAX_TOP_K)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["truncated"] is True and len(d["tokens"]) <= 80 + 1
    assert all(len(c) == MAX_TOP_K for row in d["lens"]["tokens"] for c in row)
    assert len(json.dumps(d)) < 1_000_000


def test_a_long_text_is_read_to_the_long_limit(client, long_llama):
    """2,000 words and more on a decoder-only model: the lens reads 2,048 positions (as the
    maps do), its last row at a position far past 128 is the model's own argmax there, the
    attribution is at that position, and the answer stays small (top-k per cell)."""
    text = " ".join(WORDS[i * 7 % len(WORDS)] for i in range(2100))
    a = client.post("/api/attention", json={"text": text, "model": "long"}).json()
    r = lens(client, text=text, model="long", position=1500)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["tokens"] == a["tokens"] and len(d["tokens"]) == 2048 and d["limit"] == 2048
    assert d["truncated"] is True and d["positions"] == 4096
    model = transformers.AutoModelForCausalLM.from_pretrained(long_llama, local_files_only=True)
    tok = transformers.AutoTokenizer.from_pretrained(long_llama, local_files_only=True)
    ids = tok(d["text"], return_tensors="pt")["input_ids"]
    assert ids.shape[1] == 2048
    with torch.no_grad():
        want = model.eval()(input_ids=ids).logits[0].argmax(-1)  # (T,), transformers' own
    L = d["lens"]
    assert len(L["tokens"]) == 3 and all(len(row) == 2048 for row in L["tokens"])
    for pos in (200, 1500, 2047):
        assert L["tokens"][-1][pos][0] == tok.convert_ids_to_tokens(int(want[pos]))
    assert d["position"] == 1500 and d["predicted"] == tok.convert_ids_to_tokens(int(want[1500]))
    assert len(d["dla"]["heads"]) == 2 * 4 and d["dla"]["check"] < 1e-3
    # bounded: (layers + 1) × positions × top_k tokens, ~30 bytes each with its probability
    assert len(r.content) < 3 * 2048 * 5 * 30
    assert lens(client, text=text, model="long", position=2048).status_code == 400


def test_a_long_text_stops_at_the_models_positions(client):
    """A qkv causal LM of 256 positions: the text is cut one short of them, as in the maps."""
    text = " ".join(["the boy trains the puppy"] * 400)
    a = client.post("/api/attention", json={"text": text, "model": "lm"}).json()
    d = lens(client, text=text, model="lm", position=200).json()
    assert d["tokens"] == a["tokens"] and len(d["tokens"]) <= 255 < 256 == d["positions"]
    assert d["truncated"] is True and d["limit"] == a["limit"] == 255 and d["position"] == 200
