"""The decode kernel (qkv/csrc/decode_cpu.cpp) against the fp64 reference math, and its dispatch.

Every case compares values and log-sum-exp with :func:`qkv.functional.attention_steps` run in
float64 on the same (exactly representable) inputs. Tolerances follow the kernel's
arithmetic: scores are fp32 sums of exact products, so a row's score error is at most
``E = (d + 3)·eps32·scale·max_j Σ|q||k|``; that moves the softmax weights by at most ``2E``
(1-norm) and the output by ``2E·max|v|``; on top come the fp32 sums over the keys (at most
``Tk·eps32·max|v|``) and the rounding of the output to its dtype: bf16 outputs are within
``2^-8·max|v|`` more (the weights are rounded to bf16 for the P·V products, as in PyTorch's
bf16 kernels, and the output is rounded: each at most ``2^-9`` relative); and the error stays
within 2× PyTorch's own bf16 SDPA error on the same call (FlashAttention's test rule).
"""

import itertools
import math

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as TF
from hypothesis import given, settings

from native import assert_level_ok, assert_script_ok, other_levels, require_built
from qkv import dispatch, masks
from qkv._validate import check_qkv
from qkv.functional import attention_steps, explain_dispatch, scaled_dot_product_attention
from qkv.kernels import decode as decode_mod
from qkv.kernels._native import decode_ops, native_level, native_status
from qkv.kernels.decode import MAX_TQ, decode_attention, run_decode

require_built(decode_ops() is not None, "decode kernel", native_status())

EPS32 = torch.finfo(torch.float32).eps


