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
import qkv.hf as qhf  # noqa: E402
from qkv.functional import attention_steps  # noqa: E402
from qkv.hf import attention as qattn  # noqa: E402
from qkv.hf import attention_modules, heads_off  # noqa: E402
from qkv.hf.capture import module_kind  # noqa: E402
from qkv.hf.steps import output_projection, record_call, walk  # noqa: E402
from test_hf import _gpt_oss  # noqa: E402

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


def _eager_attentions(model, **kw):
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return model(**kw, output_attentions=True).attentions
    finally:
        model.set_attn_implementation("qkv")


@pytest.mark.filterwarnings("ignore:attn_implementation='qkv'")
def test_walk_of_a_call_transformers_computed():
    """A 4-D integer mask is not qkv's: the adapter hands the call to eager (qkv.hf.attention),
    and the step view replays what eager was given. Eager adds the integer mask to the scores
    (0/1 here: nothing is hidden, some scores get +1); the replay's weights are eager's and
    it gives back what the module returned."""
    model = _model("llama")
    ids = _inputs("llama")["input_ids"]
    mask4 = torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.int64).tril()
    want = _eager_attentions(model, input_ids=ids, attention_mask=mask4)
    for i, (layer, _) in enumerate(attention_modules(model)):
        with torch.no_grad(), record_call(model, layer) as calls:
            model(input_ids=ids, attention_mask=mask4)
        (call,) = calls
        assert "torch.int64" in call.fallback and "eager computed it" in call.fallback
        for head in range(4):
            w = walk(call, head)
            assert w["fallback"] == call.fallback and w["check"] < 1e-5
            torch.testing.assert_close(w["weights"], want[i][0, head], atol=1e-6, rtol=0)
            assert w["mask"] is None and not torch.isinf(w["masked"]).any()
            s = attention_steps(call.query, call.key, call.value, bias=mask4.float(),
                                scale=w["scale"])  # fmt: skip
            torch.testing.assert_close(w["weights"], s.weights[0, head], atol=1e-6, rtol=0)


@pytest.mark.filterwarnings("ignore:attn_implementation='qkv'")
def test_a_call_handed_to_sdpa_is_replayed_and_captured():
    """sdpa returns no weights: a call handed to it (here a 2-D mask, which the adapter does
    not take) is replayed for the step view and for capture with qkv's reference math on
    exactly what sdpa was given; the output is sdpa's."""
    model = _model("llama")
    layer = "model.layers.0.self_attn"
    module = model.get_submodule(layer)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, 5, 8, generator=g) for h in (4, 2, 2))
    mask = torch.rand(5, 5, generator=g) > 0.3
    mask[:, 0] = True
    with torch.no_grad(), record_call(model, layer) as calls, \
            qhf.capture_attention(model, layers=[layer], heads=[1, 3]) as cap:  # fmt: skip
        out, _ = qattn.qkv_attention_forward(module, q, k, v, mask, scaling=0.3)
    ref = attention_steps(q, k, v, mask=mask, scale=0.3)
    torch.testing.assert_close(out.transpose(1, 2), ref.output, atol=1e-6, rtol=0)
    assert "sdpa computed it" in calls[0].fallback
    w = walk(calls[0], 3)
    torch.testing.assert_close(w["weights"], ref.weights[0, 3], atol=1e-6, rtol=0)
    torch.testing.assert_close(cap.records[0].weights[0], ref.weights[0, [1, 3]], atol=1e-6,
                               rtol=0)  # fmt: skip


def test_calls_that_cannot_be_replayed_say_why():
    from qkv.apps.serve.compute_hf import hf_step
    from qkv.hf.steps import HFCall, fallback_replay

    model = _model("llama")
    module = model.get_submodule("model.layers.0.self_attn")
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    why = fallback_replay("sdpa", module, q, k, k, object(), scaling=None, is_causal=None)
    assert isinstance(why, str) and "not a tensor" in why
    why = fallback_replay("eager", module, q, torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8),
                          None, scaling=None, is_causal=None)  # fmt: skip
    assert isinstance(why, str) and "do not pair" in why
    call = HFCall(module, None, None, None, {}, fallback="a reason", unavailable=why)
    with pytest.raises(ValueError, match="cannot be replayed"):
        walk(call, 0)
    step, text = hf_step([call], "model.layers.0.self_attn", "causal", 0, [], [], {})
    assert step is None and "a reason" in text and "do not pair" in text


def test_a_fallback_call_with_attention_sinks_is_replayed_with_them(monkeypatch):
    """gpt-oss's calls handed to transformers' eager attention (here every call, as a mask
    the adapter cannot take would be): the replay keeps each head's sink, so its weights are
    eager's and it gives back what the module returned."""
    import qkv.hf.attention

    model = _gpt_oss()
    ids = _inputs("llama")["input_ids"]
    want = _eager_attentions(model, input_ids=ids)
    monkeypatch.setattr(qkv.hf.attention, "fallback_reason",
                        lambda *a, **k: ("a reason from the test", "eager"))  # fmt: skip
    for i, (layer, module) in enumerate(attention_modules(model)):
        with torch.no_grad(), record_call(model, layer) as calls:
            model(input_ids=ids)
        (call,) = calls
        assert "a reason from the test" in call.fallback
        for head in (0, 3):
            w = walk(call, head)
            assert w["sink"] == pytest.approx(float(module.sinks[head].detach()))
            assert w["check"] < 1e-5
            torch.testing.assert_close(w["weights"], want[i][0, head], atol=1e-6, rtol=0)


def test_walk_with_attention_sinks_equals_eager():
    """gpt-oss: one learned sink logit per head takes part of each row; the replay scales the
    weights and the output by sigmoid(lse - sink) as the adapter does: eager's weights, and
    the module's output back."""
    model = _gpt_oss()
    ids = _inputs("llama")["input_ids"]
    want = _eager_attentions(model, input_ids=ids)
    for i, (layer, module) in enumerate(attention_modules(model)):
        with torch.no_grad(), record_call(model, layer) as calls:
            model(input_ids=ids)
        for head in (0, 3):
            w = walk(calls[0], head)
            assert w["sink"] == pytest.approx(float(module.sinks[head].detach()))
            assert w["check"] < 1e-5 and w["fallback"] is None
            torch.testing.assert_close(w["weights"], want[i][0, head], atol=1e-6, rtol=0)
            assert float(w["weights"].sum(-1).max()) < 1  # the sink took its share
