"""qkv.hf.steps: the step-by-step replay of one attention call of a transformers model.

Checked against transformers' own "eager" attention (``output_attentions=True``) on tiny
random models, and against the module's real output (the replay through its own output
projection must give back what the module returned).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing downloads
transformers = pytest.importorskip("transformers")

import hf_tiny  # noqa: E402
from qkv.hf import attention_modules, heads_off  # noqa: E402
from qkv.hf.capture import module_kind  # noqa: E402
from qkv.hf.steps import output_projection, record_call, walk  # noqa: E402

V = 61
GPT2 = dict(n_embd=32, n_layer=2, n_head=4, vocab_size=V, n_positions=64)
BUILDERS = {
    "llama": lambda: hf_tiny.llama(V),  # GQA 4/2 and RoPE: q, k are rotated
    "bert": lambda: hf_tiny.bert(V),  # the output projection lives outside the module
    "marian": lambda: hf_tiny.marian(V),  # self, causal and cross
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)),  # Conv1D
}


def _model(name):
    torch.manual_seed(0)
    return BUILDERS[name]().eval()


def _inputs(name):
    g = torch.Generator().manual_seed(1)
    kw = {"input_ids": torch.randint(3, V, (1, 9), generator=g)}
    if name == "marian":
        kw["decoder_input_ids"] = torch.randint(3, V, (1, 5), generator=g)
    return kw


def _eager_weights(model, name):
    """Eager's per-layer weights in the order of ``attention_modules``."""
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(**_inputs(name), output_attentions=True)
    finally:
        model.set_attn_implementation("sdpa")
    if name != "marian":
        return list(out.attentions)
    enc, dec, cross = (list(x) for x in (out.encoder_attentions, out.decoder_attentions,
                                         out.cross_attentions))  # fmt: skip
    order = []
    for n, m in attention_modules(model):
        order.append(enc.pop(0) if ".encoder." in n else
                     cross.pop(0) if module_kind(n, m) == "cross" else dec.pop(0))  # fmt: skip
    return order


@pytest.mark.parametrize("name", list(BUILDERS))
def test_walk_equals_eager_and_gives_back_the_module_output(name):
    model = _model(name)
    ref = _eager_weights(model, name)
    modules = attention_modules(model)
    assert len(modules) == len(ref)
    for (layer, module), want in zip(modules, ref, strict=True):
        with torch.no_grad(), record_call(model, layer) as calls:
            model(**_inputs(name))
        assert len(calls) == 1, layer
        for head in (0, 3):
            w = walk(calls[0], head)
            torch.testing.assert_close(w["weights"], want[0, head], atol=1e-6, rtol=0)
            assert w["check"] is not None and w["check"] < 1e-5, (layer, w["check"])
            Tq, Tk = w["weights"].shape
            assert w["q"].shape[0] == Tq and w["k"].shape[0] == w["v"].shape[0] == Tk
            assert torch.equal(torch.isinf(w["masked"]), ~w["mask"]) if w["mask"] is not None \
                else not torch.isinf(w["masked"]).any()  # fmt: skip
            torch.testing.assert_close(w["scaled"], w["scores"] * w["scale"])
            assert w["hidden"] is not None and w["hidden"].shape[0] == Tq
        has_wo = output_projection(module, w["concat"].shape[-1]) is not None
        assert has_wo == (name != "bert") and (w["wo"] is not None) == has_wo
        assert (w["context"] is not None) == (module_kind(layer, module) == "cross")


def test_walk_of_a_head_switched_off():
    model = _model("llama")
    layer = "model.layers.1.self_attn"
    with torch.no_grad(), heads_off(model, {layer: [2]}), record_call(model, layer) as calls:
        model(**_inputs("llama"))
        w = walk(calls[0], 2)
    assert w["check"] < 1e-5  # the replay zeroes the same head as the model did
    assert float(w["output"].abs().max()) == 0.0 and float(w["weights"].sum()) > 0


def test_record_call_errors_and_restores():
    model = _model("llama")
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match="layer must be one of"):
        with record_call(model, "model.layers.9.self_attn"):
            pass
    with torch.no_grad(), record_call(model, "model.layers.0.self_attn") as calls:
        model(**_inputs("llama"))
    assert model.config._attn_implementation == before
    with pytest.raises(ValueError, match="head must be in"):
        walk(calls[0], 4)
    with torch.no_grad():
        model(**_inputs("llama"))  # outside the block nothing more is recorded
    assert len(calls) == 1


def test_walk_of_rows_that_see_no_key_equals_eager():
    """Left padding in batch row 0: its padding queries see no key; the replay gives eager's
    even weights there, as the adapter does, and gives back the module's output."""
    model = _model("llama")
    ids = _inputs("llama")["input_ids"]
    am = torch.ones_like(ids)
    am[0, :3] = 0
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=am, output_attentions=True).attentions[1]
    layer = "model.layers.1.self_attn"
    with torch.no_grad(), record_call(model, layer) as calls:
        model(input_ids=ids, attention_mask=am)
    w = walk(calls[0], 3)
    assert w["check"] < 1e-5
    torch.testing.assert_close(w["weights"], want[0, 3], atol=1e-6, rtol=0)
    assert torch.equal(w["weights"][:3], torch.full((3, ids.shape[1]), 1 / ids.shape[1]))
