"""NaN and inf in the inputs: every backend against an fp64 statement of the rule.

The rule (qkv._nonfinite): on the logits x = softcap(q kᵀ·scale) + bias of a row, a NaN or
+inf at a key the row may see makes the row NaN; -inf means masked; values at keys the row
may see are multiplied by their weights as IEEE does; values at keys it may not see take no
part. ``rule`` below writes that down row by row in float64, independently of qkv's code.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import deadline
from native import other_levels
from qkv import masks, scaled_dot_product_attention
from qkv.cache import dequantize_rows, quantize_rows
from qkv.kernels.decode import decode_attention
from qkv.kernels.flash import flash_attention

# the dispatcher's backends, then the public kernel entry points called directly
BACKENDS = ("math", "flash", "torch", "decode", "auto", "flash_attention", "decode_attention")
NONFINITE = (math.nan, math.inf, -math.inf)


def rule(q, k, v, *, mask=None, bias=None, causal=False, window=None, scale=None, softcap=None,
         flush=0.0):  # fmt: skip
    """The rule in float64, one row at a time. Shapes (B, h, T, d); mask/bias (Tq, Tk) or
    broadcastable (B|1, h|1, Tq, Tk). Weights below ``flush`` count as 0."""
    q, k, v = q.double(), k.double(), v.double()
    B, h, Tq, d = q.shape
    Tk, group = k.shape[-2], h // k.shape[1]
    scale = 1 / math.sqrt(d) if scale is None else scale
    allowed = torch.ones(B, h, Tq, Tk, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask
    if causal or window is not None:
        structure = (
            masks.sliding_window(Tq, Tk, window, causal=causal) if window else masks.causal(Tq, Tk)
        )
        allowed = allowed & structure
    bias = None if bias is None else bias.double().expand(B, h, Tq, Tk)
    out = torch.zeros(B, h, Tq, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for i in range(h):
            kk, vv = k[b, i // group], v[b, i // group]
            for r in range(Tq):
                seen = allowed[b, i, r].clone()
                x = (kk @ q[b, i, r]) * scale  # (Tk,)
                if softcap is not None:
                    x = softcap * torch.tanh(x / softcap)
                if bias is not None:
                    x = x + bias[b, i, r]
                    seen &= ~bias[b, i, r].isneginf()
                xs = x[seen]
                if bool((xs.isnan() | xs.isposinf()).any()):
                    out[b, i, r] = math.nan
                    continue
                live = seen & ~x.isneginf()
                if not bool(live.any()):
                    continue  # no visible key: zeros
                w = torch.zeros(Tk, dtype=torch.float64)
                w[live] = torch.softmax(x[live], 0)
                w[w < flush] = 0.0
                for j in seen.nonzero().flatten().tolist():  # IEEE w·v at the seen keys only
                    out[b, i, r] += w[j] * vv[j]
    return out


def rule_either(q, k, v, **kw):
    """The rule, where an inf value meets a tiny weight (a logit 80 or more below its row's
    maximum) allowed either answer: inf (the weight kept) or NaN (rounded to 0, as the fused
    kernels' exp does); docs/errors.md says so."""
    kept, flushed = rule(q, k, v, **kw), rule(q, k, v, **kw, flush=TINY)
    return kept, flushed


TINY = math.exp(-80)


def assert_rule(got, want, tol, backend=""):
    if isinstance(want, tuple):  # (kept, flushed): rule_either
        kept, flushed = want
        either = kept.isnan() != flushed.isnan()
        want = torch.where(either & got.double().isnan(), flushed, kept)
    got = got.double()
    assert torch.equal(got.isnan(), want.isnan()), (
        f"{backend}: NaN at {got.isnan().nonzero().tolist()}, rule {want.isnan().nonzero().tolist()}"
    )
    assert torch.equal(got.isposinf(), want.isposinf()) and torch.equal(
        got.isneginf(), want.isneginf()
    ), "infinities differ from the rule"
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], atol=tol, rtol=tol)


def run(backend, q, k, v, **kw):
    """The backend's output, or None where it cannot run such a call at all."""
    try:
        if backend == "flash_attention":
            if k.dtype == torch.int8:
                return None  # (the flash kernel reads no int8 rows)
            return flash_attention(q, k, v, **kw)
        if backend == "decode_attention":
            if "bias" in kw or "softcap" in kw or q.dtype == torch.float64:
                return None
            return decode_attention(q, k, v, **kw)
        return scaled_dot_product_attention(q, k, v, backend=backend, **kw)
    except ValueError as e:
        if "cannot run this call" in str(e):
            return None
        raise


