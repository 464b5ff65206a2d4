"""Attention variants on the fused C++ kernel against the fp64 reference math.

Biases (every broadcast shape, with gradients), ALiBi slopes, relative-position tables (T5),
soft-capping, and block masks (document, prefix-LM, sink + window, any mask_fn). The
reference is :func:`qkv.functional.attention_steps` in fp64 with the equivalent dense bias or
mask, built here independently of the code under test; bf16 is bounded by PyTorch's own bf16
SDPA error given the same float mask; T5 buckets are checked against transformers' own.
"""

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as TF
from hypothesis import given

import qkv.kernels.flash as flash_mod
from native import assert_level_ok, other_levels, require_built
from qkv import MultiHeadAttention, masks
from qkv.functional import attention_steps, scaled_dot_product_attention
from qkv.kernels._native import native_ops, native_status
from qkv.kernels.flash import flash_attention

require_built(native_ops() is not None, "fused CPU kernel", native_status())


def _dense_alibi(slopes, Tq, Tk):
    """-slope_h·|p(i) - j| with p(i) = Tk - Tq + i: (1, h, Tq, Tk)."""
    i = torch.arange(Tq, dtype=slopes.dtype)[:, None] + (Tk - Tq)
    j = torch.arange(Tk, dtype=slopes.dtype)[None, :]
    return -slopes[None, :, None, None] * (i - j).abs()


def _dense_rel(rel, Tq, Tk):
    """rel[h, Tk - 1 + j - p(i)]: (1, h, Tq, Tk), by loops over the distances."""
    out = rel.new_zeros(1, rel.shape[0], Tq, Tk)
    for i in range(Tq):
        for j in range(Tk):
            out[0, :, i, j] = rel[:, Tk - 1 + j - (Tk - Tq + i)]
    return out


BIAS_SHAPES = ["none", "2d", "heads", "full", "keys", "rows"]


def _bias(kind, B, h, Tq, Tk, g):
    shape = {
        "2d": (Tq, Tk), "heads": (1, h, Tq, Tk), "full": (B, h, Tq, Tk), "keys": (B, 1, 1, Tk),
        "rows": (1, h, Tq, 1),
    }.get(kind)  # fmt: skip
    return None if shape is None else torch.randn(*shape, generator=g)


@st.composite
def variant_case(draw):
    B, h_kv, G = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    Tq, Tk = draw(st.integers(1, 70)), draw(st.integers(1, 70))
    d, d_v = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    h = h_kv * G
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(B, h, Tq, d, generator=g)
    k = torch.randn(B, h_kv, Tk, d, generator=g)
    v = torch.randn(B, h_kv, Tk, d_v, generator=g)
    kw = dict(
        causal=draw(st.booleans()),
        window=draw(st.none() | st.integers(1, 25)),
        scale=draw(st.none() | st.floats(0.05, 2.0)),
        softcap=draw(st.none() | st.floats(0.5, 20.0)),
    )
    extra = {}
    bias = _bias(draw(st.sampled_from(BIAS_SHAPES)), B, h, Tq, Tk, g)
    if bias is not None:
        extra["bias"] = bias
    if draw(st.booleans()):
        extra["alibi_slopes"] = torch.rand(h, generator=g)
    if draw(st.booleans()):
        extra["rel_bias"] = torch.randn(h, Tq + Tk - 1, generator=g)
    if draw(st.booleans()):
        kw["mask"] = torch.rand(B, 1, Tq, Tk, generator=g) > 0.2
    blocks = dict(block_q=draw(st.integers(1, 40)), block_k=draw(st.integers(1, 50)))
    return q, k, v, kw, extra, blocks


