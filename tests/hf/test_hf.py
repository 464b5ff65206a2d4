"""qkv.hf (attn_implementation="qkv") against transformers' own "eager" and "sdpa" attention.

Tiny random models built from configs here (nothing downloads), fp32, seeds fixed. Most tests
compare the valid rows only (sdpa gives zeros to a query that sees no key, nothing reads it);
the tests of all-padding rows check that qkv gives eager's answer there too: the mean of the
values, weights 1/Tk (zeros with gpt-oss's sinks).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing downloads

transformers = pytest.importorskip("transformers")

import hf_tiny  # noqa: E402
import qkv.hf as qhf  # noqa: E402
from qkv.hf import attention as qattn  # noqa: E402

TOL = 1e-5
V = 61  # vocabulary of the tiny models


def _llama():
    return hf_tiny.llama(V)


def _bert():
    return hf_tiny.bert(V)


def _marian():
    return hf_tiny.marian(V)


def _t5():
    cfg = transformers.T5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=2,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(cfg)


def _gemma2():
    cfg = transformers.Gemma2Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
        attn_logit_softcapping=2.0, final_logit_softcapping=30.0, query_pre_attn_scalar=8,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.Gemma2ForCausalLM(cfg)


BUILDERS = {"llama": _llama, "bert": _bert, "marian": _marian, "t5": _t5, "gemma2": _gemma2}
KIND = {"llama": "decoder", "bert": "encoder", "marian": "encoder-decoder",
        "t5": "encoder-decoder", "gemma2": "decoder"}  # fmt: skip


@pytest.fixture(scope="module")
def models():
    out = {}
    for name, build in BUILDERS.items():
        torch.manual_seed(0)
        out[name] = build().eval()
    return out


def _batch(name: str):
    """Inputs with padding: left padding for decoders, right padding for encoders."""
    g = torch.Generator().manual_seed(1)
    T = 11  # > gemma2's sliding window (4): its sliding layers get a real window mask
    ids = torch.randint(3, V, (2, T), generator=g)
    am = torch.ones_like(ids)
    if KIND[name] == "decoder":
        ids[1, :3], am[1, :3] = 0, 0  # left padding
    else:
        ids[1, -4:], am[1, -4:] = 0, 0  # right padding
    kw = {"input_ids": ids, "attention_mask": am}
    if KIND[name] == "encoder-decoder":
        kw["decoder_input_ids"] = torch.randint(3, V, (2, 5), generator=g)
    return kw


def _run(model, impl: str, **kw):
    model.set_attn_implementation(impl)
    try:
        with torch.no_grad():
            return model(**kw)
    finally:
        model.set_attn_implementation("qkv")


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> float:
    err = float((a - b).abs().max())
    assert err <= tol, f"max abs diff {err:.3g} > {tol}"
    return err


def _rows(kw, name: str, attn_kind: str) -> torch.Tensor:
    """(B, Tq) bool: query rows that see at least one key (padded decoder queries do not)."""
    if attn_kind == "decoder" and KIND[name] == "decoder":
        return kw["attention_mask"].bool()
    if attn_kind == "decoder":
        return torch.ones_like(kw["decoder_input_ids"], dtype=torch.bool)
    return torch.ones_like(kw["input_ids"], dtype=torch.bool)


def _attn_pairs(name: str, out_q, out_e, kw):
    """(qkv weights, eager weights, valid rows) of every layer, encoder and decoder."""
    pairs = []
    if KIND[name] == "encoder-decoder":
        groups = [("encoder_attentions", "encoder"), ("decoder_attentions", "decoder"),
                  ("cross_attentions", "decoder")]  # fmt: skip
    else:
        groups = [("attentions", "decoder" if KIND[name] == "decoder" else "encoder")]
    for key, side in groups:
        rows = _rows(kw, name, side)
        assert len(out_q[key]) == len(out_e[key]) > 0
        pairs += [(a, b, rows) for a, b in zip(out_q[key], out_e[key])]
    return pairs


def _close_rows(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor) -> None:
    """Compare weights (B, h, Tq, Tk) on the valid query rows (B, Tq) only."""
    sel = rows[:, None, :, None].expand_as(a)
    _close(a[sel], b[sel])


def test_register_is_idempotent_and_registers_both_interfaces():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    qhf.register()
    qhf.register()
    assert AttentionInterface()["qkv"] is qhf.qkv_attention_forward
    assert AttentionMaskInterface()["qkv"] is qhf.qkv_mask


def test_from_config_with_qkv():
    cfg = _llama().config
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="qkv")
    assert model.config._attn_implementation == "qkv"


def test_mask_function_is_boolean_true_may_attend():
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    pad = torch.tensor([[0, 1, 1, 1]], dtype=torch.bool)
    m = qhf.qkv_mask(1, 4, 4, attention_mask=pad, mask_function=causal_mask_function)
    ref = sdpa_mask(1, 4, 4, attention_mask=pad, mask_function=causal_mask_function)
    assert m.dtype == torch.bool and torch.equal(m, ref)
    assert m[0, 0].tolist()[2] == [False, True, True, False]


@pytest.mark.parametrize("name", list(BUILDERS))
def test_forward_equals_eager(models, name):
    model, kw = models[name], _batch(name)
    out_q = _run(model, "qkv", **kw, output_attentions=True)
    out_e = _run(model, "eager", **kw, output_attentions=True)
    main = "last_hidden_state" if KIND[name] == "encoder" else "logits"
    rows = _rows(kw, name, "decoder" if KIND[name] != "encoder" else "encoder")
    _close(out_q[main][rows], out_e[main][rows])
    if KIND[name] == "encoder-decoder":
        _close(out_q.encoder_last_hidden_state, out_e.encoder_last_hidden_state)
    for a, b, r in _attn_pairs(name, out_q, out_e, kw):
        _close_rows(a, b, r)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_capture_equals_eager_output_attentions(models, name):
    model, kw = models[name], _batch(name)
    out_e = _run(model, "eager", **kw, output_attentions=True)
    model.set_attn_implementation("eager")  # capture switches to qkv and back
    with torch.no_grad(), qhf.capture_attention(model) as cap:
        model(**kw)
    assert model.config._attn_implementation == "eager"
    model.set_attn_implementation("qkv")
    n = len(qhf.attention_modules(model))
    assert len(cap.records) == n
    if KIND[name] == "encoder-decoder":
        groups = [("encoder_attentions", "self"), ("decoder_attentions", "causal"),
                  ("cross_attentions", "cross")]  # fmt: skip
    else:
        groups = [("attentions", "causal" if KIND[name] == "decoder" else "self")]
    for key, kind in groups:
        side = "encoder" if kind == "self" else "decoder"
        got = cap.weights(kind)
        assert len(got) == len(out_e[key])
        for a, b in zip(got, out_e[key]):
            _close_rows(a, b, _rows(kw, name, side))


@pytest.mark.parametrize("name", ["llama", "t5", "gemma2"])
def test_capture_one_head_does_not_materialise_all(models, name, monkeypatch):
    model, kw = models[name], _batch(name)
    out_e = _run(model, "eager", **kw, output_attentions=True)
    key = "attentions" if KIND[name] == "decoder" else "encoder_attentions"

    def no_math(*a, **k):
        raise AssertionError("all heads were materialised (math path)")

    monkeypatch.setattr("qkv.functional.attention_steps", no_math)
    with torch.no_grad(), qhf.capture_attention(model, layers=[1], heads=[3]) as cap:
        model(**kw)
    (rec,) = cap.records
    assert rec.heads == [3] and rec.weights.shape[1] == 1
    rows = _rows(kw, name, "decoder" if KIND[name] == "decoder" else "encoder")
    _close_rows(rec.weights, out_e[key][1][:, 3:4], rows)


def _gen(model, impl: str, kw, **gen):
    model.set_attn_implementation(impl)
    try:
        kw = {k: v for k, v in kw.items() if k != "decoder_input_ids"}
        return model.generate(**kw, max_new_tokens=5, min_new_tokens=5, do_sample=False, **gen)
    finally:
        model.set_attn_implementation("qkv")


@pytest.mark.parametrize("beams", [1, 3])
@pytest.mark.parametrize("name", ["llama", "marian", "t5", "gemma2"])
def test_generate_equals_reference(models, name, beams):
    # sdpa rejects soft-capping, so gemma2 is compared with eager
    ref = "eager" if name == "gemma2" else "sdpa"
    model, kw = models[name], _batch(name)
    got = _gen(model, "qkv", kw, num_beams=beams)
    want = _gen(model, ref, kw, num_beams=beams)
    assert got.shape[1] >= 5 and torch.equal(got, want)


def test_generate_static_cache_equals_sdpa(models):
    model, kw = models["llama"], _batch("llama")
    kw = {"input_ids": kw["input_ids"][:1, :8]}  # no padding: prefill over an empty static cache
    got = _gen(model, "qkv", kw, cache_implementation="static")
    want = _gen(model, "sdpa", kw, cache_implementation="static")
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_chunked_prefill_over_cache_equals_eager(models, name):
    """Tq > 1 queries over a cache (q_offset > 0), and Tq = 1 decoding past the window."""
    model, kw = models[name], _batch(name)
    ids, am = kw["input_ids"], kw["attention_mask"]
    logits = {}
    for impl in ("eager", "qkv"):
        model.set_attn_implementation(impl)
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            parts = []
            for s, e in ((0, 6), (6, 10), (10, 11)):
                out = model(input_ids=ids[:, s:e], attention_mask=am[:, :e],
                            past_key_values=cache, use_cache=True)  # fmt: skip
                parts.append(out.logits)
        logits[impl] = torch.cat(parts, dim=1)
    model.set_attn_implementation("qkv")
    _close(logits["qkv"][am.bool()], logits["eager"][am.bool()])


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_training_gradients_equal_eager(name):
    """Train mode (dropout 0): gradients through qkv equal eager's, T5's learned bias too."""
    grads = {}
    for impl in ("eager", "qkv"):
        torch.manual_seed(0)
        model = BUILDERS[name]()
        model.set_attn_implementation(impl)
        model.train()
        kw = _batch(name)
        labels = kw.get("decoder_input_ids", kw["input_ids"]).clone()
        if "decoder_input_ids" not in kw:  # padded queries are undefined: not in the loss
            pad = kw["attention_mask"] == 0  # and a label is predicted by the position before
            labels[pad | torch.nn.functional.pad(pad[:, :-1], (1, 0))] = -100
        model(**kw, labels=labels).loss.backward()
        grads[impl] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads["qkv"].keys() == grads["eager"].keys()
    for n in grads["eager"]:
        _close(grads["qkv"][n], grads["eager"][n], 1e-4)


def test_attention_dropout_in_training():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=48, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.5,
        attn_implementation="qkv",
    )  # fmt: skip
    model = transformers.BertModel(cfg)
    kw = _batch("bert")
    model.train()
    a, b = (model(**kw).last_hidden_state for _ in range(2))
    assert float((a - b).abs().max().detach()) > 1e-3  # the weights were dropped at random
    model.eval()
    c, d = (model(**kw).last_hidden_state for _ in range(2))
    assert torch.equal(c, d)


def _gpt_oss():
    return hf_tiny.gpt_oss(V)


def test_attention_sinks_equal_eager():
    """gpt-oss's learned sink logits (s_aux): forward, weights, capture, generate, gradients."""
    model, kw = _gpt_oss(), _batch("llama")
    rows = kw["attention_mask"].bool()
    out_q = _run(model, "qkv", **kw, output_attentions=True)
    out_e = _run(model, "eager", **kw, output_attentions=True)
    _close(out_q.logits[rows], out_e.logits[rows])
    for a, b in zip(out_q.attentions, out_e.attentions):
        _close_rows(a, b, rows)
    with torch.no_grad(), qhf.capture_attention(model, heads=[1]) as cap:
        model(**kw)
    for rec, w in zip(cap.records, out_e.attentions, strict=True):
        _close_rows(rec.weights, w[:, 1:2], rows)
    assert torch.equal(_gen(model, "qkv", kw), _gen(model, "eager", kw))
    grads = {}
    for impl in ("eager", "qkv"):
        model.zero_grad()
        model.set_attn_implementation(impl)
        model(**kw, labels=kw["input_ids"].masked_fill(~rows, -100)).loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if "sinks" in n}
    model.set_attn_implementation("qkv")
    assert len(grads["qkv"]) == 2
    for n in grads["eager"]:
        _close(grads["qkv"][n], grads["eager"][n])