def int8_rows(k, v):
    """An int8 cache's packed rows of k and v, and what they hold (the rule's input)."""
    k8, v8 = quantize_rows(k), quantize_rows(v)
    return k8, v8, dequantize_rows(k8, torch.float64), dequantize_rows(v8, torch.float64)


@st.composite
def calls(draw):
    B, h_kv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2]))
    Tq, Tk = draw(st.integers(1, 12)), draw(st.integers(1, 40))
    d = draw(st.sampled_from([4, 8, 16, 64]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64, "int8"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(B, h_kv * group, Tq, d, generator=g)
    k, v = torch.randn(B, h_kv, Tk, d, generator=g), torch.randn(B, h_kv, Tk, d, generator=g)
    kw = {}
    kind = draw(st.sampled_from(["none", "causal", "window", "mask", "padding", "bias"]))
    if kind == "causal":
        kw["causal"] = True
    elif kind == "window":
        kw["window"], kw["causal"] = draw(st.integers(1, 8)), draw(st.booleans())
    elif kind == "mask":
        kw["mask"] = torch.rand(B, 1, Tq, Tk, generator=g) < 0.7
    elif kind == "padding":
        lengths = torch.randint(1, Tk + 1, (B,), generator=g)
        kw["mask"] = masks.padding(lengths, Tk)
    elif kind == "bias":
        bias = torch.randn(Tq, Tk, generator=g)
        bias[torch.rand(Tq, Tk, generator=g) < 0.3] = -math.inf
        kw["bias"] = bias
    if draw(st.booleans()) and kind != "bias":
        kw["softcap"] = draw(st.sampled_from([5.0, 30.0]))
    elif draw(st.booleans()):  # large logit gaps: weights that underflow to 0 in fp32
        kw["scale"] = draw(st.sampled_from([20.0, 200.0]))
    # one non-finite value, placed at random (also in masked-out places)
    where = draw(st.sampled_from(["q", "k", "v", "bias"] if "bias" in kw else ["q", "k", "v"]))
    t = {"q": q, "k": k, "v": v, "bias": kw.get("bias")}[where]
    t.view(-1)[draw(st.integers(0, t.numel() - 1))] = draw(st.sampled_from(NONFINITE))
    if dtype == "int8":  # an int8 cache under fp32 queries
        k, v, *held = int8_rows(k, v)
        return q, k, v, kw, held
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return q, k, v, kw, (k, v)


@settings(max_examples=200, deadline=None)
@given(calls())
def test_every_backend_follows_the_rule(call):
    q, k, v, kw, (k_held, v_held) = call
    want = rule_either(q, k_held, v_held, **kw)
    tol = {torch.bfloat16: 3e-2, torch.int8: 2e-2}.get(k.dtype, 2e-4)
    if "scale" in kw and k.dtype != torch.float64:  # fp32 rounding of the scores, scaled up
        tol = max(tol, 1e-6 * kw["scale"] * q.abs().max().item() * k_held.abs().max().item())
    ran = 0
    for backend in BACKENDS:
        got = run(backend, q, k, v, **kw)
        if got is not None:
            ran += 1
            assert_rule(got, want, tol, backend)
    assert ran >= 2  # math and auto always run


def test_an_int8_cache_holds_a_nonfinite_row_as_nan():
    x = torch.tensor([[1.0, -2.0, 3.0], [1.0, math.inf, 0.0], [math.nan, 0.0, 1.0], [0, 0, 0]])
    held = dequantize_rows(quantize_rows(x))
    assert torch.isfinite(held[[0, 3]]).all() and held[[1, 2]].isnan().all()
    torch.testing.assert_close(held[0], x[0], atol=3 / 127, rtol=0)


@pytest.mark.parametrize("backend", ["decode", "auto", "decode_attention", "math"])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("value", NONFINITE[:2])
@pytest.mark.parametrize("Tk", [40, 64, 700])
def test_int8_cache_nonfinite_rows(backend, where, value, Tk):
    """An int8 cache (the decode kernel's int16 and VNNI paths): a NaN or inf at a key every
    row sees makes every row NaN; at a padding key that batch row 1 never sees it leaves
    that row as it was."""
    g = torch.Generator().manual_seed(Tk)
    q = torch.randn(2, 4, 1, 64, generator=g)
    k, v = (torch.randn(2, 2, Tk, 64, generator=g) for _ in range(2))
    for key, mask in ((3, None), (Tk - 1, masks.padding(torch.tensor([Tk, 9]), Tk))):
        kk, vv = k.clone(), v.clone()
        (kk if where == "k" else vv)[:, :, key, 5] = value
        k8, v8, k_held, v_held = int8_rows(kk, vv)
        got = run(backend, q, k8, v8, mask=mask)
        # (int16 weights and queries: ~1e-4 off; the fault this guards against was 7e-3 - 0.3)
        assert_rule(got, rule(q, k_held, v_held, mask=mask), 2e-3, backend)
        if mask is None:
            assert got.isnan().all()
        else:
            assert got[0].isnan().all() and torch.isfinite(got[1]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_row_whose_logits_are_all_minus_inf_is_zeros(backend, dtype):
    """-inf in q makes a row's logits all -inf (k's entries there all positive): that row is
    zeros, whatever its values hold; the other rows are as the rule says."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 3, 8, generator=g)
    k = torch.rand(1, 2, 50, 8, generator=g) + 0.5
    v = torch.randn(1, 2, 50, 8, generator=g)
    q[0, 0, 1, 2] = -math.inf
    v[0, 0, 7, 1], v[0, 0, 9, 4] = math.nan, math.inf
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    got = run(backend, q, k, v)
    if got is None:
        pytest.skip(f"{backend} does not run {dtype}")
    assert torch.equal(got[0, 0, 1], torch.zeros(8, dtype=dtype))
    assert_rule(got, rule(q, k, v), 3e-2 if dtype == torch.bfloat16 else 2e-5, backend)


@pytest.mark.parametrize("backend", ["flash", "decode", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_weight_that_underflows_still_meets_a_nan_value(backend, dtype):
    """A key whose logit is far below the row's maximum gets weight 0 in fp32: 0·NaN is
    NaN, on every level (no kernel skips a zero weight)."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 2, 1, 16, generator=g)
    k, v = torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g)
    k[0, :, 0] = q[0, :, 0] * 50  # one key far ahead of the others
    v[0, :, 11, 3] = math.nan
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    got = run(backend, q, k, v, scale=1.0)
    assert got[..., 3].isnan().all() and torch.isfinite(got[..., [0, 1, 2]]).all()


@pytest.mark.parametrize("backend", ["flash", "decode", "auto"])
@pytest.mark.parametrize("Tk", [64, 2048])
def test_a_numpy_mask_refilled_in_place_is_looked_at_again(backend, Tk):
    """A mask over numpy's memory changes without a version bump: a NaN value at a key the
    refilled mask hides must not reach the rows that no longer see it."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 2, 1, 32, generator=g)
    k, v = torch.randn(2, 2, Tk, 32, generator=g), torch.randn(2, 2, Tk, 32, generator=g)
    v[1, :, Tk - 1] = math.nan
    buf = np.ones((2, 1, 1, Tk), dtype=bool)
    buf[1, ..., Tk - 1] = False
    mask = torch.from_numpy(buf)
    first = run(backend, q, k, v, mask=mask)
    assert torch.isfinite(first).all()
    buf[1, ..., Tk - 8 :] = False  # refilled in place: same tensor, same version
    second = run(backend, q, k, v, mask=mask)
    assert torch.isfinite(second).all()
    assert_rule(second, rule(q, k, v, mask=mask.clone()), 2e-5, backend)


@pytest.mark.parametrize("backend", ["flash", "torch", "decode", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Tk", [64, 2048])  # (2048: more values than are summed whole)
def test_nan_in_the_unused_tail_of_a_cache_never_reaches_an_output(backend, dtype, Tk):
    """A preallocated cache whose tail holds NaN (never written), read whole with a mask."""
    g = torch.Generator().manual_seed(0)
    B, h, d, used = 2, 2, 32, torch.tensor([Tk * 5 // 8, Tk // 3])
    k = torch.full((B, h, Tk, d), math.nan)
    v = torch.full((B, h, Tk, d), math.nan)
    for b in range(B):
        k[b, :, : used[b]] = torch.randn(h, int(used[b]), d, generator=g)
        v[b, :, : used[b]] = torch.randn(h, int(used[b]), d, generator=g)
    q = torch.randn(B, h, 1, d, generator=g)
    mask = masks.padding(used, Tk)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    got = run(backend, q, k, v, mask=mask)
    assert got is not None
    assert torch.isfinite(got).all()
    assert_rule(got, rule(q, k, v, mask=mask), 3e-2 if dtype == torch.bfloat16 else 2e-5)


@pytest.mark.parametrize("backend", ["flash", "torch", "decode", "auto"])
@pytest.mark.parametrize("how", ["causal", "mask"])
@pytest.mark.parametrize("Tk", [6, 600])
def test_a_nan_value_reaches_only_the_rows_that_see_it(backend, how, Tk):
    """Rows that may not see a NaN value's key stay finite; the rows that see it are NaN."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 6, 64, generator=g)
    k, v = (torch.randn(1, 2, Tk, 64, generator=g) for _ in range(2))
    at = Tk - 2  # under causal, the last two rows see it
    v[0, :, at, 3] = math.nan
    kw = {"causal": True} if how == "causal" else {"mask": masks.causal(6, Tk)}
    got = run(backend, q, k, v, **kw)
    assert got is not None
    assert torch.isfinite(got[:, :, :4]).all()
    assert got[:, :, 4:, 3].isnan().all() and torch.isfinite(got[:, :, 4:, [0, 1, 2]]).all()


@pytest.mark.parametrize("backend", ["math", "flash", "torch", "decode", "auto"])
@pytest.mark.parametrize(
    "option, value", [("scale", 1e39), ("softcap", 1e300), ("scale", 1e-50), ("softcap", 1e-46)]
)
def test_options_beyond_float32_are_one_clear_error(backend, option, value):
    q, k, v = torch.randn(1, 1, 1, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    if option == "softcap" and backend in ("torch", "decode"):
        pytest.skip("these backends refuse soft-capping itself")
    with pytest.raises(ValueError, match=f"{option}=.* outside what float32 holds"):
        scaled_dot_product_attention(q, k, v, backend=backend, **{option: value})


@pytest.mark.parametrize("backend", ["math", "flash", "torch", "decode", "auto"])
def test_a_huge_finite_scale_gives_the_hard_maximum(backend):
    """scale = 1e30: the softmax becomes the argmax, which every backend returns."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(1, 2, 1, 8, generator=g),
        torch.randn(1, 2, 9, 8, generator=g),
        torch.randn(1, 2, 9, 8, generator=g),
    )
    got = run(backend, q, k, v, scale=1e30)
    best = (q @ k.transpose(-1, -2)).argmax(-1)  # (1, 2, 1)
    want = torch.stack([v[0, i, best[0, i, 0]] for i in range(2)]).view(1, 2, 1, 8)
    torch.testing.assert_close(got, want)
    # float64 inputs take float64's range
    got64 = scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=1e200)
    torch.testing.assert_close(got64, want.double())


@pytest.mark.parametrize("level", other_levels())
def test_every_level_follows_the_rule(level):
    """The fuzz test above on each other kernel level this CPU runs (a process per level)."""
    res = deadline.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", __file__,
         "-k", "every_backend_follows or unused_tail or only_the_rows or int8_cache or "
               "all_minus_inf or underflows or numpy_mask or aligned"],
        600, f"the non-finite tests on level {level}",
        env=dict(os.environ, QKV_ISA=level), capture_output=True, text=True,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]


@pytest.mark.parametrize("Tk", [1, 5])
def test_int8_rows_whose_scales_are_not_aligned(Tk):
    """d = 6: each row's scale sits at an offset that is not a multiple of 4, so the look at
    the scales copies them (one row alone is contiguous, yet still misaligned)."""
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 1, 1, 6, generator=g)
    k, v = torch.randn(1, 1, Tk, 6, generator=g), torch.randn(1, 1, Tk, 6, generator=g)
    v[0, 0, Tk - 1, 2] = math.nan
    k8, v8, k_held, v_held = int8_rows(k, v)
    mask = torch.ones(1, 1, 1, Tk, dtype=torch.bool)
    mask[..., Tk - 1] = Tk == 1  # the NaN row hidden, unless it is the only key
    for backend in ("auto", "decode", "decode_attention", "math"):
        got = run(backend, q, k8, v8, mask=mask)
        assert_rule(got, rule(q, k_held, v_held, mask=mask), 2e-3, backend)