@given(variant_case())
def test_variants_equal_fp64_math_values_and_gradients(case):
    """Random shapes, GQA, causal/window, masks, block sizes; every variant and mixes of them."""
    q, k, v, kw, extra, blocks = case
    assert flash_mod._native_ok(q, k, v, kw.get("mask"), 1.0)
    inputs = [t.requires_grad_() for t in (q, k, v, *extra.values())]
    out, lse = flash_attention(q, k, v, **kw, **extra, **blocks, return_lse=True)
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    named = dict(zip(extra, ref_in[3:]))
    Tq, Tk = q.shape[-2], k.shape[-2]
    bias = named.get("bias")
    for name, dense in (("alibi_slopes", _dense_alibi), ("rel_bias", _dense_rel)):
        if name in named:
            b = dense(named[name], Tq, Tk)
            bias = b if bias is None else bias + b
    ref = attention_steps(*ref_in[:3], **kw, bias=bias)
    torch.testing.assert_close(out.double(), ref.output, atol=3e-5, rtol=1e-4)
    assert torch.equal(lse == float("-inf"), ref.lse == float("-inf"))
    finite = ref.lse > float("-inf")
    torch.testing.assert_close(lse.double()[finite], ref.lse[finite], atol=3e-5, rtol=1e-4)
    g = torch.randn_like(out)
    ours = torch.autograd.grad(out, inputs, g)
    theirs = torch.autograd.grad(ref.output, ref_in, g.double(), allow_unused=True)
    for a, b in zip(ours, theirs):
        b = torch.zeros_like(a, dtype=torch.float64) if b is None else b
        # slopes/rel sum over many pairs: relative tolerance on their size
        torch.testing.assert_close(a.double(), b, atol=3e-4 * (1 + b.abs().max()), rtol=1e-3)


def test_bias_with_minus_inf_rows_gives_zeros_like_the_reference():
    """An additive mask in the bias: -inf entries and whole rows of them."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 40, 8, requires_grad=True) for _ in range(3))
    bias = torch.randn(2, 3, 40, 40).masked_fill(torch.rand(2, 3, 40, 40) < 0.5, float("-inf"))
    bias[:, :, 5] = float("-inf")
    bias.requires_grad_()
    out = flash_attention(q, k, v, bias=bias, softcap=4.0, block_q=16, block_k=16)
    assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5]))
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    ref = attention_steps(*ref_in[:3], bias=ref_in[3], softcap=4.0).output
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    g = torch.randn_like(out)
    for a, b in zip(
        torch.autograd.grad(out, (q, k, v, bias), g),
        torch.autograd.grad(ref, ref_in, g.double()),
    ):
        b = b.nan_to_num(0.0)  # the reference's -inf entries: 0 gradient there
        torch.testing.assert_close(a.double(), b, atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("variant", ["bias", "alibi", "softcap", "rel"])
def test_bf16_variants_within_pytorch_bf16_error(variant):
    """bf16 against fp64 math, bounded by PyTorch's bf16 SDPA given the same float mask."""
    torch.manual_seed(1)
    B, h, T, d = 1, 4, 300, 64
    q, k, v = (torch.randn(B, h, T, d).bfloat16().requires_grad_() for _ in range(3))
    slopes = masks.alibi_slopes(h)
    rel = torch.randn(h, 2 * T - 1)
    bias = torch.randn(1, h, T, T)
    kw = {
        "bias": dict(bias=bias), "alibi": dict(alibi_slopes=slopes), "softcap": dict(softcap=5.0),
        "rel": dict(rel_bias=rel),
    }[variant]  # fmt: skip
    dense = {
        "bias": bias, "alibi": _dense_alibi(slopes, T, T), "softcap": None,
        "rel": _dense_rel(rel, T, T),
    }[variant]  # fmt: skip
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attention_steps(
        *ref_in, causal=True, bias=None if dense is None else dense.double(),
        softcap=kw.get("softcap"),
    ).output  # fmt: skip
    g = torch.randn_like(ref)
    ref_g = torch.autograd.grad(ref, ref_in, g)
    ours = flash_attention(q, k, v, causal=True, **kw)
    err = (ours.double() - ref).abs().max()
    if variant != "softcap":  # torch SDPA has no soft-capping: bound by bf16 rounding then
        allowed = masks.causal(T)
        am = torch.where(allowed, dense, float("-inf")).bfloat16()
        theirs = TF.scaled_dot_product_attention(q, k, v, attn_mask=am)
        assert err <= 4 * (theirs.double() - ref).abs().max() + 1e-3, err
    else:
        assert err <= 2e-2, err
    ours_g = torch.autograd.grad(ours, (q, k, v), g.bfloat16())
    scale = max(t.abs().max() for t in ref_g)
    for a, r in zip(ours_g, ref_g):
        assert (a.double() - r).abs().max() <= 0.05 * scale