def test_fallback_warns_once_and_equals_eager(monkeypatch, models):
    """An integer 4-D mask is not qkv's: transformers' eager runs it, with one warning."""
    monkeypatch.setattr(qattn, "_WARNED", set())
    model = models["llama"]
    ids = _batch("llama")["input_ids"]
    mask4 = torch.ones(2, 1, ids.shape[1], ids.shape[1], dtype=torch.int64).tril()
    want = _run(model, "eager", input_ids=ids, attention_mask=mask4).logits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [_run(model, "qkv", input_ids=ids, attention_mask=mask4).logits for _ in range(2)]
    ours = [w for w in caught if "attn_implementation='qkv'" in str(w.message)]
    assert len(ours) == 1 and "torch.int64" in str(ours[0].message)
    for g in got:
        _close(g, want)
    # capture still works there: the weights eager computes are recorded
    out_e = _run(model, "eager", input_ids=ids, attention_mask=mask4, output_attentions=True)
    with torch.no_grad(), qhf.capture_attention(model, heads=[1]) as cap:
        model(input_ids=ids, attention_mask=mask4)
    assert len(cap.records) == len(out_e.attentions) == 2
    for rec, w in zip(cap.records, out_e.attentions):
        _close(rec.weights, w[:, 1:2])


def test_fallback_reasons():
    q = torch.randn(1, 3, 4, 8)
    k = torch.randn(1, 2, 4, 8)
    assert "multiple" in qattn.fallback_reason(q, k, k, None, {})[0]
    k = torch.randn(1, 1, 4, 8)
    assert qattn.fallback_reason(q, k, k, None, {}) is None
    assert "dtype" in qattn.fallback_reason(q, k, k, torch.ones(1, 1, 4, 4, dtype=torch.int64),
                                            {})[0]  # fmt: skip
    assert "shape" in qattn.fallback_reason(q, k, k, torch.ones(4, 4, dtype=torch.bool), {})[0]


