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

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import deadline
from native import other_levels
from qkv import masks, scaled_dot_product_attention

BACKENDS = ("math", "flash", "torch", "decode", "auto")
NONFINITE = (math.nan, math.inf, -math.inf)


def rule(q, k, v, *, mask=None, bias=None, causal=False, window=None, scale=None, softcap=None):
    """The rule in float64, one row at a time. Shapes (B, h, T, d); mask/bias (Tq, Tk) or
    broadcastable (B|1, h|1, Tq, Tk)."""
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
                for j in seen.nonzero().flatten().tolist():  # IEEE w·v at the seen keys only
                    out[b, i, r] += w[j] * vv[j]
    return out


def assert_rule(got, want, tol, backend=""):
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
        return scaled_dot_product_attention(q, k, v, backend=backend, **kw)
    except ValueError as e:
        if "cannot run this call" in str(e):
            return None
        raise


@st.composite
def calls(draw):
    B, h_kv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2]))
    Tq, Tk = draw(st.integers(1, 12)), draw(st.integers(1, 40))
    d = draw(st.sampled_from([4, 8, 16]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
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
    # one non-finite value, placed at random (also in masked-out places)
    where = draw(st.sampled_from(["q", "k", "v", "bias"] if "bias" in kw else ["q", "k", "v"]))
    t = {"q": q, "k": k, "v": v, "bias": kw.get("bias")}[where]
    t.view(-1)[draw(st.integers(0, t.numel() - 1))] = draw(st.sampled_from(NONFINITE))
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return q, k, v, kw


@settings(max_examples=150, deadline=None)
@given(calls())
def test_every_backend_follows_the_rule(call):
    q, k, v, kw = call
    want = rule(q, k, v, **kw)
    tol = 3e-2 if q.dtype == torch.bfloat16 else 2e-4
    ran = 0
    for backend in BACKENDS:
        got = run(backend, q, k, v, **kw)
        if got is not None:
            ran += 1
            assert_rule(got, want, tol, backend)
    assert ran >= 2  # math and auto always run


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
         "-k", "every_backend_follows or unused_tail or only_the_rows"],
        600, f"the non-finite tests on level {level}",
        env=dict(os.environ, QKV_ISA=level), capture_output=True, text=True,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