def test_alibi_slopes_equal_the_alibi_bias_on_every_backend():
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 8, 33, 16) for _ in range(3))
    slopes = masks.alibi_slopes(8)
    ref = attention_steps(q.double(), k.double(), v.double(), causal=True,
                          bias=masks.alibi_bias(8, 33).double()).output  # fmt: skip
    for backend in ("auto", "flash", "torch", "math"):
        out = scaled_dot_product_attention(
            q, k, v, causal=True, alibi_slopes=slopes, backend=backend
        )
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)


def test_t5_buckets_and_table_match_transformers():
    from transformers.models.t5.modeling_t5 import T5Attention

    r = torch.arange(-400, 400)
    for bidirectional in (True, False):
        for nb, md in ((32, 128), (16, 64)):
            ours = masks.t5_bucket(r, bidirectional=bidirectional, num_buckets=nb, max_distance=md)
            theirs = T5Attention._relative_position_bucket(
                r, bidirectional=bidirectional, num_buckets=nb, max_distance=md
            )
            assert torch.equal(ours, theirs)
    # the table through rel_bias == T5's dense position bias table[:, bucket(j - i)]
    torch.manual_seed(3)
    h, Tq, Tk = 4, 20, 50
    table = torch.randn(h, 32, dtype=torch.float64, requires_grad=True)
    q, k, v = torch.randn(1, h, Tq, 8), torch.randn(1, h, Tk, 8), torch.randn(1, h, Tk, 8)
    out = scaled_dot_product_attention(
        q, k, v, rel_bias=masks.t5_relative_bias(table.float(), Tq, Tk)
    )
    pos_q = torch.arange(Tq)[:, None] + (Tk - Tq)
    buckets = T5Attention._relative_position_bucket(torch.arange(Tk)[None, :] - pos_q)
    dense = table[:, buckets].unsqueeze(0)  # (1, h, Tq, Tk)
    ref = attention_steps(q.double(), k.double(), v.double(), bias=dense).output
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    g = torch.randn_like(out)
    (ours,) = torch.autograd.grad(out, table, g)
    (theirs,) = torch.autograd.grad(ref, table, g.double())
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-3)


def test_bad_variant_arguments_raise_one_clear_error():
    q = torch.randn(1, 4, 10, 8)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(4,\)"):
        scaled_dot_product_attention(q, q, q, alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match=r"rel_bias must have shape \(4, 19\)"):
        scaled_dot_product_attention(q, q, q, rel_bias=torch.ones(4, 10))
    with pytest.raises(TypeError, match="alibi_slopes must be a floating-point"):
        scaled_dot_product_attention(q, q, q, alibi_slopes=torch.ones(4, dtype=torch.long))
    with pytest.raises(ValueError, match="mask: BlockMask .* does not fit"):
        scaled_dot_product_attention(q, q, q, mask=masks.sliding_window_mask(12, 4))


# --- block masks (their construction: tests/test_block_mask.py) ---------------------------


def _pairs(Tq, Tk):
    return torch.arange(Tq)[:, None], torch.arange(Tk)[None, :]


@st.composite
def block_mask_case(draw):
    """(BlockMask, the same mask built densely here (B|1, H|1, T, T), batch, heads)."""
    kind = draw(st.sampled_from(["document", "prefix", "sink_window", "mask_fn"]))
    T = draw(st.integers(1, 200))
    bs = (draw(st.sampled_from([1, 8, 16, 32, 64])), draw(st.sampled_from([8, 16, 32, 64])))
    B = draw(st.integers(1, 2))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    i, j = _pairs(T, T)
    if kind == "document":
        ids = torch.randint(0, 4, (B, T), generator=g)
        if draw(st.booleans()):
            ids = ids.sort(dim=1).values  # packed documents (unsorted segments are valid too)
        causal = draw(st.booleans())
        window = draw(st.none() | st.integers(1, 40)) if causal else None
        bm = masks.document_mask(ids, causal=causal, window=window, block_size=bs)
        dense = ids[:, :, None] == ids[:, None, :]
        if causal:
            dense = dense & (j <= i)
        if window is not None:
            dense = dense & (i - j < window)
        return bm, dense[:, None], B, 1
    if kind == "prefix":
        L = torch.randint(0, T + 1, (B,), generator=g)
        bm = masks.prefix_lm_mask(L, T, block_size=bs)
        return bm, ((j <= i) | (j < L[:, None, None]))[:, None], B, 1
    if kind == "sink_window":
        w, s = draw(st.integers(1, 60)), draw(st.integers(0, 8))
        bm = masks.sliding_window_mask(T, w, sinks=s, block_size=bs)
        return bm, ((j <= i) & ((i - j < w) | (j < s)))[None, None], 1, 1
    H = draw(st.integers(1, 3))
    period = draw(st.integers(2, 9))

    def fn(b, h, q, kv):  # depends on the batch entry and the head
        return ((kv <= q) & ((q - kv) % period != h)) | (kv == b)

    bm = masks.create_block_mask(fn, B, H, T, T, block_size=bs)
    b = torch.arange(B)[:, None, None, None]
    h = torch.arange(H)[None, :, None, None]
    dense = ((j <= i) & ((i - j) % period != h)) | (j == b)  # (B, H, T, T)
    return bm, dense, B, H