def test_capture_during_generate_merges_to_the_full_map(models):
    """Maps captured step by step over the KV cache equal one forward over the final sequence."""
    model = models["llama"]
    ids = _batch("llama")["input_ids"][:1]
    with torch.no_grad(), qhf.capture_attention(model, heads=[0, 2]) as cap:
        seq = model.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    steps = cap.maps()
    with torch.no_grad(), qhf.capture_attention(model, heads=[0, 2]) as full:
        model(input_ids=seq[:, :-1])
    whole = full.maps()
    assert steps.layers == whole.layers and steps.kinds == ["causal", "causal"]
    for a, b in zip(steps.weights, whole.weights):
        _close(a, b)


@pytest.mark.parametrize("name", ["llama", "bert", "marian"])
def test_load_model_kind_and_maps(models, name, tmp_path):
    models[name].save_pretrained(tmp_path)
    loaded = qhf.load_model(tmp_path)
    assert loaded.kind == KIND[name] and loaded.tokenizer is None
    assert loaded.model.config._attn_implementation == "qkv"
    kw = _batch(name)
    ids = kw["input_ids"][:1, :7]
    extra = {"decoder_input_ids": kw["decoder_input_ids"][:1]} if name == "marian" else {}
    maps = loaded.attention(ids, heads=[1], **extra)
    out_e = _run(models[name], "eager", input_ids=ids, output_attentions=True, **extra)
    if name == "marian":
        want = [*out_e.encoder_attentions, *[w for pair in zip(out_e.decoder_attentions,
                out_e.cross_attentions) for w in pair]]  # fmt: skip
        assert maps.kinds == ["self", "self", "causal", "cross", "causal", "cross"]
    else:
        want = list(out_e.attentions)
    assert len(maps) == len(want)
    for got, w in zip(maps.weights, want):
        _close(got, w[0, 1:2])


