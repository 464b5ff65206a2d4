"""The logit lens and direct logit attribution (``qkv.inspect.lens``).

References nobody here wrote: transformers' own ``logits`` and ``output_hidden_states=True``
(GPT-2, Llama built from tiny configs, random weights, offline), qkv's models' own forward
pass and greedy decoding (the shipped en-fr translator), the module outputs of attention
with one head switched off (``qkv.hf.heads_off`` / ``head_mask``), and torch's LayerNorm.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing downloads
transformers = pytest.importorskip("transformers")

import hf_tiny  # noqa: E402
from qkv.generate import greedy_search  # noqa: E402
from qkv.inspect.lens import decompose, lens  # noqa: E402
from qkv.inspect.lens_parts import frozen_norm  # noqa: E402
from qkv.models import CausalLM, TransformerConfig  # noqa: E402

V = 50
IDS = torch.tensor([[1, 5, 7, 9, 3, 11, 4]])  # (1, T)


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=3, n_head=4, n_positions=64,
                                  bos_token_id=1, eos_token_id=2, initializer_range=0.2)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def _hf(name: str):
    torch.manual_seed(0)
    model = (_gpt2() if name == "gpt2" else hf_tiny.llama(V)).eval()
    with torch.no_grad():  # random init leaves the biases at 0: make them count
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)
    return model


@pytest.fixture(scope="module")
def shipped():
    from qkv.models.shipped import shipped_dir
    from qkv.translate import load_translator

    try:
        model, tok = load_translator(shipped_dir("en-fr"))
    except ValueError:
        pytest.skip("no shipped en-fr translator in this install")
    model.eval()
    src = torch.tensor([tok.encode("The boy trains the puppy.") + [tok.eos_id]])  # (1, S)
    with torch.no_grad():
        out = greedy_search(model, src)[0].tolist()
    hyp = out[: out.index(tok.eos_id) + 1]  # y1 … </s>
    return model, src, torch.tensor([[model.cfg.bos_id, *hyp[:-1]]]), hyp


def _causal_lm(norm_first: bool = True) -> CausalLM:
    torch.manual_seed(1)
    cfg = TransformerConfig(src_vocab_size=V, tgt_vocab_size=V, d_model=32, n_heads=4,
                            n_decoder_layers=2, d_ff=48, dropout=0.1, norm_first=norm_first)  # fmt: skip
    return CausalLM(cfg)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_last_layer_is_the_models_logits_and_rows_are_hidden_states(name):
    model = _hf(name)
    out = lens(model, input_ids=IDS, top_k=4)
    with torch.no_grad():
        ref = model(input_ids=IDS, output_hidden_states=True)
    probs = ref.logits[0].softmax(-1)  # (T, V)
    top = probs.topk(4)
    assert torch.equal(out.top_ids[-1], top.indices)
    torch.testing.assert_close(out.top_probs[-1], top.values, atol=1e-6, rtol=0)
    assert out.target == int(ref.logits[0, -1].argmax()) and out.position == IDS.shape[1] - 1
    assert out.layers[0] == "embeddings" and len(out.layers) == len(ref.hidden_states)
    # rows 0 … L-1: transformers' hidden states (the residual stream) through its final norm
    # and lm_head; transformers' last hidden state is already normed
    norm = model.transformer.ln_f if name == "gpt2" else model.model.norm
    for i, h in enumerate(ref.hidden_states[:-1]):
        with torch.no_grad():
            p = model.lm_head(norm(h))[0].softmax(-1)  # (T, V)
        assert torch.equal(out.top_ids[i], p.topk(4).indices), i
        torch.testing.assert_close(out.top_probs[i], p.topk(4).values, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("position", [0, 3, -1])
def test_hf_writes_add_up_to_hidden_states_and_logits(name, position):
    """Embeddings = hidden_states[0]; the writes of blocks ≤ l add up to hidden_states[l + 1];
    the final norm of the sum is transformers' last hidden state; every write's direct
    effect plus the biases is the model's logits. Leave out any one head and it is not."""
    model = _hf(name)
    d = decompose(model, input_ids=IDS, position=position)
    with torch.no_grad():
        ref = model(input_ids=IDS, output_hidden_states=True)
    hs = [h[0, position] for h in ref.hidden_states]  # (d,) each
    torch.testing.assert_close(d.writes[0], hs[0], atol=1e-6, rtol=0)
    ends = [i for i, n in enumerate(d.names) if n.endswith(" mlp")]  # each block's last write
    assert len(ends) == len(hs) - 1
    for layer, end in enumerate(ends[:-1]):
        torch.testing.assert_close(d.writes[: end + 1].sum(0), hs[layer + 1], atol=1e-5, rtol=1e-5)
    norm = model.transformer.ln_f if name == "gpt2" else model.model.norm
    with torch.no_grad():
        torch.testing.assert_close(norm(d.writes.sum(0)[None])[0], hs[-1], atol=1e-5, rtol=1e-5)
    logits = ref.logits[0, position]  # (V,)
    eff = d.attribution()  # (N, V)
    tol = 1e-4 * float(logits.abs().max().clamp_min(1))
    err = float((eff.sum(0) + d.constant - logits).abs().max())
    assert err < tol
    heads = [i for i, n in enumerate(d.names) if " head " in n]
    assert len(heads) == 3 * 4 if name == "gpt2" else 2 * 4
    for i in heads:  # the sum misses any one head by far more than rounding
        rest = eff.sum(0) - eff[i] + d.constant
        assert float((rest - logits).abs().max()) > 100 * max(err, 1e-7), d.names[i]