@given(block_mask_case(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_block_masks_equal_the_dense_mask_values_and_gradients(case, dtype):
    bm, dense, B, H = case
    assert torch.equal(bm.to_dense(), dense.expand(bm.to_dense().shape))
    assert bm.tiles.shape[0] <= bm.counts()["partial"]  # tiles only for partial blocks
    T = bm.Tq
    h = 2 * H if H > 1 else 2
    torch.manual_seed(T)
    q = torch.randn(B, h if H == 1 else H, T, 16, dtype=dtype, requires_grad=True)
    k = torch.randn(B, 1, T, 16, dtype=dtype, requires_grad=True)  # GQA: one kv head
    v = torch.randn(B, 1, T, 8, dtype=dtype, requires_grad=True)
    out, lse = flash_attention(q, k, v, mask=bm, return_lse=True)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attention_steps(*ref_in, mask=dense)
    assert torch.equal(lse == float("-inf"), ref.lse == float("-inf"))
    g = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), g)
    theirs = torch.autograd.grad(ref.output, ref_in, g.double())
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref.output, atol=2e-5, rtol=1e-4)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a.double(), b, atol=2e-4, rtol=1e-3)
    else:  # bf16: a few bf16 ulps of the largest value
        assert (out.double() - ref.output).abs().max() <= 0.03
        for a, b in zip(ours, theirs):
            assert (a.double() - b).abs().max() <= 0.05 * (b.abs().max() + 1e-3)


def test_block_mask_through_sdpa_and_multihead_attention():
    """Every backend and MultiHeadAttention accept a BlockMask; all equal the dense mask."""
    torch.manual_seed(4)
    ids = torch.tensor([0] * 70 + [1] * 100 + [2] * 30)
    bm = masks.document_mask(ids, block_size=32)
    dense = bm.to_dense()
    q, k, v = (torch.randn(2, 4, 200, 16) for _ in range(3))
    ref = attention_steps(q.double(), k.double(), v.double(), mask=dense).output
    for backend in ("auto", "flash", "torch", "math"):
        out = scaled_dot_product_attention(q, k, v, mask=bm, backend=backend)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    out, w = scaled_dot_product_attention(q, k, v, mask=bm, return_weights=True,
                                          weights_heads=[2])  # fmt: skip
    ref_w = attention_steps(q.double(), k.double(), v.double(), mask=dense).weights[:, 2:3]
    torch.testing.assert_close(w.double(), ref_w, atol=2e-5, rtol=1e-4)
    mha = MultiHeadAttention(32, 4)
    x = torch.randn(2, 200, 32)
    torch.testing.assert_close(mha(x, mask=bm), mha(x, mask=dense), atol=2e-5, rtol=1e-4)


_LEVEL_CHECK_SCRIPT = """
import torch
from qkv import masks
from qkv.functional import attention_steps
from qkv.kernels._native import native_status
from qkv.kernels.flash import alibi_dense, flash_attention, rel_dense
torch.manual_seed(0)
q = torch.randn(2, 4, 70, 16)
k, v = torch.randn(2, 2, 90, 16), torch.randn(2, 2, 90, 16)
slopes, rel = torch.rand(4), torch.randn(4, 159)
bias = torch.randn(2, 1, 70, 90).masked_fill(torch.rand(2, 1, 70, 90) < 0.2, float("-inf"))
dense = bias + alibi_dense(slopes, 70, 90) + rel_dense(rel, 70, 90)
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
    x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    b = bias.to(dtype).requires_grad_()
    kw = dict(causal=True, window=40, softcap=5.0)
    out = flash_attention(*x, bias=b, alibi_slopes=slopes, rel_bias=rel, **kw, block_q=16,
                          block_k=32)
    ref = attention_steps(*(t.double() for t in x), bias=dense.double(), **kw).output
    assert (out.double() - ref).abs().max() < tol, dtype
    g = torch.autograd.grad(out.sum(), x)
    r = torch.autograd.grad(ref.sum(), x)
    assert max((a.double() - c.double()).abs().max() for a, c in zip(g, r)) < 10 * tol
bm = masks.create_block_mask(lambda b, h, i, j: (j <= i) & ((i - j) % 3 != 1), None, None, 90, 90,
                             block_size=32)
x = torch.randn(1, 2, 90, 16)
out = flash_attention(x, x, x, mask=bm)
ref = attention_steps(*(x.double() for _ in "qkv"), mask=bm.to_dense()).output
assert (out.double() - ref).abs().max() < 1e-5
print("ok")
"""