def test_load_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        qhf.load_model(tmp_path / "missing")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        qhf.load_model(tmp_path)


def test_bf16_error_within_transformers_own(models):
    """bf16: qkv's error against the fp32 eager model is at most 2× that of bf16 eager."""
    import copy

    model, kw = models["llama"], _batch("llama")
    want = _run(model, "eager", **kw).logits
    rows = kw["attention_mask"].bool()
    errs = {}
    for impl in ("eager", "qkv"):
        low = copy.deepcopy(model).to(torch.bfloat16)
        got = _run(low, impl, **kw).logits.float()
        assert got.dtype == torch.float32 and not got.isnan().any()
        errs[impl] = float((got - want)[rows].abs().max())
    assert errs["qkv"] <= 2 * errs["eager"] + 1e-3, errs


_SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              vocab_size=V, max_position_embeddings=64)  # fmt: skip
MORE = {  # name: (config class, model class, config kwargs)
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(n_embd=32, n_layer=2, n_head=4, vocab_size=V, n_positions=64)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(_SMALL, num_key_value_heads=2, sliding_window=4)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_SMALL, num_key_value_heads=2)),
    "opt": ("OPTConfig", "OPTForCausalLM",
            dict(hidden_size=32, ffn_dim=48, num_hidden_layers=2, num_attention_heads=4,
                 vocab_size=V, max_position_embeddings=64, word_embed_proj_dim=32)),
    "roberta": ("RobertaConfig", "RobertaModel", dict(_SMALL, pad_token_id=1)),
    "distilbert": ("DistilBertConfig", "DistilBertModel",
                   dict(dim=32, hidden_dim=48, n_layers=2, n_heads=4, vocab_size=V,
                        max_position_embeddings=64)),
    "bart": ("BartConfig", "BartForConditionalGeneration",
             dict(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
                  decoder_ffn_dim=48, max_position_embeddings=64)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(_SMALL, num_key_value_heads=2, head_dim=8, sliding_window=4,
                    attn_logit_softcapping=3.0)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(_SMALL)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_SMALL, num_key_value_heads=2, pad_token_id=0)),
    "bert_decoder": ("BertConfig", "BertLMHeadModel", dict(_SMALL, is_decoder=True)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(MORE))
