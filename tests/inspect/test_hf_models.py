"""``qkv view/heads --model DIR`` and ``qkv serve --model NAME=DIR`` on local transformers models.

Tiny random models (Llama decoder, BERT encoder, Marian encoder-decoder) are built from
configs and saved with a word-level tokenizer into temporary directories (nothing
downloads); the maps are checked against the same weights run by transformers' own "eager"
attention with ``output_attentions=True``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing downloads
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("starlette")
pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402

import hf_tiny  # noqa: E402
from qkv.apps.cli import main  # noqa: E402
from qkv.apps.serve.app import create_app  # noqa: E402
from qkv.apps.serve.limits import target_limit  # noqa: E402
from qkv.apps.serve.models import default_registry  # noqa: E402
from qkv.inspect.loaders import load  # noqa: E402
from serve_helpers import chromium, one_thread, open_page, running_server  # noqa: E402

TOL = 1e-5
TEXT = "the boy trains the puppy ."
WORDS = "the a boy girl dog puppy trains runs sees . , it was tired street animal le chien".split()
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "[CLS]", "[SEP]", "[MASK]"]


def _tokenizer(bert: bool = False):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bert:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 4), ("[SEP]", 5)]
        )
    else:  # a source / a prompt ends with </s> (seq2seq) or starts with <s> (decoder)
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
        )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
        eos_token="</s>", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
    )  # fmt: skip


V = len(SPECIALS) + len(WORDS)


def _llama():
    return hf_tiny.llama(V)


def _bert():
    return hf_tiny.bert(V)


def _roberta():  # an encoder that is not BERT: runs through qkv.hf
    cfg = transformers.RobertaConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    return transformers.RobertaModel(cfg)


def _marian():
    return hf_tiny.marian(V)


BUILDERS = {"llama": _llama, "bert": _bert, "roberta": _roberta, "marian": _marian}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfdirs")
    out = {}
    for name, build in BUILDERS.items():
        torch.manual_seed(0)
        model = build().eval()
        if name == "marian":  # no eos among the first steps: a few tokens are generated
            with torch.no_grad():
                model.final_logits_bias[0, 2] = -1e4
        path = root / name
        model.save_pretrained(path)
        _tokenizer(bert=name == "bert").save_pretrained(path)
        out[name] = path
    return out


def _eager(path, kind):
    auto = {"llama": transformers.AutoModelForCausalLM, "roberta": transformers.AutoModel,
            "marian": transformers.AutoModelForSeq2SeqLM}[kind]  # fmt: skip
    return auto.from_pretrained(path, local_files_only=True, attn_implementation="eager").eval()


@pytest.mark.parametrize("name", ["llama", "bert", "roberta", "marian"])
def test_view_writes_the_page(dirs, name, tmp_path):
    out = tmp_path / f"{name}.html"
    assert main(["view", TEXT, "--model", str(dirs[name]), "--out", str(out)]) == 0
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and 'id="qkv-data"' in page and "puppy" in page


def test_view_translate_seq2seq(dirs, tmp_path):
    out = tmp_path / "tr.html"
    argv = ["view", "--model", str(dirs["marian"]), "--translate", TEXT, "--out", str(out)]
    assert main(argv) == 0
    assert "cross" in out.read_text()


def test_view_translate_refused_for_decoder(dirs, tmp_path, capsys):
    out = tmp_path / "no.html"
    argv = ["view", "--model", str(dirs["llama"]), "--translate", TEXT, "--out", str(out)]
    assert main(argv) == 2
    assert "does not translate" in capsys.readouterr().err and not out.exists()


def test_loader_order_and_kinds(dirs):
    from qkv.pretrained import BertModel

    assert isinstance(load(str(dirs["bert"])).model, BertModel)  # BERT stays qkv's own
    llama, marian = load(str(dirs["llama"])), load(str(dirs["marian"]))
    assert (llama.hf.kind, marian.hf.kind) == ("decoder", "encoder-decoder")
    assert load(str(dirs["roberta"])).hf.kind == "encoder"
    assert llama.translate is None and marian.translate is not None


@pytest.mark.parametrize("name", ["llama", "roberta", "marian"])
def test_maps_equal_eager_output_attentions(dirs, name):
    loaded = load(str(dirs[name]))
    tokens, (ids, mask) = loaded.encode(TEXT)
    maps = loaded.maps(ids, mask, tokens=tokens)
    eager = _eager(dirs[name], name)
    with torch.no_grad():
        if name == "marian":
            ref = eager(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.tensor([[0]]),
                        output_attentions=True).encoder_attentions  # fmt: skip
        else:
            ref = eager(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert len(maps) == len(ref) == 2
    want = "causal" if name == "llama" else "self"
    for w, r, kind in zip(maps.weights, ref, maps.kinds, strict=True):
        assert kind == want and w.shape == r[0].shape
        torch.testing.assert_close(w, r[0], atol=TOL, rtol=0)
    assert maps.q_tokens[0] == tokens == ["<s>", *TEXT.split(), "</s>"]


def test_translation_maps_equal_eager(dirs):
    from qkv.inspect.hf_models import translate_hf  # what loaded.translate runs

    loaded = load(str(dirs["marian"]))
    maps = translate_hf(loaded, TEXT, max_new_tokens=12)["maps"]
    eager = _eager(dirs["marian"], "marian")
    _, (ids, mask) = loaded.encode(TEXT)
    with torch.no_grad():
        seq = eager.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12,
                             do_sample=False, num_beams=1)  # fmt: skip
        ref = eager(input_ids=ids, attention_mask=mask, decoder_input_ids=seq[:, :-1],
                    output_attentions=True)  # teacher-forced: the same rows  # fmt: skip
    cross = maps.filter(kind="cross")
    causal = maps.filter(kind="causal")
    assert len(cross) == len(causal) == 2 and seq.shape[1] > 2
    for w, r in zip(cross.weights, ref.cross_attentions, strict=True):
        torch.testing.assert_close(w, r[0], atol=TOL, rtol=0)  # (H, T_tgt, S)
    for w, r in zip(causal.weights, ref.decoder_attentions, strict=True):
        torch.testing.assert_close(w, r[0], atol=TOL, rtol=0)  # (H, T_tgt, T_tgt)


def _eager_heads_off(path, kind, layer: str, head: int, proj: str):
    """Eager reference with ``head`` of ``layer`` off: its columns of the output projection
    zeroed (the head's output then reaches nothing), on a fresh copy of the weights."""
    model = _eager(path, kind)
    w = model.get_submodule(f"{layer}.{proj}").weight  # (d_model, h·d)
    d = w.shape[1] // 4  # the tiny models have 4 heads
    with torch.no_grad():
        w[:, head * d : (head + 1) * d] = 0.0
    return model


def test_heads_off_equals_zeroed_output_projection(dirs):
    from qkv.hf import heads_off

    loaded = load(str(dirs["llama"]))
    tokens, (ids, mask) = loaded.encode(TEXT)
    ref = _eager_heads_off(dirs["llama"], "llama", "model.layers.0.self_attn", 1, "o_proj")
    with torch.no_grad():
        want = ref(input_ids=ids, output_attentions=True, output_hidden_states=True)
        with heads_off(loaded.model, {"model.layers.0.self_attn": [1]}):
            maps = loaded.maps(ids, mask, tokens=tokens)
            got = loaded.hidden(ids, mask)
        plain = loaded.hidden(ids, mask)
    torch.testing.assert_close(got, want.hidden_states[-1], atol=TOL, rtol=0)
    torch.testing.assert_close(maps.weights[1], want.attentions[1][0], atol=TOL, rtol=0)
    assert float((plain - got).abs().max()) > 1e-3  # the switch changed something
    with pytest.raises(ValueError, match="heads \\[4\\] out of range"):
        with heads_off(loaded.model, {0: [4]}):
            pass


def test_heads_cli(dirs, capsys):
    assert main(["heads", TEXT, "--model", str(dirs["llama"])]) == 0
    assert "head statistics" in capsys.readouterr().out
    argv = ["heads", TEXT, "--model", str(dirs["llama"]), "--token", "puppy", "--candidates",
            "boy", "the", "--ablate"]  # fmt: skip
    assert main(argv) == 0  # one head off at a time, every layer
    out = capsys.readouterr().out
    assert "one head off at a time" in out and "model.layers.1.self_attn" in out
    assert main([*argv, "model.layers.0.self_attn:0,2"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "with {'model.layers.0.self_attn': [0, 2]} off" in out


@pytest.fixture(scope="module")
def client(dirs):
    reg = default_registry({"llama": str(dirs["llama"]), "marian": str(dirs["marian"])})
    reg._entries.pop("minilm")
    with one_thread(), TestClient(create_app(reg)) as c:
        yield c


def post(client, **body):
    return client.post("/api/attention", json=body)


def test_serve_decoder_maps(client, dirs):
    info = {m["name"]: m for m in client.get("/api/health").json()["models"]}
    assert info["marian"]["translator"] is True and info["llama"]["translator"] is False
    r = post(client, text=TEXT, model="llama")
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["step_unavailable"] is None
    assert d["tokens"] == ["<s>", *TEXT.split(), "</s>"]
    _check_step(d)
    loaded = load(str(dirs["llama"]))
    _, (ids, mask) = loaded.encode(TEXT)
    with torch.no_grad():
        ref = _eager(dirs["llama"], "llama")(input_ids=ids, output_attentions=True).attentions
    assert [x["kind"] for x in d["layers"]] == ["causal", "causal"]
    for lay, r in zip(d["layers"], ref, strict=True):  # the API rounds to 3 decimals
        torch.testing.assert_close(torch.tensor(lay["weights"]), r[0], atol=6e-4, rtol=0)
    assert len(d["stats"]) == 8


def _check_step(d):
    """The step-by-step replay: every stage, its weights = the captured map of that head, and
    the replay gives back the module's output (``check``)."""
    st = d["step"]
    keys = [m["key"] for m in st["matrices"]]
    assert keys[:1] == ["x"] and {"q", "k", "v", "scores", "scaled", "mask", "masked",
                                  "weights", "output", "concat", "wo"} <= set(keys)  # fmt: skip
    assert st["check"] is not None and st["check"] < 1e-4
    layer = next(x for x in d["layers"] if x["name"] == st["layer"])
    weights = next(m for m in st["matrices"] if m["key"] == "weights")
    head = layer["heads"].index(st["head"]) if "heads" in layer else st["head"]
    assert weights["values"] == layer["weights"][head]
    assert weights["rows"] == layer["q_tokens"] and weights["cols"] == layer["k_tokens"]


def test_serve_translation_has_cross_attention(client):
    r = post(client, text=TEXT, model="marian", translate=True)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["step_unavailable"] is None
    _check_step(d)
    for layer in ("model.decoder.layers.1.encoder_attn", "model.decoder.layers.0.self_attn"):
        d2 = post(client, text=TEXT, model="marian", translate=True, layer=layer, head=2).json()
        assert d2["step"]["layer"] == layer and d2["step"]["head"] == 2
        _check_step(d2)
        keys = [m["key"] for m in d2["step"]["matrices"]]
        assert ("context" in keys) == layer.endswith("encoder_attn")
    kinds = [x["kind"] for x in d["layers"]]
    assert kinds.count("cross") == 2 and kinds.count("self") == 2
    tr = d["translation"]
    cross = next(x for x in d["layers"] if x["kind"] == "cross")
    assert cross["k_tokens"] == tr["source_tokens"] == d["tokens"]
    assert cross["q_tokens"] == tr["target_tokens"] and len(cross["weights"][0]) == tr["steps"]
    for row in cross["weights"][0]:
        assert abs(sum(row) - 1) < 5e-3


def test_serve_heads_off(client, dirs):
    layer = "model.layers.0.self_attn"
    r = post(client, text=TEXT, model="llama", layer=layer, ablate=[[layer, 2]])
    assert r.status_code == 200, r.text
    d = r.json()
    loaded = load(str(dirs["llama"]))
    _, (ids, mask) = loaded.encode(TEXT)
    ref = _eager_heads_off(dirs["llama"], "llama", layer, 2, "o_proj")
    with torch.no_grad():
        want = ref(input_ids=ids, output_attentions=True, output_hidden_states=True)
        base = loaded.hidden(ids, mask)
    off = want.hidden_states[-1]
    change = float((off - base).norm() / base.norm())
    assert d["ablation"]["heads"] == [[layer, 2]]
    assert abs(d["ablation"]["hidden_change"] - change) < 2e-4 and change > 1e-3
    got = torch.tensor(d["layers"][1]["weights"])
    torch.testing.assert_close(got, want.attentions[1][0], atol=6e-4, rtol=0)


def test_serve_translation_heads_off(client, dirs):
    layer = "model.decoder.layers.1.encoder_attn"
    r = post(client, text=TEXT, model="marian", translate=True, ablate=[[layer, 0], [layer, 3]])
    assert r.status_code == 200, r.text
    d = r.json()
    loaded = load(str(dirs["marian"]))
    tokens, (ids, mask) = loaded.encode(TEXT)
    ref = _eager(dirs["marian"], "marian")
    w = ref.get_submodule(f"{layer}.out_proj").weight  # (d_model, h·d)
    with torch.no_grad():
        w[:, 0:8] = 0.0
        w[:, 24:32] = 0.0
        seq = ref.generate(input_ids=ids, attention_mask=mask, do_sample=False, num_beams=1,
                           max_new_tokens=target_limit(len(tokens)))  # the server's limit  # fmt: skip
    tok = loaded.tokenizer
    assert d["translation"]["target_tokens"] == tok.convert_ids_to_tokens(seq[0, 1:].tolist())
    plain = post(client, text=TEXT, model="marian", translate=True).json()
    assert d["ablation"]["baseline"]["translation"] == plain["translation"]["text"]


def test_serve_refuses_what_hf_models_cannot_do(client):
    r = post(client, text=TEXT, model="llama", ablate=[["model.layers.0.self_attn", 4]])
    assert r.status_code == 400 and "head 4 out of range" in r.json()["error"]
    r = post(client, text=TEXT, model="llama", ablate=[["nope", 0]])
    assert r.status_code == 400 and "no layer named 'nope'" in r.json()["error"]
    r = post(client, text=TEXT, model="llama", translate=True)
    assert r.status_code == 400 and "does not translate" in r.json()["error"]
    r = post(client, text=TEXT, model="llama", translate=True, beam=2)  # beam: test_hf_beam.py
    assert r.status_code == 400 and "nor search with a beam" in r.json()["error"]
    r = post(client, text=TEXT, model="llama", layer="model.layers.1.self_attn", head=4)
    assert r.status_code == 400 and "head must be in [0, 3]" in r.json()["error"]
    r = post(client, text=TEXT, model="llama", layer="nope")
    assert r.status_code == 400 and "layer must be one of" in r.json()["error"]


def test_page_in_a_browser(dirs):
    """The served page on a transformers model: the step-by-step view replays the head's call,
    and the head switches re-run the model (Debian's chromium via Playwright)."""
    pytest.importorskip("uvicorn")
    reg = default_registry({"llama": str(dirs["llama"])})
    with one_thread(), running_server(create_app(reg)) as port, chromium() as b:
        url = f"http://127.0.0.1:{port}/?model=llama&text=the+boy+trains&view=step"
        page, errors, _, _ = open_page(b, url)
        keys = page.eval_on_selector_all("#view-step .card",
                                         "cs => cs.map(c => c.dataset.key)")  # fmt: skip
        assert keys == ["x", "q", "k", "v", "scores", "scaled", "mask", "masked",
                        "weights", "output", "concat", "wo"]  # fmt: skip
        assert "not available" not in page.inner_text("#view-step")
        shots = Path(__file__).resolve().parents[1] / "artifacts"  # tests/artifacts
        shots.mkdir(exist_ok=True)
        page.screenshot(path=str(shots / "serve_hf_step.png"), full_page=True)
        page.click(".tab[data-view='work']")
        page.locator("input.switch").first.uncheck()
        page.click("#ablate-run")
        page.wait_for_selector("#changes")
        assert "1 head(s) off" in page.inner_text("#changes")
    assert errors == []