@pytest.mark.parametrize("level", other_levels())
def test_every_level_runs_the_variants(level):
    """The variants' row code of each other level this CPU can run (the plain C++ of the
    portable build included) against fp64 math."""
    assert_level_ok(_LEVEL_CHECK_SCRIPT, level)


def test_explain_dispatch_names_the_route_of_the_variants():
    from qkv.functional import explain_dispatch

    q = torch.randn(1, 4, 64, 16)
    slopes = masks.alibi_slopes(4)
    d = explain_dispatch(q, q, q, alibi_slopes=slopes, causal=True)
    assert d.backend == "flash" and d.kernel == "fused C++ kernel" and "ALiBi" in d.reasons["torch"]
    bm = masks.document_mask(torch.tensor([0] * 30 + [1] * 34))
    assert explain_dispatch(q, q, q, mask=bm).backend == "flash"
    # dropout: flash cannot run it, so the slopes become a dense bias for the other backends
    d = explain_dispatch(q, q, q, alibi_slopes=slopes, dropout_p=0.1)
    assert d.backend == "torch" and "dropout" in d.reasons["flash"]
    assert explain_dispatch(q, q, q, mask=bm, backend="math").backend == "math"


def test_block_mask_with_two_batch_dims():
    """A BlockMask for B = 2·3 entries serves q (2, 3, h, T, d) (batch flattened)."""
    torch.manual_seed(6)
    q = torch.randn(2, 3, 4, 50, 8, requires_grad=True)
    ids = torch.randint(0, 3, (6, 50)).sort(1).values
    bm = masks.document_mask(ids, block_size=16)
    dense = (ids[:, :, None] == ids[:, None, :]) & masks.causal(50)  # (6, 50, 50)
    out = scaled_dot_product_attention(q, q, q, mask=bm)
    ref = attention_steps(*(q.detach().double() for _ in "qkv"), mask=dense.view(2, 3, 1, 50, 50))
    torch.testing.assert_close(out.double(), ref.output, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_groups_of_partial_blocks_equal_fp64(dtype):
    """128-row blocks whose groups of 32 rows see different key ranges (documents ending
    mid-block, a window's edge, groups that see no key of a block, a short last block):
    values and gradients against fp64, as the dense mask gives them."""
    T = 333
    ids = torch.tensor([0] * 40 + [1] * 5 + [2] * 150 + [3] * 138)
    cases = [
        masks.document_mask(ids, window=70),
        masks.sliding_window_mask(T, 45, sinks=3),
        masks.create_block_mask(lambda b, h, q, kv: (kv <= q) & (q - kv < 100), None, None, T, T),
    ]
    torch.manual_seed(7)
    for bm in cases:
        q = torch.randn(1, 2, T, 32, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(1, 2, T, 32, dtype=dtype, requires_grad=True) for _ in range(2))
        out = flash_attention(q, k, v, mask=bm)
        ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = attention_steps(*ref_in, mask=bm.to_dense()).output
        g = torch.randn_like(ref)
        ours = torch.autograd.grad(out, (q, k, v), g.to(dtype))
        theirs = torch.autograd.grad(ref, ref_in, g)
        if dtype == torch.float32:
            torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
            for a, b in zip(ours, theirs):
                torch.testing.assert_close(a.double(), b, atol=2e-4, rtol=1e-3)
        else:
            assert (out.double() - ref).abs().max() <= 0.03
            for a, b in zip(ours, theirs):
                assert (a.double() - b).abs().max() <= 0.05 * (b.abs().max() + 1e-3)