def test_more_architectures_equal_eager(name):
    conf_cls, model_cls, conf_kw = MORE[name]
    if not hasattr(transformers, model_cls):
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    torch.manual_seed(0)
    cfg = getattr(transformers, conf_cls)(**conf_kw)
    model = getattr(transformers, model_cls)(cfg).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (2, 9), generator=g)
    am = torch.ones_like(ids)
    am[1, :2] = 0
    kw = {"input_ids": ids, "attention_mask": am}
    rows = am.bool()
    if cfg.is_encoder_decoder:
        kw["decoder_input_ids"] = torch.randint(3, V, (2, 4), generator=g)
        rows = torch.ones(2, 4, dtype=torch.bool)
    out_q, out_e = _run(model, "qkv", **kw), _run(model, "eager", **kw)
    key = "logits" if "logits" in out_e else "last_hidden_state"
    _close(out_q[key][rows], out_e[key][rows])


def test_doctests():
    import doctest

    import qkv.hf.masks

    for mod in (qhf, qkv.hf.masks):
        failed, _ = doctest.testmod(mod)
        assert failed == 0


@pytest.mark.parametrize("name", ["llama", "marian"])
def test_loaded_generate_maps_equal_teacher_forced(models, name, tmp_path):
    """Maps captured while generating = maps of one forward over the generated sequence."""
    models[name].save_pretrained(tmp_path)
    loaded = qhf.load_model(tmp_path)
    src = _batch(name)["input_ids"][:1, :6]
    seq, maps = loaded.generate(src, max_new_tokens=4, heads=[0, 3])
    assert seq.shape[1] > (1 if name == "marian" else 6)
    if name == "marian":
        whole = loaded.attention(src, decoder_input_ids=seq[:, :-1], heads=[0, 3])
    else:
        whole = loaded.attention(seq[:, :-1], heads=[0, 3])
    assert maps.layers == whole.layers and maps.kinds == whole.kinds
    for a, b in zip(maps.weights, whole.weights):
        _close(a, b)
    with pytest.raises(ValueError, match="max_new_tokens"):
        loaded.generate(src, max_new_tokens=0)


def test_capture_selection_and_errors(models):
    model, kw = models["marian"], _batch("marian")
    names = [n for n, _ in qhf.attention_modules(model)]
    assert len(names) == 6
    with torch.no_grad(), qhf.capture_attention(model, layers=["*encoder_attn"]) as cap:
        model(**kw)
    assert {r.kind for r in cap.records} == {"cross"} and len(cap.records) == 2
    with pytest.raises(KeyError, match="no attention module matches"):
        with qhf.capture_attention(model, layers=["nope.*"]):
            pass
    with pytest.raises(IndexError, match="out of range"):
        with qhf.capture_attention(model, layers=[6]):
            pass
    with pytest.raises(ValueError, match=r"heads \[4\] out of range"):
        with torch.no_grad(), qhf.capture_attention(model, heads=[4]):
            model(**kw)
    assert qhf.capture.active() is None  # the capture closed despite the error


