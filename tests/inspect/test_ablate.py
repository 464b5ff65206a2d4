"""Ablation zeroes exactly one head's slice of the concatenation before W_O."""

import pytest
import torch
import torch.nn.functional as F

from qkv import MultiHeadAttention
from qkv.inspect import ablate, ablation_scan, heads_off
from qkv.inspect.ablate import parse_heads
from qkv.inspect.tiny import TinyEncoder


def test_head_off_equals_zeroing_its_slice_by_hand():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 5, 16)
    # reference: PyTorch's SDPA per head, the slice of head 2 zeroed, then W_O
    q = mha.w_q(x).view(2, 5, 4, 4).transpose(1, 2)
    k = mha.w_k(x).view(2, 5, 4, 4).transpose(1, 2)
    v = mha.w_v(x).view(2, 5, 4, 4).transpose(1, 2)
    heads = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, h, T, d_k)
    concat = heads.transpose(1, 2).reshape(2, 5, 16)
    concat[..., 8:12] = 0.0  # head 2 of d_k = 4
    want = mha.w_o(concat)
    with heads_off(mha, {0: [2]}):
        got = mha(x, causal=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert mha.head_mask is None  # restored
    mha.head_mask = torch.ones(3)
    with pytest.raises(ValueError, match=r"head_mask must have shape \(4,\)"):
        mha(x)
    mha.head_mask = None
    assert not torch.allclose(mha(x, causal=True), want)


def test_ablate_reports_metric_change_and_nests():
    enc = TinyEncoder(n_heads=4, n_layers=2)
    _, ids = enc.tokenize("the animal was tired")
    with torch.no_grad():  # as ablate runs the metric: the same kernels, bit for bit
        base = enc(ids)

    def metric(m):
        return float((m(ids) - base).pow(2).mean())

    r = ablate(enc, {"encoder.layers.1.self_attn": [0, 3]}, metric)
    assert r.baseline == 0.0 and r.ablated > 0 and r.delta == r.ablated
    with heads_off(enc, {0: [1]}), heads_off(enc, {0: [2]}):
        assert enc.encoder.layers[0].self_attn.head_mask.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert enc.encoder.layers[0].self_attn.head_mask is None
    scan = ablation_scan(enc, metric)
    assert len(scan) == 8 and abs(scan[0].delta) >= abs(scan[-1].delta)
    with pytest.raises(ValueError, match="out of range"):
        ablate(enc, {0: [7]}, metric)


def test_parse_heads():
    assert parse_heads(["encoder.layers.0.self_attn:1,3", "2:0"]) == {"encoder.layers.0.self_attn": [1, 3], 2: [0]}
    with pytest.raises(ValueError, match="LAYER:HEAD"):
        parse_heads(["nohead"])