def _tolerances(q, k, v, kw, *, int16=False):
    """(output tolerance (..., h, Tq, 1), lse tolerance (..., h, Tq)) as the docstring says.

    ``int16``: the int8 cache's loops (k, v its dequantized rows), which round the queries
    and the softmax weights to int16 and add two more fp32 products per score and output.
    """
    h, h_kv, d = q.shape[-3], k.shape[-3], q.shape[-1]
    kk = k.double().abs().repeat_interleave(h // h_kv, dim=-3)
    scale = kw.get("scale") or 1 / math.sqrt(d)
    bound = scale * (q.double().abs() @ kk.transpose(-2, -1))  # (..., h, Tq, Tk)
    E = bound.amax(dim=-1) * (d + (5 if int16 else 3)) * EPS32  # (..., h, Tq)
    sums = k.shape[-2] * EPS32
    if int16:
        q_step = q.double().abs().amax(-1, keepdim=True) / 65534  # (..., h, Tq, 1)
        E = E + (scale * q_step * kk.sum(-1).unsqueeze(-2)).amax(dim=-1)
        sums += 2 * EPS32 + 64 / 65534  # the int16 weights of P·V
    v_max = float(v.double().abs().amax()) if v.numel() else 0.0
    low = 2.0**-8 if q.dtype == torch.bfloat16 else 0.0
    out_tol = ((2 * E).clamp(max=2.0) + sums + low) * v_max + 1e-30
    # |lse| <= the largest |score| + log Tk: the fp32 result's own rounding grows with it
    lse_tol = E + 4 * EPS32 * (1 + bound.amax(dim=-1) + math.log(max(k.shape[-2], 1)))
    return out_tol.unsqueeze(-1), lse_tol


def check_decode(q, k, v, out, lse, *, int16=False, **kw):
    """out and lse of the kernel against fp64 attention_steps (kw: its mask options)."""
    ref = attention_steps(q.double(), k.double(), v.double(), **kw)
    out_tol, lse_tol = _tolerances(q, k, v, kw, int16=int16)
    assert out.dtype == q.dtype and out.shape == ref.output.shape
    assert torch.isfinite(out).all()
    err = (out.double() - ref.output).abs()
    assert (err <= out_tol).all(), float((err - out_tol).max())
    seen = torch.isfinite(ref.lse)
    assert torch.equal(seen, torch.isfinite(lse)), "rows with no visible key differ"
    assert (lse[~seen] == float("-inf")).all() and (out[~seen] == 0).all()
    lse_err = (lse.double() - ref.lse).abs()[seen]
    assert (lse_err <= lse_tol[seen]).all(), float((lse_err - lse_tol[seen]).max())


def _cache_view(g, B, h_kv, Tk, d, dtype, layout):
    """K or V of ``Tk`` positions as a non-contiguous view with a contiguous last dim."""
    if layout == "slice":  # a preallocated (B, h_kv, T_max, d) buffer, filled up to Tk
        buf = torch.randn(B, h_kv, Tk + 37, d, generator=g).to(dtype)
        return buf[:, :, :Tk]
    if layout == "offset":  # a ring-buffer-like window starting mid-buffer
        buf = torch.randn(B, h_kv, Tk + 5, d, generator=g).to(dtype)
        return buf[:, :, 5:]
    if layout == "tokens-first":  # (B, T, h_kv, d) storage seen as (B, h_kv, T, d)
        return torch.randn(B, Tk, h_kv, d, generator=g).to(dtype).transpose(1, 2)
    return torch.randn(B, h_kv, Tk, d, generator=g).to(dtype)


@st.composite
def decode_case(draw):
    B, h_kv, G = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    Tq = draw(st.integers(1, MAX_TQ))
    Tk = draw(st.sampled_from([1, 2, 15, 17, 63, 65, 97, 131, 257, 301]) | st.integers(1, 400))
    d = draw(st.sampled_from([1, 5, 16, 31, 33, 64, 80, 128]))
    d_v = draw(st.sampled_from([0, 1, 7, 16, 24, 64, 128]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    layout = draw(st.sampled_from(["contiguous", "slice", "offset", "tokens-first"]))
    q = torch.randn(B, h_kv * G, Tq, d, generator=g).to(dtype)
    k = _cache_view(g, B, h_kv, Tk, d, dtype, layout)
    v = _cache_view(g, B, h_kv, Tk, d_v, dtype, layout)
    kw = dict(
        causal=draw(st.booleans()),
        window=draw(st.none() | st.integers(1, 40)),
        scale=draw(st.none() | st.sampled_from([0.01, 0.3, 2.0])),
    )
    h = h_kv * G
    mask = {
        "none": lambda: None,
        "2d": lambda: torch.rand(Tq, Tk, generator=g) > 0.3,
        "padding": lambda: masks.padding(torch.randint(0, Tk + 1, (B,), generator=g), Tk),
        "full": lambda: torch.rand(B, h, Tq, Tk, generator=g) > 0.3,
        "per-head": lambda: torch.rand(1, h, 1, Tk, generator=g) > 0.5,
        "per-query": lambda: torch.rand(B, 1, Tq, 1, generator=g) > 0.3,  # broadcast over keys
    }[draw(st.sampled_from(["none", "2d", "padding", "full", "per-head", "per-query"]))]()
    if mask is not None:
        kw["mask"] = mask
    threads = draw(st.sampled_from([1, 2]))
    splits = draw(st.sampled_from([0, 0, 2, 3, 5]))
    return q, k, v, kw, threads, splits


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@settings(max_examples=150)
@given(decode_case())
def test_decode_matches_fp64_values_and_lse(case):
    q, k, v, kw, threads, splits = case
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        shape = check_qkv(q, k, v)
        out, lse = run_decode(q, k, v, shape, **{"mask": None, **kw}, splits=splits)
    finally:
        torch.set_num_threads(before)
    check_decode(q, k, v, out, lse, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_cache_over_100k_keys(restore_threads, dtype):
    """Tk = 100 003 (odd, no block multiple), GQA 4:1, a window and key padding, 2 threads."""
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(3)
    Tk = 100_003
    q = torch.randn(2, 4, 3, 32, generator=g).to(dtype)
    k = _cache_view(g, 2, 1, Tk, 32, dtype, "slice")
    v = _cache_view(g, 2, 1, Tk, 24, dtype, "slice")
    pad = masks.padding(torch.tensor([Tk, Tk - 4000]), Tk)  # (B, 1, 1, Tk)
    for kw in ({"causal": True}, {"causal": True, "window": 70_001, "mask": pad}):
        out, lse = decode_attention(q, k, v, **kw, return_lse=True)
        check_decode(q, k, v, out, lse, **kw)


def test_rows_without_visible_keys_are_zero_with_lse_minus_inf():
    """Causal with Tq > Tk (the first queries precede every key), and a fully masked row."""
    q = torch.randn(1, 4, 6, 16)
    k, v = torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 8)
    out, lse = decode_attention(q, k, v, causal=True, return_lse=True)
    check_decode(q, k, v, out, lse, causal=True)
    assert (out[:, :, :2] == 0).all() and (lse[:, :, :2] == float("-inf")).all()
    mask = torch.ones(1, 4, 6, 4, dtype=torch.bool)
    mask[0, 1, 3] = False
    out, lse = decode_attention(q, k, v, mask=mask, return_lse=True)
    assert (out[0, 1, 3] == 0).all() and lse[0, 1, 3] == float("-inf")
    check_decode(q, k, v, out, lse, mask=mask)


def test_bf16_error_is_within_torch_sdpa_own():
    """Our bf16 error is within 2× PyTorch's bf16 SDPA error on the same decode call."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 4, 64, generator=g).bfloat16()
    k, v = (torch.randn(1, 2, 3001, 64, generator=g).bfloat16() for _ in range(2))
    ref = attention_steps(q.double(), k.double(), v.double()).output
    ours = (decode_attention(q, k, v).double() - ref).abs().max()
    theirs = (TF.scaled_dot_product_attention(q, k, v, enable_gqa=True).double() - ref).abs().max()
    assert ours <= 2 * theirs, (float(ours), float(theirs))


def test_cache_views_are_read_in_place(monkeypatch):
    """A slice of a preallocated cache reaches the kernel as the same memory, not a copy."""
    buf_k, buf_v = torch.randn(2, 2, 500, 16), torch.randn(2, 2, 500, 16)
    k, v = buf_k[:, :, :123], buf_v[:, :, :123]
    seen = {}
    real = decode_ops()

    class Spy:
        def fwd(self, q, k_, v_, *args):
            seen["k"], seen["v"] = k_, v_
            return real.fwd(q, k_, v_, *args)

    monkeypatch.setattr(decode_mod, "decode_ops", lambda: Spy())
    q = torch.randn(2, 4, 1, 16)
    out = decode_attention(q, k, v)
    assert seen["k"].data_ptr() == buf_k.data_ptr() and seen["k"].stride() == buf_k.stride()
    assert seen["v"].data_ptr() == buf_v.data_ptr()
    check_decode(q, k, v, out, decode_attention(q, k, v, return_lse=True)[1])


def test_leading_batch_dims_and_unbatched_inputs():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 4, 2, 16, generator=g)  # (B1, B2, h, Tq, d)
    k, v = torch.randn(2, 3, 2, 50, 16, generator=g), torch.randn(2, 3, 2, 50, 8, generator=g)
    out, lse = decode_attention(q, k, v, causal=True, return_lse=True)
    check_decode(q, k, v, out, lse, causal=True)
    out, lse = decode_attention(q[0, 0], k[0, 0], v[0, 0], return_lse=True)  # (h, Tq, d)
    check_decode(q[0, 0], k[0, 0], v[0, 0], out, lse)


def test_bad_calls_are_one_clear_error():
    q = k = v = torch.randn(1, 2, 3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="dtype torch.float64"):
        decode_attention(q, k, v)
    x = torch.randn(1, 2, 3, 8, requires_grad=True)
    with pytest.raises(ValueError, match="gradients"):
        decode_attention(x, x, x)
    with pytest.raises(ValueError, match="window"):
        decode_attention(x.detach(), x.detach(), x.detach(), window=0)
    with pytest.raises(ValueError, match="backend='decode' cannot run.*bias"):
        scaled_dot_product_attention(
            x.detach(), x.detach(), x.detach(), bias=torch.zeros(3, 3), backend="decode"
        )
    with pytest.raises(ValueError, match="backend='decode' cannot run.*float16"):
        y = torch.randn(1, 2, 3, 8, dtype=torch.float16)
        scaled_dot_product_attention(y, y, y, backend="decode")


# ---- dispatch


def _auto_takes_decode(rows: int, dtype: torch.dtype) -> bool:
    """Whether "auto" gives this many query rows per kv head to the decode kernel on this
    machine's kernel level (the levels without AVX-512 do so for fewer; qkv.dispatch)."""
    limit, dtypes = dispatch.UNTUNED_DECODE.get(native_level(), (4 * MAX_TQ, (dtype,)))
    return rows <= limit and dtype in dtypes


def _decode_call(Tq=1, Tk=1000, dtype=torch.float32):
    q = torch.randn(1, 8, Tq, 32).to(dtype)
    k, v = (torch.randn(1, 2, Tk, 32).to(dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Tq", [1, 4, MAX_TQ])
def test_auto_picks_decode_for_few_queries_and_says_why(Tq, dtype):
    q, k, v = _decode_call(Tq, dtype=dtype)
    if not _auto_takes_decode(4 * Tq, dtype):  # G = 4
        d = explain_dispatch(q, k, v)
        assert d.backend == "torch" and "query rows per kv head" in d.reasons["decode"], str(d)
        return
    for kw in ({}, {"causal": True}, {"mask": masks.padding(torch.tensor([900]), 1000)}):
        d = explain_dispatch(q, k, v, **kw)
        assert d.backend == "decode", str(d)
        assert f"Tq={Tq} <= {MAX_TQ}" in d.reasons["torch"], str(d)
        assert not any("bias" in r for r in d.reasons.values()), str(d)
        out = scaled_dot_product_attention(q, k, v, **kw)
        check_decode(q, k, v, out, decode_attention(q, k, v, **kw, return_lse=True)[1], **kw)


@pytest.mark.parametrize("kw", [{}, {"causal": True, "window": 7}, {"scale": 0.3}])
def test_auto_repeats_a_decode_call_with_each_calls_tensors(kw):
    """``"auto"`` remembers a decode call per signature and then calls the extension directly:
    every later call must still read its own q, k, v and mask (new values, a mask that
    changes, q a transposed view, k with a strided head dim, 5-D inputs)."""
    if not _auto_takes_decode(6, torch.float32):
        pytest.skip(f"auto does not take the decode kernel for fp32 on level {native_level()}")
    g = torch.Generator().manual_seed(5)
    for i in range(3):
        q = torch.randn(2, 3, 4, 16, generator=g).transpose(1, 2)  # (2, 4, 3, 16), a view
        k = torch.randn(2, 2, 16, 40, generator=g).transpose(-1, -2)  # (2, 2, 40, 16)
        v = torch.randn(2, 2, 40, 8, generator=g)
        mask = torch.rand(2, 1, 3, 40, generator=g) > 0.3 * i  # i = 2: some rows see no key
        with torch.no_grad():
            assert explain_dispatch(q, k, v, mask=mask, **kw).backend == "decode"
            out = scaled_dot_product_attention(q, k, v, mask=mask, **kw)
        lse = decode_attention(q, k, v, mask=mask, **kw, return_lse=True)[1]
        check_decode(q, k, v, out, lse, mask=mask, **kw)
        out5 = scaled_dot_product_attention(q[None], k[None], v[None], mask=mask[None], **kw)
        check_decode(q[None], k[None], v[None], out5, lse[None], mask=mask[None], **kw)


def test_auto_leaves_decode_with_reasons_that_match_the_call():
    q, k, v = _decode_call(Tq=MAX_TQ + 1)
    d = explain_dispatch(q, k, v)
    assert d.backend != "decode" and f"Tq={MAX_TQ + 1} > {MAX_TQ}" in d.reasons["decode"]
    q, k, v = _decode_call()
    d = explain_dispatch(q, k, v, bias=torch.zeros(1, 8, 1, 1000))
    assert d.backend == "torch" and "bias given" in d.reasons["decode"], str(d)
    d = explain_dispatch(q.requires_grad_(), k, v)
    assert d.backend != "decode" and "gradients" in d.reasons["decode"], str(d)
    with torch.no_grad():
        assert explain_dispatch(q, k, v).backend == ("decode" if _auto_takes_decode(4, q.dtype)
                                                     else "torch")  # fmt: skip
    d = explain_dispatch(q.detach().half(), k.half(), v.half())
    assert d.backend != "decode" and "float16" in d.reasons["decode"], str(d)
    assert "not 'decode': dtype torch.float16" in str(d)


def test_selected_heads_weights_through_decode_match_math():
    torch.manual_seed(0)
    q, k, v = _decode_call(Tq=3, Tk=77)
    d = explain_dispatch(q, k, v, causal=True, return_weights=True, weights_heads=[5, 2])
    assert d.backend == ("decode" if _auto_takes_decode(12, q.dtype) else "flash")
    out, w = scaled_dot_product_attention(
        q, k, v, causal=True, return_weights=True, weights_heads=[5, 2]
    )
    ref_out, ref_w = scaled_dot_product_attention(
        q, k, v, causal=True, return_weights=True, backend="math"
    )
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w, ref_w[:, [5, 2]], atol=1e-5, rtol=1e-5)


_LEVEL_CHECK_SCRIPT = """
import torch
from qkv.functional import attention_steps
from qkv.kernels._native import native_status
from qkv.kernels.decode import decode_attention
torch.manual_seed(0)
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
    q = torch.randn(2, 6, 5, 40).to(dtype)
    k = torch.randn(2, 3, 300, 40).to(dtype)[:, :, :217]
    v = torch.randn(2, 3, 217, 24).to(dtype)
    for kw in ({}, {"causal": True, "window": 50}, {"mask": torch.rand(5, 217) > 0.3}):
        out, lse = decode_attention(q, k, v, **kw, return_lse=True)
        ref = attention_steps(q.double(), k.double(), v.double(), **kw)
        assert (out.double() - ref.output).abs().max() < tol, (dtype, kw)
        assert (lse.double() - ref.lse).abs().max() < 1e-4, (dtype, kw)
print("ok")
"""


def _beams_check(dtype: str, tol: float, lse_tol: float) -> str:
    """Script lines (after a check script's imports and generator ``g``): beams reordered by a
    rows table and sentences that left by kv_batch, K/V in ``dtype``, against fp64."""
    return f"""
# beams reordered by a rows table, sentences that left by kv_batch: keys gathered per position
q = torch.randn(3, 8, 2, 64, generator=g).to({dtype})
k = torch.randn(4, 2, 90, 64, generator=g).to({dtype})
v = torch.randn(4, 2, 90, 64, generator=g).to({dtype})
rows = torch.randint(0, 4, (3, 90), generator=g)
out, lse = decode_ops().fwd(q, k, v, None, 0.125, True, -1, 0, rows)
kg = k.permute(0, 2, 1, 3)[rows, torch.arange(90)[None, :]].permute(0, 2, 1, 3)
vg = v.permute(0, 2, 1, 3)[rows, torch.arange(90)[None, :]].permute(0, 2, 1, 3)
ref = attention_steps(q.double(), kg.double(), vg.double(), causal=True, scale=0.125)
assert (out.double() - ref.output).abs().max() < {tol} and (lse.double() - ref.lse).abs().max() < {lse_tol}
kv_batch = torch.tensor([3, 0, 2])
out, lse = decode_ops().fwd(q, k, v, None, 0.125, False, -1, 0, None, kv_batch)
ref = attention_steps(q.double(), k[kv_batch].double(), v[kv_batch].double(), scale=0.125)
assert (out.double() - ref.output).abs().max() < {tol} and (lse.double() - ref.lse).abs().max() < {lse_tol}
"""


_BF16_PATH_CHECK = """
import torch
from qkv.functional import attention_steps
from qkv.kernels._native import decode_ops
from qkv.kernels.decode import decode_attention
g = torch.Generator().manual_seed(1)
# (4, 16 and 64 rows per kv head, 20 rows = two tiles of 16 with padding, d = 40 not in tiles)
for h, h_kv, Tq, Tk, d in ((8, 2, 1, 1000, 128), (8, 2, 4, 1000, 128), (32, 8, 16, 1000, 128),
                           (4, 1, 5, 300, 64), (6, 2, 3, 217, 64), (4, 4, 5, 77, 40)):
    q = torch.randn(2, h, Tq, d, generator=g)
    k = torch.randn(2, h_kv, Tk + 9, d, generator=g).bfloat16()[:, :, :Tk]
    v = torch.randn(2, h_kv, Tk, d, generator=g).bfloat16()
    qd = q.bfloat16().double()
    for kw in ({}, {"causal": True, "window": 50}, {"mask": torch.rand(Tq, Tk, generator=g) > 0.3}):
        out, lse = decode_attention(q.bfloat16(), k, v, **kw, return_lse=True)
        ref = attention_steps(qd, k.double(), v.double(), **kw)
        assert (out.double() - ref.output).abs().max() < 2e-2, (h, Tq, Tk, d, kw)
        assert (lse.double() - ref.lse).abs().max() < 1e-3, (h, Tq, Tk, d, kw)
    # fp32 queries over the bf16 cache (an fp32 model's bf16 cache), causal
    out, lse = decode_ops().fwd(q, k, v, None, d**-0.5, True, -1)
    ref = attention_steps(qd, k.double(), v.double(), causal=True)
    assert out.dtype == torch.float32 and (out.double() - ref.output).abs().max() < 2e-2
    assert (lse.double() - ref.lse).abs().max() < 1e-3
    # the key range cut into pieces merged by log-sum-exp, on two threads
    torch.set_num_threads(2)
    out, lse = decode_ops().fwd(q.bfloat16(), k, v, None, d**-0.5, False, -1, 3)
    ref = attention_steps(qd, k.double(), v.double())
    assert (out.double() - ref.output).abs().max() < 2e-2 and (lse.double() - ref.lse).abs().max() < 1e-3
    torch.set_num_threads(1)
""" + _beams_check("torch.bfloat16", 2e-2, 1e-3) + 'print("ok")\n'


def _amx_tiles() -> bool:
    from qkv.kernels._native import native_status

    decode_ops()  # builds/loads the extension
    return "amx tiles" in native_status()


@pytest.mark.parametrize("d", [40, 64, 128])
def test_fp32_many_rows_match_fp64(restore_threads, d):
    """fp32 with 16 or more query rows per kv head (G·Tq: drafts, beams, GQA) takes the scores
    as Sᵀ by broadcasts (rows padded to the vector width, tiles transposed back): equal to
    fp64 over row counts that fill and do not fill the groups, masks, windows, pieces on 2
    threads, gathered beams' rows, and a tokens-first cache (key rows not d apart; AVX-512
    takes the dot-product form there and for d = 40, AVX2 the broadcasts)."""
    g = torch.Generator().manual_seed(3)
    for h, h_kv, Tq, Tk in ((8, 2, 4, 300), (20, 4, 4, 77), (32, 8, 16, 1000), (6, 2, 16, 130)):
        q = torch.randn(2, h, Tq, d, generator=g)
        for layout in ("slice", "tokens-first"):
            k = _cache_view(g, 2, h_kv, Tk, d, torch.float32, layout)
            v = _cache_view(g, 2, h_kv, Tk, d, torch.float32, layout)
            masks_ = (None, torch.rand(2, h, Tq, Tk, generator=g) > 0.3)
            for (kw, mask), threads in itertools.product(
                zip(({}, {"causal": True, "window": 50}, {}), (None, None, masks_[1])), (1, 2)
            ):
                torch.set_num_threads(threads)
                out, lse = decode_attention(q, k, v, mask=mask, **kw, return_lse=True)
                ref = attention_steps(q.double(), k.double(), v.double(), mask=mask, **kw)
                assert (out.double() - ref.output).abs().max() < 1e-5, (h, Tq, Tk, layout, kw)
                assert (lse.double() - ref.lse).abs().max() < 1e-5, (h, Tq, Tk, layout, kw)
        out, lse = decode_ops().fwd(q, k.contiguous(), v.contiguous(), None, d**-0.5, False, -1, 3)
        ref = attention_steps(q.double(), k.double(), v.double())
        assert (out.double() - ref.output).abs().max() < 1e-5
    # beams reordered by a rows table: each tile gathered row by row, then the same product
    q = torch.randn(3, 16, 2, d, generator=g)
    k, v = (torch.randn(4, 2, 90, d, generator=g) for _ in range(2))
    rows = torch.randint(0, 4, (3, 90), generator=g)
    out, lse = decode_ops().fwd(q, k, v, None, 0.1, True, -1, 0, rows)
    kg = k.permute(0, 2, 1, 3)[rows, torch.arange(90)[None, :]].permute(0, 2, 1, 3)
    vg = v.permute(0, 2, 1, 3)[rows, torch.arange(90)[None, :]].permute(0, 2, 1, 3)
    ref = attention_steps(q.double(), kg.double(), vg.double(), causal=True, scale=0.1)
    assert (out.double() - ref.output).abs().max() < 1e-5


@pytest.mark.parametrize("path", ["dot", "widen", "amx", "auto"])
def test_every_bf16_path_matches_fp64(path):
    """bf16 caches go through AMX tiles (CPUs that have them), vdpbf16ps on key pairs, or are
    widened to fp32 for FMAs (the faster one per CPU and call by default); each equals the fp64
    reference within bf16 rounding, over GQA, masks, windows, pieces, beams' gathered rows."""
    if path == "amx" and not _amx_tiles():
        pytest.skip("no AMX tiles here (CPU, build or oneDNN): " + native_status())
    assert_script_ok(_BF16_PATH_CHECK, QKV_DECODE_BF16=path)


_FP32_FEW_CHECK = """
import torch
from qkv.functional import attention_steps
from qkv.kernels._native import decode_ops
from qkv.kernels.decode import decode_attention
g = torch.Generator().manual_seed(2)
# 1-15 query rows per kv head; d = 40 has a tail past the 8-value steps; Tk not a multiple of
# the 16-key tiles; key rows d apart, or not (a slice of a longer buffer, tokens first)
for h, h_kv, Tq, Tk, d in ((8, 2, 1, 1000, 128), (32, 8, 2, 333, 128), (4, 1, 3, 217, 64),
                           (6, 2, 5, 130, 64), (4, 4, 7, 77, 40), (3, 1, 5, 50, 128)):
    q = torch.randn(2, h, Tq, d, generator=g)
    for layout in ("plain", "slice", "tokens-first"):
        if layout == "slice":
            k = torch.randn(2, h_kv, Tk + 9, d, generator=g)[:, :, :Tk]
        elif layout == "tokens-first":
            k = torch.randn(2, Tk, h_kv, d, generator=g).transpose(1, 2)
        else:
            k = torch.randn(2, h_kv, Tk, d, generator=g)
        v = torch.randn(2, h_kv, Tk, d, generator=g)
        for kw in ({}, {"causal": True, "window": 50}, {"mask": torch.rand(Tq, Tk, generator=g) > 0.3}):
            out, lse = decode_attention(q, k, v, **kw, return_lse=True)
            ref = attention_steps(q.double(), k.double(), v.double(), **kw)
            assert (out.double() - ref.output).abs().max() < 1e-5, (h, Tq, Tk, d, layout, kw)
            assert (lse.double() - ref.lse).abs().max() < 1e-5, (h, Tq, Tk, d, layout, kw)
    # the key range cut into pieces merged by log-sum-exp, on two threads
    torch.set_num_threads(2)
    out, lse = decode_ops().fwd(q, k.contiguous(), v, None, d**-0.5, False, -1, 3)
    ref = attention_steps(q.double(), k.double(), v.double())
    assert (out.double() - ref.output).abs().max() < 1e-5 and (lse.double() - ref.lse).abs().max() < 1e-5
    torch.set_num_threads(1)
""" + _beams_check("torch.float32", 1e-5, 1e-5) + """
# a call that reads 32 MiB of K + V (auto takes the AVX2 loops from there on Zen 5)
q = torch.randn(1, 32, 1, 128, generator=g)
k, v = (torch.randn(1, 8, 4096, 128, generator=g) for _ in range(2))
out = decode_attention(q, k, v)
assert (out.double() - attention_steps(q.double(), k.double(), v.double()).output).abs().max() < 1e-5
print("ok")
"""


@pytest.mark.parametrize("path", ["avx2", "avx512", "auto"])
def test_every_fp32_few_rows_path_matches_fp64(path):
    """fp32 caches with few query rows per kv head take, on the AVX-512 levels, the AVX2 loops
    (Zen 5, calls of 32 MiB or more; forced: every call under 16 rows) or the AVX-512 ones;
    each equals fp64 over 1-15 rows, odd head sizes and key counts, strided caches, masks,
    windows, pieces and gathered beams."""
    assert_script_ok(_FP32_FEW_CHECK, QKV_DECODE_FP32=path)


def test_bad_fp32_path_setting_is_an_error():
    with pytest.raises(AssertionError, match="QKV_DECODE_FP32 must be auto, avx2 or avx512"):
        assert_script_ok(_FP32_FEW_CHECK, QKV_DECODE_FP32="fast")


def _cpu_family() -> tuple[str, int]:
    """The CPU's vendor and family as Linux reports them (``/proc/cpuinfo``)."""
    with open("/proc/cpuinfo") as f:
        info = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in f) if v}
    return info.get("vendor_id", ""), int(info.get("cpu family", "0") or 0)


def test_paths_of_this_cpu():
    """On the AVX-512 levels, fp32 caches with few rows take the AVX2 loops (from 32 MiB a
    call) on Zen 5 (AMD family 26 and later) only. Without AMX the bf16 cache's pairs
    (vdpbf16ps) run from 8 query rows per kv head, fewer rows widened, except on Zen 4 (AMD
    family 25), where the pairs run for every call; with AMX, tiles from 8 rows. The status
    names the choice the kernel makes."""
    if native_level() not in ("avx512", "avx512_bf16", "amx"):
        pytest.skip(f"no AVX-512 loops on this level: {native_level()}")
    status = native_status()
    vendor, family = _cpu_family()
    lines = "fp32 K/V up to 8 rows per kv head, 32 MiB or more a call: avx2 loops" in status
    assert lines == (vendor == "AuthenticAMD" and family >= 26), status
    if native_level() == "avx512":
        return
    if _amx_tiles():
        assert "bf16 K/V: amx tiles from 8 rows per kv head, else widened" in status
        assert "decode path avx512+avx512bf16+amx;" in status
    elif (vendor, family) == ("AuthenticAMD", 25):
        assert "bf16 K/V: vdpbf16ps;" in status and "+amx" not in status
    else:
        assert "bf16 K/V: vdpbf16ps from 8 rows per kv head, else widened" in status
        assert "+amx" not in status


def test_bad_bf16_path_setting_is_an_error():
    with pytest.raises(AssertionError, match="QKV_DECODE_BF16 must be auto, amx, dot or widen"):
        assert_script_ok(_BF16_PATH_CHECK, QKV_DECODE_BF16="fast")


@pytest.mark.parametrize("level", other_levels())
def test_every_level_gives_the_same_answers(level):
    """Each other kernel level this CPU can run (the portable build's plain C++ loops
    included) gives the same answers."""
    assert_level_ok(_LEVEL_CHECK_SCRIPT, level)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_huge_logits_give_the_argmax_value(dtype):
    """Scores of ~1e13 (scale 1e10): the softmax is one-hot, no inf/NaN on the way."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 2, 16, generator=g).to(dtype)
    k, v = (torch.randn(1, 2, 333, 16, generator=g).to(dtype) for _ in range(2))
    out, lse = run_decode(
        q, k, v, check_qkv(q, k, v), mask=None, causal=False, window=None, scale=1e10, splits=3
    )
    scores = q.double() @ k.double().repeat_interleave(2, dim=1).transpose(-2, -1)
    best = scores.argmax(-1)  # (1, 4, 2)
    expected = v.repeat_interleave(2, dim=1).gather(2, best.unsqueeze(-1).expand(-1, -1, -1, 16))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    torch.testing.assert_close(lse.double(), 1e10 * scores.amax(-1), rtol=1e-6, atol=0)