def _padded_batch(kind: str, encoder_decoder: bool) -> dict:
    """Three rows: no padding, some padding (left for decoders, right otherwise), all padding."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (3, 9), generator=g)
    am = torch.ones_like(ids)
    if kind == "decoder":
        am[1, :3] = 0
    else:
        am[1, -3:] = 0
    am[2] = 0
    kw = {"input_ids": ids, "attention_mask": am}
    if encoder_decoder:
        kw["decoder_input_ids"] = torch.randint(3, V, (3, 4), generator=g)
    return kw


def _more(name: str):
    conf_cls, model_cls, conf_kw = MORE[name]
    if not hasattr(transformers, model_cls):
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(getattr(transformers, conf_cls)(**conf_kw)).eval()


@pytest.mark.parametrize("name", [*BUILDERS, *MORE, "gpt_oss"])
def test_all_padding_rows_equal_eager(models, name):
    """A row whose mask hides every key (an all-padding encoder row, the decoder's
    cross-attention over it, a decoder's left-padding queries) gives eager's output."""
    if name in BUILDERS:
        model, kind = models[name], KIND[name]
    else:
        model = _gpt_oss() if name == "gpt_oss" else _more(name)
        kind = ("encoder-decoder" if model.config.is_encoder_decoder
                else "encoder" if name in ("roberta", "distilbert") else "decoder")  # fmt: skip
    kw = _padded_batch(kind, kind == "encoder-decoder")
    out_q, out_e = _run(model, "qkv", **kw), _run(model, "eager", **kw)
    key = "logits" if "logits" in out_e else "last_hidden_state"
    for row in range(3):  # every row, the all-padding one included
        _close(out_q[key][row], out_e[key][row])
    if kind == "encoder-decoder":
        _close(out_q.encoder_last_hidden_state, out_e.encoder_last_hidden_state)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_all_padding_rows_weights_and_capture_equal_eager(models, name):
    """output_attentions, and capture of one head (weights recomputed from the log-sum-exp),
    give eager's 1/Tk on the rows that see no key."""
    model, kind = models[name], KIND[name]
    kw = _padded_batch(kind, kind == "encoder-decoder")
    out_q = _run(model, "qkv", **kw, output_attentions=True)
    out_e = _run(model, "eager", **kw, output_attentions=True)
    with torch.no_grad(), qhf.capture_attention(model, heads=[1]) as cap:
        model(**kw)
    if kind == "encoder-decoder":
        groups = [("encoder_attentions", "self"), ("decoder_attentions", "causal"),
                  ("cross_attentions", "cross")]  # fmt: skip
    else:
        groups = [("attentions", "causal" if kind == "decoder" else "self")]
    uniform = 0
    for key, kind_ in groups:
        for a, c, b in zip(out_q[key], cap.weights(kind_), out_e[key], strict=True):
            _close(a, b)  # every row
            _close(c, b[:, 1:2])
            uniform += int((b - 1 / b.shape[-1]).abs().amax(-1).le(1e-7).sum())
    assert uniform > 0, "no row of the batch sees no key"


def _no_dropout(model):
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for attr in ("dropout", "attention_dropout"):
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)
    return model


@pytest.mark.parametrize("name", ["llama", "bert", "t5", "gemma2"])
def test_all_padding_rows_gradients_equal_eager(name):
    """Training with rows that see no key, their outputs in the loss: eager's gradients, the
    ones its rounding gives the scores of such rows (softmax's Jacobian at 1/Tk) included."""
    kind = KIND[name]
    kw = _padded_batch(kind, kind == "encoder-decoder")
    grads = {}
    for impl in ("eager", "qkv"):
        torch.manual_seed(0)
        model = _no_dropout(BUILDERS[name]())
        model.set_attn_implementation(impl)
        model.train()
        out = model(**kw)
        y = out.logits if "logits" in out else out.last_hidden_state
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
        (y * w).sum().backward()  # every row, the all-padding one included
        grads[impl] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads["qkv"].keys() == grads["eager"].keys()
    for n in grads["eager"]:
        _close(grads["qkv"][n], grads["eager"][n], 1e-4)
