"""MultiHeadAttention against torch.nn.MultiheadAttention, and KV-cached decoding."""

import pytest
import torch
from torch import nn

from qkv import KVCache, MultiHeadAttention, masks
from qkv.positional import ALiBi, RotaryEmbedding


def test_paper_formula_at_the_paper_sizes():
    """d_model = 512, h = 8, d_k = 64: MultiHead(X) = Concat(head_1..head_h) W^O with
    head_i = softmax(X W_i^Q (X W_i^K)ᵀ / √d_k) X W_i^V, written out here per head in fp64
    from the module's weights (head i owns rows 64·i .. 64·i + 63 of each projection)."""
    torch.manual_seed(0)
    B, T, d_model, h = 4, 20, 512, 8
    mha = MultiHeadAttention(d_model, h).eval()
    x = torch.randn(B, T, d_model)
    assert mha.split_heads(mha.w_q(x), h).shape == (B, h, T, 64)
    y, w = mha(x, need_weights=True)

    def proj(lin, rows=slice(None)):
        return x.double() @ lin.weight[rows].double().T + lin.bias[rows].double()

    heads, maps = [], []
    for i in range(h):
        rows = slice(64 * i, 64 * (i + 1))
        qi, ki, vi = (proj(lin, rows) for lin in (mha.w_q, mha.w_k, mha.w_v))  # (B, T, 64)
        a = torch.softmax(qi @ ki.transpose(1, 2) / 8.0, -1)  # √64 = 8
        heads.append(a @ vi)
        maps.append(a)
    want = torch.cat(heads, -1) @ mha.w_o.weight.double().T + mha.w_o.bias.double()
    assert w.shape == (B, h, T, T) and y.shape == (B, T, d_model)
    torch.testing.assert_close(w.double(), torch.stack(maps, 1), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_equals_torch_multihead_attention_with_padding(cross, bias):
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(48, 6, bias=bias, batch_first=True).eval()
    ours = MultiHeadAttention.from_torch(theirs).eval()
    x = torch.randn(3, 7, 48)
    ctx = torch.randn(3, 9, 48) if cross else x
    lengths = torch.tensor([ctx.shape[1], 4, 1])
    kpm = torch.arange(ctx.shape[1])[None, :] >= lengths[:, None]  # torch: True = padding
    ref, ref_w = theirs(x, ctx, ctx, key_padding_mask=kpm, average_attn_weights=False)
    mask, _ = ours.mask_from_torch(key_padding_mask=kpm)
    out, w = ours(x, ctx if cross else None, mask=mask, need_weights=True)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)


def test_equals_torch_with_causal_attn_mask_and_kdim_vdim():
    torch.manual_seed(1)
    theirs = nn.MultiheadAttention(32, 4, kdim=20, vdim=12, batch_first=True).eval()
    ours = MultiHeadAttention.from_torch(theirs)
    x, kx, vx = torch.randn(2, 5, 32), torch.randn(2, 5, 20), torch.randn(2, 5, 12)
    blocked = ~masks.causal(5)  # torch: True = blocked
    ref, _ = theirs(x, kx, vx, attn_mask=blocked)
    mask, bias = ours.mask_from_torch(attn_mask=blocked)
    torch.testing.assert_close(
        ours(x, kx, value=vx, mask=mask, attn_bias=bias), ref, atol=1e-6, rtol=1e-5
    )
    torch.testing.assert_close(ours(x, kx, value=vx, causal=True), ref, atol=1e-6, rtol=1e-5)


def test_to_torch_round_trip():
    torch.manual_seed(2)
    ours = MultiHeadAttention(24, 3).eval()
    theirs = ours.to_torch().eval()
    x = torch.randn(2, 6, 24)
    torch.testing.assert_close(
        ours(x), theirs(x, x, x, need_weights=False)[0], atol=1e-6, rtol=1e-5
    )
    back = MultiHeadAttention.from_torch(theirs)
    for a, b in zip(ours.state_dict().values(), back.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("position", [None, "rope", "alibi"])
def test_kv_cache_decoding_equals_full_causal(n_kv_heads, position):
    torch.manual_seed(3)
    pos = {None: None, "rope": RotaryEmbedding(8), "alibi": ALiBi(4)}[position]
    mha = MultiHeadAttention(32, 4, n_kv_heads=n_kv_heads, position=pos).eval()
    x = torch.randn(2, 9, 32)
    full = mha(x, causal=True)
    cache = KVCache()
    chunks = [x[:, :3], x[:, 3:4], x[:, 4:5], x[:, 5:9]]  # a prompt, single tokens, a few
    steps = torch.cat([mha(c, causal=True, cache=cache) for c in chunks], dim=1)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)
    assert len(cache) == 9 and cache.keys.shape == (2, n_kv_heads, 9, 8)


def test_cross_attention_cache_projects_memory_once():
    torch.manual_seed(4)
    mha = MultiHeadAttention(16, 2).eval()
    memory, y = torch.randn(2, 7, 16), torch.randn(2, 3, 16)
    cache = KVCache()
    first = mha(y[:, :1], memory, cache=cache)
    calls = []
    mha.w_k.register_forward_hook(lambda *a: calls.append(1))
    second = mha(y[:, 1:], memory, cache=cache)
    assert calls == []  # keys came from the cache
    torch.testing.assert_close(torch.cat([first, second], 1), mha(y, memory))


def test_rope_scores_depend_on_relative_position_only():
    rope = RotaryEmbedding(16)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    s = [(rope.rotate(q, p + 3) @ rope.rotate(k, p).transpose(-1, -2)).item() for p in (0, 5, 40)]
    assert s[0] == pytest.approx(s[1], abs=1e-4) and s[0] == pytest.approx(s[2], abs=1e-4)


def test_cache_reorder_and_bad_batch():
    mha = MultiHeadAttention(16, 2).eval()
    cache = KVCache()
    mha(torch.randn(3, 2, 16), causal=True, cache=cache)
    cache.reorder(torch.tensor([2, 2, 0]))
    assert cache.batch_size == 3
    with pytest.raises(ValueError, match="batch size 3"):
        mha(torch.randn(2, 1, 16), causal=True, cache=cache)


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: MultiHeadAttention(30, 4), "d_model=30, n_heads=4"),
        (lambda: MultiHeadAttention(32, 4, n_kv_heads=3), "n_kv_heads=3"),
        (lambda: MultiHeadAttention(32, 4)(torch.randn(2, 3, 31)), r"\(B, T, 32\)"),
        (lambda: MultiHeadAttention(32, 4)(torch.randn(2, 3, 32).double()), "float64"),
        (
            lambda: MultiHeadAttention(32, 4)(torch.randn(2, 3, 32), torch.randn(3, 3, 32)),
            "batch size 2",
        ),
    ],
)
def test_bad_input(make, words):
    with pytest.raises((ValueError, TypeError), match=words):
        make()


def test_weights_heads_needs_need_weights():
    mha = MultiHeadAttention(16, 4).eval()
    x = torch.randn(1, 3, 16)
    with pytest.raises(ValueError, match="need_weights=True"):
        mha(x, weights_heads=[1])
    _, w = mha(x, need_weights=True, weights_heads=[1, 3])
    _, all_w = mha(x, need_weights=True)
    torch.testing.assert_close(w, all_w[:, [1, 3]])
