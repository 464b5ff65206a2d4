"""backend= on scaled_dot_product_attention and MultiHeadAttention; explain_dispatch."""

import logging

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from torch import nn

from qkv import MultiHeadAttention
from qkv.functional import explain_dispatch, scaled_dot_product_attention
from strategies import draw_mask_and_bias

settings.register_profile("qkv", deadline=None, max_examples=60, derandomize=True)
settings.load_profile("qkv")


@st.composite
def case(draw):
    B, h_kv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    h = h_kv * draw(st.integers(1, 2))
    Tq, Tk = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(B, h, Tq, 8, generator=g, dtype=torch.float64)
    k = torch.randn(B, h_kv, Tk, 8, generator=g, dtype=torch.float64)
    v = torch.randn(B, h_kv, Tk, 4, generator=g, dtype=torch.float64)
    kw = dict(causal=draw(st.booleans()), window=draw(st.none() | st.integers(1, 8)))
    mask, bias = draw_mask_and_bias(draw, g, B, h, Tq, Tk, torch.float64)
    kw.update({n: t for n, t in (("mask", mask), ("bias", bias)) if t is not None})
    return q, k, v, kw


@given(case(), st.sampled_from(["torch", "flash", "auto"]))
def test_backends_equal_math(c, backend):
    q, k, v, kw = c
    inputs = [t.requires_grad_() for t in (q, k, v)]
    ref = scaled_dot_product_attention(q, k, v, **kw, backend="math")
    out = scaled_dot_product_attention(q, k, v, **kw, backend=backend)
    torch.testing.assert_close(out, ref)
    assert not out.isnan().any()
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, inputs, g), torch.autograd.grad(ref, inputs, g)):
        torch.testing.assert_close(a, b)


def test_torch_backend_zero_for_fully_masked_rows():
    """PyTorch 2.13's CPU SDPA returns zeros (not NaN) for rows with no visible key."""
    q, k, v = (torch.randn(1, 2, 5, 4, requires_grad=True) for _ in range(3))
    mask = torch.ones(5, 5, dtype=torch.bool)
    mask[2] = False
    out = scaled_dot_product_attention(q, k, v, mask=mask, backend="torch")
    assert torch.all(out[:, :, 2] == 0)
    out.sum().backward()
    assert not any(t.grad.isnan().any() for t in (q, k, v))


def test_explain_dispatch_says_why():
    q = k = v = torch.randn(1, 2, 64, 16)
    d = explain_dispatch(q, k, v, softcap=30.0)
    assert d.backend == "flash" and "softcap" in d.reasons["torch"]
    d = explain_dispatch(q, k, v, dropout_p=0.1)
    assert d.backend == "torch" and "dropout" in d.reasons["flash"]
    d = explain_dispatch(q, k, v, dropout_p=0.1, softcap=5.0)
    assert d.backend == "math"
    d = explain_dispatch(q, k, v, causal=True, window=8)
    assert d.backend == "flash" and "window" in d.reasons["torch"]
    assert explain_dispatch(q, k, v, causal=True).backend == "torch"
    d = explain_dispatch(q, k, v, return_weights=True)
    assert d.backend == "math" and "weights" in d.reasons["torch"]
    assert explain_dispatch(q, k, v, return_weights=True, weights_heads=[1]).backend == "flash"
    text = str(explain_dispatch(q, k, v, softcap=30.0))
    assert text.startswith("backend='flash'") and "not 'torch': softcap" in text
    assert "reference" in explain_dispatch(q, k, v).reasons["math"]
    with pytest.raises(TypeError):
        explain_dispatch(q, k, v, windw=3)  # a misspelt option is not silently ignored


def test_reasons_name_only_what_the_call_has():
    """A decoding call (one query, a KV cache's keys) without a bias: no reason names one."""
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 4, 30, 16)
    for kw in ({"causal": True}, {}, {"mask": torch.ones(1, 30, dtype=torch.bool)}):
        d = explain_dispatch(q, k, k, **kw)
        assert not any("bias" in r for r in d.reasons.values()), d
        # the decode kernel where it is built, else torch (fp32 inference, short)
        assert d.backend == "decode" or "decode" in d.reasons and d.backend == "torch", d
        assert "Tq=1 <= 16" in d.reasons["torch"] or "fused kernels" in d.reasons["decode"]
    d = explain_dispatch(q, k, k, bias=torch.zeros(1, 4, 1, 30))
    assert d.backend == "torch" and "bias" in d.reasons["flash"], d
    assert "bias" in d.reasons["decode"], d


def test_invalid_backend_requests_raise():
    q = k = v = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="backend='torch' cannot run.*softcap"):
        scaled_dot_product_attention(q, k, v, softcap=2.0, backend="torch")
    with pytest.raises(ValueError, match="backend='flash' cannot run.*dropout"):
        scaled_dot_product_attention(q, k, v, dropout_p=0.5, backend="flash")
    with pytest.raises(ValueError, match="backend must be"):
        scaled_dot_product_attention(q, k, v, backend="cuda")


def test_debug_log_line_per_call(caplog):
    q = k = v = torch.randn(1, 2, 20, 4)  # Tq > 16: not a decoding call
    with caplog.at_level(logging.DEBUG, logger="qkv"):
        scaled_dot_product_attention(q, k, v, window=2)
        scaled_dot_product_attention(q, k, v)
    lines = [r.getMessage() for r in caplog.records if r.name == "qkv"]
    assert len(lines) == 2
    assert "backend=flash" in lines[0] and "backend=torch" in lines[1]


def test_selected_heads_weights_match_math():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 10, 8) for _ in range(3))
    out, w = scaled_dot_product_attention(
        q, k, v, causal=True, return_weights=True, weights_heads=[3, 1]
    )
    ref_out, ref_w = scaled_dot_product_attention(
        q, k, v, causal=True, return_weights=True, backend="math"
    )
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(w, ref_w[:, [3, 1]])


@pytest.mark.parametrize("backend", ["math", "torch", "flash", "auto"])
def test_mha_backend_matches_nn_multiheadattention(backend):
    torch.manual_seed(1)
    theirs = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    ours = MultiHeadAttention.from_torch(theirs)
    ours.backend = backend
    x = torch.randn(2, 12, 32)
    causal = torch.ones(12, 12, dtype=torch.bool).triu(1)  # True = blocked (PyTorch's convention)
    with torch.no_grad():
        ref, _ = theirs(x, x, x, attn_mask=causal, need_weights=False)
        out = ours(x, causal=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert MultiHeadAttention(32, 4, backend=backend).backend == backend
