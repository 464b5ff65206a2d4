"""Small attention calls (Tq, Tk <= 128): the dispatcher's choice, its two torch paths (SDPA
with a remembered additive mask, and PyTorch's fused CPU kernel with the NaN/inf check on its
log-sum-exp), against the fp64 reference and under the NaN/inf rule."""

import numpy as np
import pytest
import torch

from qkv import dispatch, masks
from qkv.dispatch import torch_adapter
from qkv.functional import attention_steps, explain_dispatch, scaled_dot_product_attention
from qkv.kernels._levels import build_of
from qkv.kernels._native import native_level, native_module

needs_native = pytest.mark.skipif(native_module() is None, reason="qkv's kernels are not built")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def qkv(B, h, Tq, Tk, d, dtype, h_kv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, h, Tq, d, generator=g).to(dtype)
    k, v = (torch.randn(B, h_kv or h, Tk, d, generator=g).to(dtype) for _ in "kv")
    return q, k, v


def skip_if_rows_limited():
    """The levels that take the decode kernel for fewer than the 16 query rows these tests
    use (portable, neon: 4) send them to torch by that limit, not by the small-masked rule."""
    level = native_level()
    limit = dispatch.UNTUNED_DECODE.get(build_of(level)) if level else None
    if limit is not None and limit[0] < 16:
        pytest.skip(f"level {level}: the decode kernel runs up to {limit[0]} rows there")


def reference(q, k, v, **kw):
    """fp64 math on the same (rounded) inputs, in q's dtype."""
    out = attention_steps(q.double(), k.double(), v.double(), **kw).output
    return out.to(q.dtype)