def _module_output(model, name: str, run) -> torch.Tensor:
    out = []
    h = model.get_submodule(name).register_forward_hook(
        lambda _m, _a, o: out.append((o[0] if isinstance(o, tuple) else o).detach().clone())
    )
    try:
        with torch.no_grad():
            run()
    finally:
        h.remove()
    return out[0][0]  # (T, d)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_heads_write_is_what_switching_it_off_takes_away(name):
    """A head's write (its output through its slice of W_O) is the difference it makes to its
    attention module's output: qkv.hf.heads_off zeroes it before the output projection."""
    from qkv.hf import heads_off

    model = _hf(name)
    layer = "transformer.h.1.attn" if name == "gpt2" else "model.layers.1.self_attn"
    d = decompose(model, input_ids=IDS, position=4)
    run = lambda: model(input_ids=IDS)  # noqa: E731
    full = _module_output(model, layer, run)
    for head in range(4):
        with heads_off(model, {layer: [head]}):
            off = _module_output(model, layer, run)
        write = d.writes[d.names.index(f"{layer} head {head}")]
        torch.testing.assert_close(write, full[4] - off[4], atol=1e-5, rtol=1e-4)


def test_qkv_head_write_and_head_mask():
    lm = _causal_lm().eval()
    d = decompose(lm, IDS, position=2)
    att = lm.layers[1].self_attn
    run = lambda: lm(IDS)  # noqa: E731
    full = _module_output(lm, "layers.1.self_attn", run)
    for head in range(4):
        att.head_mask = torch.ones(4)
        att.head_mask[head] = 0.0
        try:
            off = _module_output(lm, "layers.1.self_attn", run)
        finally:
            att.head_mask = None
        write = d.writes[d.names.index(f"layers.1.self_attn head {head}")]
        torch.testing.assert_close(write, full[2] - off[2], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["gpt2", "llama", "causal_lm"])
def test_lens_heads_are_the_decompositions_rows(name):
    """lens()'s per-head numbers: the effect on the predicted token and the top-k pushed up
    and down are those of the head's row of the attribution; with the other parts they sum to
    the predicted token's logit. Dropout is off for the run, back on after."""
    model = _causal_lm().train() if name == "causal_lm" else _hf(name)
    kw = {"input_ids": IDS} if name != "causal_lm" else {}
    args = () if name != "causal_lm" else (IDS,)
    out = lens(model, *args, position=5, top_k=3, **kw)
    assert model.training == (name == "causal_lm")
    d = decompose(model, *args, position=5, **kw)
    eff = d.attribution()
    assert out.check is not None and out.check < 1e-4 * max(1.0, abs(out.logit))
    assert out.target == int(d.logits.argmax()) and out.logit == pytest.approx(
        float(d.logits.max())
    )
    for h in out.heads:
        row = eff[d.names.index(f"{h.layer} head {h.head}")]
        assert h.target == pytest.approx(float(row[out.target]), abs=1e-5)
        assert [i for i, _ in h.up] == row.topk(3).indices.tolist()
        assert [i for i, _ in h.down] == (-row).topk(3).indices.tolist()
        assert h.up[0][1] >= h.up[-1][1] and h.down[0][1] <= h.down[-1][1]
    total = sum(h.target for h in out.heads) + sum(v for _, v in out.others)
    assert total == pytest.approx(out.logit, abs=1e-4)


