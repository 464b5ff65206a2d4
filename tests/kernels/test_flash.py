"""qkv.kernels (flash, varlen, weights) against the reference math and PyTorch's SDPA.

Small block sizes exercise the tiling: lengths that are not multiples of the block, key
blocks skipped by causal/window structure, fully masked rows.
"""

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as TF
from hypothesis import given

from qkv import masks
from qkv.functional import attention_steps
from qkv.kernels._blocks import Structure
from qkv.kernels.flash import flash_attention
from qkv.varlen import packed_mask, varlen_attention
from qkv.weights import weights_from_lse
from strategies import draw_mask_and_bias


@st.composite
def flash_case(draw):
    B = draw(st.integers(1, 2))
    h_kv = draw(st.integers(1, 2))
    h = h_kv * draw(st.integers(1, 3))
    Tq, Tk = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    d, d_v = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(B, h, Tq, d, generator=g, dtype=torch.float64)
    k = torch.randn(B, h_kv, Tk, d, generator=g, dtype=torch.float64)
    v = torch.randn(B, h_kv, Tk, d_v, generator=g, dtype=torch.float64)
    kw = dict(
        causal=draw(st.booleans()),
        window=draw(st.none() | st.integers(1, 12)),
        softcap=draw(st.none() | st.floats(0.5, 5.0)),
        scale=draw(st.none() | st.floats(0.1, 2.0)),
    )
    mask, bias = draw_mask_and_bias(draw, g, B, h, Tq, Tk, torch.float64)
    kw.update({n: t for n, t in (("mask", mask), ("bias", bias)) if t is not None})
    blocks = dict(block_q=draw(st.integers(1, 16)), block_k=draw(st.integers(1, 16)))
    return q, k, v, kw, blocks


def _grads(out, inputs, g):
    return torch.autograd.grad(out, inputs, g, allow_unused=True)


@given(flash_case())
def test_flash_equals_math_values_lse_gradients(case):
    q, k, v, kw, blocks = case
    inputs = [t.requires_grad_() for t in (q, k, v)]
    if "bias" in kw:
        inputs.append(kw["bias"].requires_grad_())
    ref = attention_steps(q, k, v, **kw)
    out, lse = flash_attention(q, k, v, **kw, **blocks, return_lse=True)
    torch.testing.assert_close(out, ref.output, atol=1e-10, rtol=1e-10)
    assert torch.equal(lse == float("-inf"), ref.lse == float("-inf"))
    finite = ref.lse > float("-inf")
    torch.testing.assert_close(lse[finite], ref.lse[finite], atol=1e-10, rtol=1e-10)
    g = torch.randn_like(out)
    for a, b in zip(_grads(out, inputs, g), _grads(ref.output, inputs, g)):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_flash_matches_pytorch_sdpa_with_dense_mask():
    """Against a reference nobody here wrote: PyTorch SDPA given the same window as a mask."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 70, 16, dtype=torch.float64)
    k, v = (
        torch.randn(2, 2, 90, 16, dtype=torch.float64),
        torch.randn(2, 2, 90, 8, dtype=torch.float64),
    )
    allowed = masks.sliding_window(70, 90, 9, causal=True)
    ref = TF.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    out = flash_attention(q, k, v, causal=True, window=9, block_q=16, block_k=32)
    torch.testing.assert_close(out, ref)


def test_fully_masked_rows_are_zero_with_zero_grads():
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.ones(9, 9, dtype=torch.bool)
    mask[[0, 4, 8]] = False
    out, lse = flash_attention(q, k, v, mask=mask, return_lse=True, block_q=2, block_k=3)
    assert torch.all(out[:, :, [0, 4, 8]] == 0) and torch.all(lse[:, :, [0, 4, 8]] == float("-inf"))
    out.sum().backward()
    assert not any(t.grad.isnan().any() for t in (q, k, v))
    assert torch.all(q.grad[:, :, [0, 4, 8]] == 0)
    # causal with Tq > Tk (bottom-right): the first Tq - Tk queries see nothing
    q2 = torch.randn(1, 1, 6, 4, dtype=torch.float64)
    o2 = flash_attention(q2, k[:, :1, :3], v[:, :1, :3], causal=True, block_q=2, block_k=2)
    assert torch.all(o2[..., :3, :] == 0) and not o2.isnan().any()


def test_gradcheck_fp64_small():
    torch.manual_seed(1)
    q = torch.randn(1, 4, 7, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 9, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 9, 2, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(1, 4, 7, 9, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, bias):
        return flash_attention(
            q, k, v, bias=bias, causal=True, window=5, softcap=2.0, block_q=3, block_k=4
        )

    assert torch.autograd.gradcheck(f, (q, k, v, bias))


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_error_within_pytorch_bf16_error(causal):
    """bf16 flash vs fp64 math, bounded by PyTorch's own bf16 SDPA error (times a margin)."""
    torch.manual_seed(2)
    q, k, v = (
        torch.randn(2, 4, 300, 64, dtype=torch.float64, requires_grad=True) for _ in range(3)
    )
    ref = attention_steps(q, k, v, causal=causal).output
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    lo = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    ours = flash_attention(*lo, causal=causal, block_q=64, block_k=128)
    theirs = TF.scaled_dot_product_attention(*lo, is_causal=causal)
    err_ours, err_theirs = (ours.double() - ref).abs().max(), (theirs.double() - ref).abs().max()
    assert err_ours <= 4 * err_theirs + 1e-3, (err_ours, err_theirs)
    ours_g = torch.autograd.grad(ours, lo, g.bfloat16())
    theirs_g = torch.autograd.grad(theirs, lo, g.bfloat16())
    for a, b, r in zip(ours_g, theirs_g, ref_grads):
        assert (a.double() - r).abs().max() <= 2 * (b.double() - r).abs().max() + 1e-3
    fp32 = flash_attention(*(t.detach().float() for t in (q, k, v)), causal=causal, block_q=64)
    torch.testing.assert_close(fp32.double(), ref, atol=1e-5, rtol=1e-5)