def options(kind, B, Tq, Tk):
    if kind == "causal":
        return {"causal": True}
    if kind == "mask":  # key padding, the last quarter hidden
        return {"mask": masks.padding(torch.full((B,), Tk - Tk // 4), Tk)}
    return {}


@pytest.fixture
def lse_everywhere(monkeypatch):
    """The log-sum-exp path from the smallest call (it starts at LSE_MIN_QK elements)."""
    monkeypatch.setattr(torch_adapter, "LSE_MIN_QK", 0)
    dispatch._DECISIONS.clear()
    yield
    dispatch._DECISIONS.clear()


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,h,h_kv,T", [(1, 4, 4, 16), (2, 4, 2, 16), (1, 2, 2, 8)])
def test_small_masked_rule(dtype, B, h, h_kv, T):
    """fp32, a tensor mask, no grouped heads, 9 <= Tq, Tk <= 32: torch; else decode (on the
    levels of the rule table's first part: the others limit the decode kernel by rows)."""
    skip_if_rows_limited()
    q, k, v = qkv(B, h, T, T, 16, dtype, h_kv)
    mask = options("mask", B, T, T)["mask"]
    expected = "torch" if (dtype == torch.float32 and h == h_kv and T >= 9) else "decode"
    d = explain_dispatch(q, k, v, mask=mask)
    assert d.backend == expected, str(d)
    if expected == "torch":
        assert "decode" in d.reasons and "no grouped heads" in d.why
    assert explain_dispatch(q, k, v).backend == "decode"  # without the mask: decode
    # either can be forced, and both give the reference's answer
    want = reference(q, k, v, mask=mask)
    for backend in ("auto", "torch", "decode"):
        got = scaled_dot_product_attention(q, k, v, mask=mask, backend=backend)
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


@needs_native
def test_small_masked_rule_bounds():
    """Just outside the class: over 32 keys or a gradient call keep their own rows."""
    skip_if_rows_limited()
    q, _, _ = qkv(1, 4, 16, 16, 16, torch.float32)
    k, v = qkv(1, 4, 33, 33, 16, torch.float32)[1:]
    mask = torch.ones(16, 33, dtype=torch.bool)
    assert explain_dispatch(q, k, v, mask=mask).backend == "decode"
    qg = q.clone().requires_grad_()
    assert explain_dispatch(qg, q, q, mask=torch.ones(16, 16, dtype=torch.bool)).backend != "decode"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["full", "causal", "mask"])
@pytest.mark.parametrize("shape", [(1, 8, 64, 64), (2, 4, 32, 128), (1, 2, 128, 32)])
@pytest.mark.parametrize("lse", [False, True])
def test_small_calls_equal_the_fp64_reference(dtype, kind, shape, lse, monkeypatch):
    """auto and torch (each of its two paths) against fp64 math; auto picks torch here."""
    # the rule checked after the call (every call by default), or the look ahead of it
    monkeypatch.setattr(torch_adapter, "LSE_MIN_QK", 0 if lse else 1 << 62)
    dispatch._DECISIONS.clear()
    B, h, T, d = shape
    q, k, v = qkv(B, h, T, T, d, dtype)
    kw = options(kind, B, T, T)
    want = reference(q, k, v, **kw)
    for backend in ("auto", "torch"):
        got = scaled_dot_product_attention(q, k, v, **kw, backend=backend)
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
    _, decision = dispatch.decide(q, k, v, **kw)
    assert decision.backend == "torch"
    usable = torch_adapter._FLASH_CPU is not None and native_module() is not None
    assert decision.lse_check == (lse and usable)
    dispatch._DECISIONS.clear()


@pytest.mark.parametrize("kind", ["full", "causal", "mask"])
def test_lse_path_any_layout(lse_everywhere, kind):
    """q read through a transpose, k and v with a last-dim stride other than 1 (the fused
    kernel cannot take those: the public SDPA runs them), each against fp64 math."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 20, 3, 16, generator=g).transpose(1, 2)  # (B, h, T, d), strided
    k = torch.randn(2, 3, 16, 20, generator=g).transpose(-1, -2)  # last-dim stride 20
    v = torch.randn(2, 3, 20, 16, generator=g)
    kw = options(kind, 2, 20, 20)
    for kk, vv in ((k.contiguous(), v), (k, v), (k.contiguous(), v.mT.contiguous().mT)):
        assert dispatch.decide(q, kk, vv, **kw)[1].lse_check == (torch_adapter._FLASH_CPU
                                                                 is not None)  # fmt: skip
        got = scaled_dot_product_attention(q, kk, vv, **kw)
        torch.testing.assert_close(got, reference(q, kk, vv, **kw))
    q[0, 1, 4, 2] = float("nan")  # and the rule on the strided branch too
    got = scaled_dot_product_attention(q, k, v, **kw)
    assert got[0, 1, 4].isnan().all()


def test_lse_path_threshold(monkeypatch):
    """From the smallest call the rule is checked after it (LSE_MIN_QK = 0); with a threshold
    set, calls below it look at q and k ahead and calls from it check after."""
    if torch_adapter._FLASH_CPU is None or native_module() is None:
        pytest.skip("no fused CPU kernel or qkv kernels")
    dispatch._DECISIONS.clear()
    q, k, v = qkv(1, 1, 17, 17, 8, torch.float32)  # (Tq > 16: not the decode kernel's)
    assert dispatch.decide(q, k, v)[1].lse_check
    monkeypatch.setattr(torch_adapter, "LSE_MIN_QK", 1 << 19)
    n = torch_adapter.LSE_MIN_QK // (2 * 64 * 64)  # batch such that q + k reach it exactly
    for B, lse in ((n - 1, False), (n, True)):
        dispatch._DECISIONS.clear()
        q, k, v = qkv(B, 1, 64, 64, 64, torch.float32)
        assert dispatch.decide(q, k, v)[1].lse_check == lse
    dispatch._DECISIONS.clear()


NONFINITE = [
    ("q", (0, 1, 3, 5), float("nan")),  # one query row: every logit NaN (torch: zeros, lse 0)
    ("q", (0, 0, 7, slice(None)), float("nan")),
    ("q", (0, 1, 2, 4), float("inf")),
    ("q", (0, 1, 2, 4), float("-inf")),
    ("k", (0, 0, 5, 1), float("nan")),  # one key: NaN for every row that sees it
    ("k", (0, 1, 9, 3), float("inf")),
    ("k", (0, 1, 9, 3), float("-inf")),
    ("k", (0, 0, 17, 2), float("nan")),  # a key the padding mask hides
    ("v", (0, 0, 17, 2), float("nan")),  # a value the padding mask hides
    ("v", (0, 1, 3, 0), float("inf")),
]


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["full", "causal", "mask"])
@pytest.mark.parametrize("which,index,value", NONFINITE)
def test_lse_path_keeps_the_nan_rule(lse_everywhere, dtype, kind, which, index, value):
    """The check on torch's log-sum-exp gives the rule's answer (the reference's) wherever a
    NaN or inf sits; the row summaries it reads are the kernel's own."""
    if torch_adapter._FLASH_CPU is None:
        pytest.skip("this torch has no fused CPU kernel to call")
    q, k, v = qkv(1, 2, 20, 20, 8, dtype)  # (Tq > 16: not the decode kernel's)
    {"q": q, "k": k, "v": v}[which][index] = value
    kw = options(kind, 1, 20, 20)
    assert dispatch.decide(q, k, v, **kw)[1].lse_check
    got = scaled_dot_product_attention(q, k, v, **kw)
    want = scaled_dot_product_attention(q, k, v, **kw, backend="math")
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype], equal_nan=True)
    assert torch.equal(got.isnan(), want.isnan())


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lse_path_fully_masked_rows_are_zeros(lse_everywhere, dtype):
    """A row with no visible key: lse 0 from torch, q and k then looked at, zeros kept."""
    if torch_adapter._FLASH_CPU is None:
        pytest.skip("this torch has no fused CPU kernel to call")
    q, k, v = qkv(2, 2, 6, 6, 8, dtype)
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    mask[1, :, 3] = False
    got = scaled_dot_product_attention(q, k, v, mask=mask)
    assert torch.equal(got[1, :, 3], torch.zeros_like(got[1, :, 3]))
    torch.testing.assert_close(got, reference(q, k, v, mask=mask), atol=TOL[dtype],
                               rtol=TOL[dtype])  # fmt: skip


def test_additive_mask_follows_in_place_changes():
    """The remembered additive form is redone after an in-place change to the mask."""
    q, k, v = qkv(1, 2, 20, 20, 8, torch.float32)
    mask = torch.ones(1, 1, 20, 20, dtype=torch.bool)
    first = scaled_dot_product_attention(q, k, v, mask=mask, backend="torch")
    torch.testing.assert_close(first, reference(q, k, v, mask=mask))
    mask[..., 5:] = False
    again = scaled_dot_product_attention(q, k, v, mask=mask, backend="torch")
    torch.testing.assert_close(again, reference(q, k, v, mask=mask))
    assert not torch.allclose(first, again)


def test_additive_mask_untracked_is_converted_every_call():
    """A mask over numpy's memory, refilled behind torch's back, and one made under
    inference mode (no version) are converted on every call, never remembered."""
    q, k, v = qkv(1, 2, 20, 20, 8, torch.float32)
    buf = np.ones((1, 1, 20, 20), dtype=bool)
    mask = torch.from_numpy(buf)
    scaled_dot_product_attention(q, k, v, mask=mask, backend="torch")
    buf[..., 3:] = False
    got = scaled_dot_product_attention(q, k, v, mask=mask, backend="torch")
    torch.testing.assert_close(got, reference(q, k, v, mask=mask))
    with torch.inference_mode():
        m2 = torch.ones(20, 20, dtype=torch.bool)
        scaled_dot_product_attention(q, k, v, mask=m2, backend="torch")
        m2[:, 7:] = False
        got = scaled_dot_product_attention(q, k, v, mask=m2, backend="torch")
    torch.testing.assert_close(got, reference(q, k, v, mask=m2))
    assert all(entry[0] is not mask and entry[0] is not m2
               for entry in torch_adapter._ADDITIVE.values())  # fmt: skip


def test_additive_mask_values_and_bound():
    mask = torch.tensor([[True, False], [False, True]])
    out = torch_adapter.additive(mask, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.tensor([[0.0, -float("inf")], [-float("inf"), 0.0]]).bfloat16())
    assert torch_adapter.additive(mask, torch.bfloat16) is out  # remembered
    for _ in range(torch_adapter.ADDITIVE_HELD + 2):
        torch_adapter.additive(torch.ones(2, 2, dtype=torch.bool), torch.float32)
    assert len(torch_adapter._ADDITIVE) <= torch_adapter.ADDITIVE_HELD
    big = torch.ones(torch_adapter.ADDITIVE_MAX + 1, dtype=torch.bool)
    assert torch_adapter.additive(big, torch.float32) is not torch_adapter.additive(
        big, torch.float32
    )  # not held


def test_additive_mask_cache_shared_by_threads():
    """Several threads (a server's) converting more masks than the cache holds: every answer
    right, no error from the cache's eviction, never more than ADDITIVE_HELD held."""
    import threading

    gen = torch.Generator().manual_seed(3)
    pool = [torch.rand(4, 16, 16, generator=gen) > 0.3 for _ in range(3 * torch_adapter.ADDITIVE_HELD)]
    errors: list[str] = []

    def work(i: int) -> None:
        try:
            for r in range(200):
                m = pool[(7 * i + r) % len(pool)]
                assert torch.equal(torch_adapter.additive(m, torch.float32) == 0, m)
                assert len(torch_adapter._ADDITIVE) <= torch_adapter.ADDITIVE_HELD
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