def test_bf16_model_is_attributed_within_its_precision():
    """A bfloat16 model: its writes add up within bf16's rounding, not a false "post-LN"."""
    model = _hf("llama").to(torch.bfloat16)
    out = lens(model, input_ids=IDS, top_k=2)
    with torch.no_grad():
        logits = model(input_ids=IDS).logits[0].float()  # (T, V)
    assert out.why_not is None and len(out.heads) == 8
    assert out.top_ids[-1, :, 0].tolist() == logits.argmax(-1).tolist()
    # the model's own bf16 logits are rounded at bf16's step of the numbers it sums (≥ 1)
    assert out.check < 8 * torch.finfo(torch.bfloat16).eps * max(1.0, float(logits.abs().max()))


def test_translator_decoder(shipped):
    """The shipped en-fr decoder, teacher-forced on its own greedy output: the last layer's
    top token at each position is the token greedy decoding wrote there; every head of the
    self- and cross-attention is attributed and the parts add up to the logits."""
    model, src, tgt, hyp = shipped
    out = lens(model, src, tgt, top_k=5)
    assert out.top_ids[-1, :, 0].tolist() == hyp
    with torch.no_grad():
        logits = model(src, tgt)[0]  # (T, V)
    torch.testing.assert_close(out.top_probs[-1], logits.softmax(-1).topk(5).values,
                               atol=1e-6, rtol=0)  # fmt: skip
    assert out.layers == ["embeddings", "decoder.layers.0", "decoder.layers.1", "decoder.layers.2"]
    names = {(h.layer, h.head) for h in out.heads}
    h = model.cfg.n_heads
    assert len(names) == 3 * 2 * h and ("decoder.layers.2.cross_attn", h - 1) in names
    assert out.target == hyp[-1] and out.check < 1e-4 * max(1.0, abs(out.logit))
    d = decompose(model, src, tgt, position=2)
    eff = d.attribution()
    err = float((eff.sum(0) + d.constant - logits[2]).abs().max())
    assert err < 1e-4 * float(logits[2].abs().max())
    cross = [i for i, n in enumerate(d.names) if "cross_attn head" in n]
    for i in cross:  # the cross-attention heads are part of the sum too
        missing = float((eff.sum(0) - eff[i] + d.constant - logits[2]).abs().max())
        assert missing > 100 * err, d.names[i]


def test_post_ln_gets_the_lens_without_attribution():
    """Post-LN blocks renormalise the residual after every sub-layer: no write reaches the
    logits unchanged. The lens is still read (its last row is the model's output); the
    attribution says why it is not offered, and decompose() refuses."""
    lm = _causal_lm(norm_first=False).eval()
    out = lens(lm, IDS, top_k=2)
    with torch.no_grad():
        logits = lm(IDS)[0]
    assert torch.equal(out.top_ids[-1], logits.topk(2, dim=-1).indices)
    assert out.heads == [] and out.check is None and "post-LN" in out.why_not
    with pytest.raises(ValueError, match="post-LN"):
        decompose(lm, IDS)


class _GemmaNorm(nn.Module):  # Gemma's RMSNorm scales by (1 + weight)
    def __init__(self, d):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.randn(d) * 0.1), 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm", "gemma", "none"])
def test_frozen_norm_is_linear_and_exact_at_x(kind):
    torch.manual_seed(0)
    d = 16
    norm = {"layernorm": nn.LayerNorm(d), "rmsnorm": _rms(d),
            "gemma": _GemmaNorm(d), "none": None}[kind]  # fmt: skip
    if isinstance(norm, nn.LayerNorm):
        with torch.no_grad():
            norm.weight.normal_(1, 0.2)
            norm.bias.normal_(0, 0.2)
    x, a, b = torch.randn(3, d) * 3
    f, beta = frozen_norm(norm, x)
    want = x if norm is None else norm(x[None])[0].detach()
    torch.testing.assert_close(f(x) + beta, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(f(a + 2 * b), f(a) + 2 * f(b), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cannot write the final norm"):
        frozen_norm(nn.Tanh(), x)


def _rms(d):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(d)
    with torch.no_grad():
        norm.weight.normal_(1, 0.2)
    return norm


def test_bad_arguments():
    lm = _causal_lm().eval()
    with pytest.raises(ValueError, match=r"position must be an int in \[-7, 6\]"):
        lens(lm, IDS, position=7)
    with pytest.raises(ValueError, match=r"top_k must be an int in \[1, 50\]"):
        lens(lm, IDS, top_k=0)
    with pytest.raises(ValueError, match="batch size 1"):
        lens(lm, IDS.repeat(2, 1))
    from qkv.inspect.tiny import TinyEncoder

    with pytest.raises(ValueError, match="not TinyEncoder"):
        lens(TinyEncoder(), IDS)
    marian = hf_tiny.marian(V).eval()
    with pytest.raises(ValueError, match="encoder-decoder"):
        lens(marian, input_ids=IDS, decoder_input_ids=IDS)