def test_block_skipping_visits_only_the_window():
    """Key ranges per query block cover at most window + block - 1 keys (O(T·w) work)."""
    s = Structure(Tq=4096, Tk=4096, causal=True, window=256)
    for qs in range(0, 4096, 128):
        lo, hi = s.key_range(qs, qs + 128)
        assert hi - lo <= 256 + 128 - 1
    assert s.visible_pairs() == int(masks.sliding_window(4096, 4096, 256).sum())
    # causal: the first query block sees only its own keys
    assert Structure(512, 512, True, None).key_range(0, 64) == (0, 64)


@pytest.mark.parametrize("heads", [[0], [1, 3], None])
def test_weights_from_lse_equal_math_weights(heads):
    torch.manual_seed(3)
    q = torch.randn(2, 4, 11, 8, dtype=torch.float64)
    k, v = (
        torch.randn(2, 2, 13, 8, dtype=torch.float64),
        torch.randn(2, 2, 13, 8, dtype=torch.float64),
    )
    bias = torch.randn(1, 4, 11, 13, dtype=torch.float64)
    mask = torch.rand(2, 1, 11, 13) > 0.2
    kw = dict(causal=True, window=6, bias=bias, mask=mask, softcap=3.0)
    _, lse = flash_attention(q, k, v, **kw, return_lse=True, block_q=4, block_k=4)
    w = weights_from_lse(q, k, lse, heads=heads, **kw)
    ref = attention_steps(q, k, v, **kw).weights
    ref = ref if heads is None else ref[:, heads]
    torch.testing.assert_close(w, ref)


@pytest.mark.parametrize("lengths", [[5, 5, 5], [3, 17, 1, 9], [0, 4, 6]])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_equals_block_diagonal_mask(lengths, causal):
    torch.manual_seed(4)
    cu = torch.tensor([0, *lengths]).cumsum(0)
    total = int(cu[-1])
    q = torch.randn(total, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(total, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(total, 2, 6, dtype=torch.float64, requires_grad=True)
    out, lse = varlen_attention(q, k, v, cu, causal=causal, return_lse=True, block_q=4, block_k=4)
    mask = packed_mask(cu, causal=causal)
    qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))  # (heads, total, d)
    ref = TF.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, ref.transpose(0, 1))
    torch.testing.assert_close(lse, attention_steps(qh, kh, vh, mask=mask).lse)
    g = torch.randn_like(out)
    for a, b in zip(_grads(out, (q, k, v), g), _grads(ref.transpose(0, 1), (q, k, v), g)):
        torch.testing.assert_close(a, b)
    for backend in ("auto", "torch", "math"):
        other = varlen_attention(q, k, v, cu, causal=causal, backend=backend)
        torch.testing.assert_close(other, out)


def test_varlen_cross_lengths_and_errors():
    torch.manual_seed(5)
    q, k = torch.randn(6, 2, 4), torch.randn(9, 2, 4)
    out = varlen_attention(q, k, k, [0, 2, 6], [0, 5, 9], causal=True)
    mask = packed_mask([0, 2, 6], [0, 5, 9], causal=True)
    ref = attention_steps(q.transpose(0, 1), k.transpose(0, 1), k.transpose(0, 1), mask=mask)
    torch.testing.assert_close(out, ref.output.transpose(0, 1))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        varlen_attention(q, k, k, [0, 2, 5])
    with pytest.raises(ValueError, match="backend"):
        varlen_attention(q, k, k, [0, 2, 6], [0, 5, 9], return_lse=True, backend="torch")
    with pytest.raises(ValueError, match="block_q"):
        flash_attention(q.transpose(0, 1), k.transpose(0, 1), k.transpose(0, 1), block_q=0)


@pytest.mark.parametrize("backend", ["flash", "decode", "auto"])
def test_a_single_keys_mask_or_bias_column_with_any_stride(backend):
    """A (.., Tq, 1) mask or bias may carry any stride on its size-1 key dim (contiguous()
    leaves it so; T5's cross-attention bias does): the kernels read it all the same."""
    from qkv.functional import scaled_dot_product_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 1 if backend == "decode" else 3, 8, generator=g)
    k = v = torch.randn(1, 2, 1, 8, generator=g)
    Tq = q.shape[-2]
    bias = torch.randn(1, 2, 5, Tq, generator=g).transpose(-1, -2)[..., :1]  # stride(-1) = Tq
    mask = torch.rand(1, 2, 5, Tq, generator=g).transpose(-1, -2)[..., :1] > 0.3
    for kw in ({"bias": bias}, {"mask": mask}):
        if backend == "decode" and "bias" in kw:
            continue  # the decode kernel takes no bias
        got = scaled_dot_product_attention(q, k, v, backend=backend, **kw)
        want = scaled_dot_product_attention(q, k, v, backend="math", **kw)
        torch.testing.assert_close(got, want)
