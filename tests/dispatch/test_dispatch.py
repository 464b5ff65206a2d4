"""backend= on scaled_dot_product_attention and MultiHeadAttention; explain_dispatch."""

import logging

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from torch import nn

from qkv import MultiHeadAttention, dispatch
from qkv.functional import explain_dispatch, scaled_dot_product_attention
from qkv.kernels._levels import build_of
from strategies import draw_mask_and_bias


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
    d = explain_dispatch(q, k, k, bias=torch.zeros(1, 4, 1, 30))  # flash takes biases too
    assert d.backend != "decode" and "bias" in d.reasons["decode"], d


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


# --- the decision cache of backend="auto" ----------------------------------------------------


@st.composite
def call_signature(draw):
    """A call's shapes, dtype, options and gradient mode (values drawn once per signature)."""
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
    T = draw(st.sampled_from([8, 64, 1100]))
    kw = dict(
        causal=draw(st.booleans()),
        window=draw(st.none() | st.sampled_from([4, 256])),
        softcap=draw(st.none() | st.just(20.0)),
        scale=draw(st.none() | st.just(0.3)),
    )
    if draw(st.booleans()):
        kw["mask"] = torch.rand(T, T) > 0.2
    if draw(st.booleans()):
        kw["bias"] = torch.zeros(T, T, dtype=dtype).requires_grad_(draw(st.booleans()))
    return T, dtype, kw, draw(st.booleans())


@settings(max_examples=40)
@given(st.lists(call_signature(), min_size=2, max_size=6))
def test_cached_decisions_equal_fresh_ones(calls):
    """A sequence of calls, repeated: every (cached) decision equals explain_dispatch's."""
    from qkv import dispatch

    for T, dtype, kw, grad in calls + calls:
        q = torch.randn(1, 2, T, 8, dtype=dtype, requires_grad=grad)
        options = dict(mask=None, bias=None, causal=False, window=None, scale=None)
        options.update(softcap=None, dropout_p=0.0, return_weights=False, weights_heads=None)
        options.update(kw)
        _, cached = dispatch.decide(q, q, q, **options)
        fresh = explain_dispatch(q, q, q, **kw)
        assert (cached.backend, cached.kernel) == (fresh.backend, fresh.kernel)
        assert cached.reasons == fresh.reasons


def test_cache_hit_and_what_changes_a_decision(monkeypatch):
    from qkv import dispatch
    from qkv.kernels import flash as flash_mod

    q = torch.randn(1, 2, 64, 8, dtype=torch.bfloat16, requires_grad=True)
    options = dict(mask=None, bias=None, causal=True)
    first = dispatch.decide(q, q, q, **options)
    assert dispatch.decide(q, q, q, **options)[1] is first[1]  # remembered
    assert first[1].backend == explain_dispatch(q, q, q, causal=True).backend == "flash"
    with torch.no_grad():  # gradient mode is part of the signature
        assert dispatch.decide(q, q, q, **options)[1].backend == "torch"
    monkeypatch.setattr(flash_mod, "native_ops", lambda: None)  # so is the fused kernel
    assert dispatch.decide(q, q, q, **options)[1].backend == "torch"
    huge = (q.detach() * 1e4).requires_grad_()  # the scores' bound is checked on every call
    assert dispatch.decide(huge, huge, huge, **options)[1].backend == "math"


def test_cached_signature_still_rejects_bad_arguments():
    """Validation is part of the signature: a bad mask or option raises every time."""
    q = torch.randn(1, 2, 16, 8)
    assert scaled_dot_product_attention(q, q, q, mask=torch.ones(16, 16, dtype=torch.bool)).shape
    for _ in range(2):
        with pytest.raises(ValueError, match="mask"):
            scaled_dot_product_attention(q, q, q, mask=torch.ones(16, 15, dtype=torch.bool))
        with pytest.raises(TypeError, match="mask"):
            scaled_dot_product_attention(q, q, q, mask=torch.ones(16, 16))
        with pytest.raises(ValueError, match="window"):
            scaled_dot_product_attention(q, q, q, window=0)
        with pytest.raises(TypeError, match="dtype"):
            scaled_dot_product_attention(q, q.double(), q)
    # options that hash alike but mean something else, or are not tensors at all
    assert scaled_dot_product_attention(q, q, q, window=1).shape == q.shape
    assert scaled_dot_product_attention(q, q, q, return_weights=True,
                                        weights_heads=torch.tensor([1]))[1].shape[-3] == 1  # fmt: skip
    for _ in range(2):
        with pytest.raises(ValueError, match="window"):
            scaled_dot_product_attention(q, q, q, window=True)  # == 1 as a dict key
        with pytest.raises(ValueError, match="weights_heads"):
            scaled_dot_product_attention(q, q, q, return_weights=True,
                                         weights_heads=torch.tensor([2]))  # fmt: skip
        with pytest.raises(TypeError, match="mask"):
            scaled_dot_product_attention(q, q, q, mask=[[True] * 16] * 16)


def test_decide_rejects_unknown_options():
    from qkv import dispatch

    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match="casual"):
        dispatch.decide(q, q, q, casual=True)


def test_signature_without_the_compiled_module(monkeypatch):
    """Without the extension's module (no compiler, QKV_NATIVE=0) the cache key and the
    scores' bound are computed in Python: same decisions, same checks."""
    from qkv import dispatch

    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    mask = torch.rand(16, 16) > 0.2
    expected = scaled_dot_product_attention(q, q, q, mask=mask, backend="math")
    monkeypatch.setattr(dispatch.case, "native_module", lambda: None)  # the scores' bound
    monkeypatch.setattr(dispatch.cache, "native_module", lambda: None)  # the signature
    for _ in range(2):
        torch.testing.assert_close(scaled_dot_product_attention(q, q, q, mask=mask), expected)
        huge = (q.detach() * 1e4).requires_grad_()
        assert dispatch.decide(huge, huge, huge, mask=mask)[1].backend == "math"
        with pytest.raises(ValueError, match="mask"):
            scaled_dot_product_attention(q, q, q, mask=torch.ones(16, 15, dtype=torch.bool))


@pytest.mark.parametrize("backend", ["auto", "flash", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_remembered_fast_paths_follow_each_calls_values(backend, dtype):
    """Calls of one signature reuse the first call's torch arguments or flash plan: each
    call's own values, mask and bias still decide its output and gradients (vs fp64)."""
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-4)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, 4, 40, 8, generator=g).to(dtype) for _ in range(3))
        mask = torch.rand(40, 40, generator=g) > 0.3
        for kw in (dict(causal=True), dict(mask=mask)):
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            out = scaled_dot_product_attention(*inputs, backend=backend, **kw)
            ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
            ref = scaled_dot_product_attention(*ref_in, backend="math", **kw)
            torch.testing.assert_close(out.double(), ref, **tol)
            grads = torch.autograd.grad(out.float().square().sum(), inputs)
            ref_grads = torch.autograd.grad(ref.square().sum(), ref_in)
            for a, b in zip(grads, ref_grads):
                torch.testing.assert_close(a.double(), b, **tol)


# --- the rules of each kernel level ---------------------------------------------------------


def _auto(level, monkeypatch, q, k, v, **kw):
    monkeypatch.setattr(dispatch.rules, "native_level", lambda: level)
    return dispatch.choose(dispatch.describe(q, k, v, **kw)).backend


@pytest.mark.parametrize("level", ["avx512", "avx512_vnni", "avx512_bf16", "amx", "avx2", "avx2_vnni",
                                   "portable"])
def test_each_level_has_its_measured_rules(level, monkeypatch):
    """On the portable level the fused flash kernel loses to torch's dense kernels where the
    AVX-512 table picks it (avx2 keeps that table's flash rows); on both, the decode kernel
    loses beyond a few rows per kv head."""
    if dispatch._fused_reason(dispatch.describe(*(torch.randn(1, 1, 4, 8) for _ in "qkv"))):
        pytest.skip("fused kernel not built here")
    tuned = level not in dispatch.UNTUNED_LEVELS
    big = [torch.randn(1, 2, 1024, 16) for _ in range(3)]
    assert _auto(level, monkeypatch, *big) == ("flash" if tuned else "torch")
    assert _auto(level, monkeypatch, *big, window=64) == "flash"  # Tk >= 4·window everywhere
    grad = [t.bfloat16().requires_grad_() for t in big]
    assert _auto(level, monkeypatch, *grad, causal=True) == "flash"
    fp32_grad = [t.clone().requires_grad_() for t in big]
    assert _auto(level, monkeypatch, *fp32_grad, causal=True) == ("flash" if tuned else "torch")
    # decode: G·Tq query rows per kv head (GQA 4:1, and 16:1 for 128 rows)
    cache = [torch.randn(1, 2, 2048, 32) for _ in range(2)]
    for G, Tq, dtype in ((4, 1, torch.float32), (4, 4, torch.float32), (4, 16, torch.float32),
                         (16, 8, torch.float32), (4, 1, torch.bfloat16), (4, 4, torch.bfloat16)):  # fmt: skip
        q = torch.randn(1, 2 * G, Tq, 32).to(dtype)
        got = _auto(level, monkeypatch, q, *(t.to(dtype) for t in cache))
        # None: the first table's decode row (avx2_vnni: the avx2 build's rows)
        limit = dispatch.UNTUNED_DECODE.get(build_of(level))
        want = "decode" if limit is None or (G * Tq <= limit[0] and dtype in limit[1]) else "torch"
        assert got == want, (level, G, Tq, dtype, got)


def test_a_bias_row_hidden_by_a_huge_finite_value_gets_right_gradients():
    """A row of a float bias all ``finfo.min`` (a mask written as a bias, without -inf): its
    fp32 log-sum-exp loses ``log Tk``, and a backward that rebuilds the weights from it (torch,
    flash) gives gradients Tk times too large. ``auto`` sees the row and takes math; rows that
    see some key (a padding bias) keep the fast path."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.float64, generator=g) for _ in range(3))
    bias = torch.zeros(4, 4, dtype=torch.float64)
    bias[1] = torch.finfo(torch.float32).min

    def grads(backend, dtype):
        ins = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = scaled_dot_product_attention(*ins, bias=bias.to(dtype), backend=backend)
        return [out, *torch.autograd.grad(out.square().sum(), ins)]

    ref = grads("math", torch.float64)  # every key of row 1 equally weighted: V's mean
    assert torch.allclose(ref[0][0, :, 1], v[0].mean(-2))
    for got, want in zip(grads("auto", torch.float32), ref):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    with torch.enable_grad():
        ins = [t.float().requires_grad_() for t in (q, k, v)]
        assert explain_dispatch(*ins, bias=bias.float()).backend == "math"
        padding = torch.zeros(4, 4)
        padding[:, 3] = torch.finfo(torch.float32).min  # every row sees keys 0-2
        assert explain_dispatch(*ins, bias=padding).backend != "math"


def test_explain_dispatch_covers_block_masks_alibi_and_relative_tables():
    """One explain_dispatch for every call: the extras' row, then the dense rows."""
    from qkv import masks

    q = k = v = torch.randn(1, 2, 64, 16)
    fused = explain_dispatch(q, k, v, alibi_slopes=torch.ones(2))
    assert (fused.backend, fused.kernel) == ("flash", "fused C++ kernel")
    bm = masks.create_block_mask(lambda b, h, i, j: j <= i, 1, 1, 64, 64, block_size=16)
    assert explain_dispatch(q, k, v, mask=bm).kernel == "fused C++ kernel"
    # not fused (dropout): expanded to a dense bias, then the usual rows decide
    dense = explain_dispatch(q, k, v, rel_bias=torch.zeros(2, 127), dropout_p=0.1)
    assert dense.backend == "torch" and "dropout" in str(dense)
    assert explain_dispatch(q, k, v, alibi_slopes=torch.ones(2), backend="math").backend == "math"
    # what it says is what runs
    slopes = masks.alibi_slopes(2)
    with torch.no_grad():
        out = scaled_dot_product_attention(q, k, v, alibi_slopes=slopes)
    ref = scaled_dot_product_attention(q, k, v, bias=masks.alibi_bias(2, 64), backend="math")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_int8_rows_are_routed_by_the_rule_table():
    """An int8 cache's packed rows: decode reads them as stored, any other path widens them."""
    from qkv.cache import dequantize_rows, quantize_rows

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 1, 32, generator=g)
    k8, v8 = (quantize_rows(torch.randn(1, 2, 50, 32, generator=g)) for _ in range(2))
    assert explain_dispatch(q, k8, v8).backend == "decode"
    assert "int8" in explain_dispatch(q, k8, v8).why
    with_weights = explain_dispatch(q, k8, v8, return_weights=True, weights_heads=[0])
    assert with_weights.backend != "decode"  # weights are rebuilt from widened rows
    k, v = dequantize_rows(k8), dequantize_rows(v8)
    want = scaled_dot_product_attention(q.double(), k.double(), v.double(), backend="math")
    for backend in ("auto", "decode", "math", "torch", "flash"):
        got = scaled_dot_product_attention(q, k8, v8, backend=backend)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    out, w = scaled_dot_product_attention(q, k8, v8, return_weights=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 4, 1))
    with pytest.raises(TypeError, match="both be int8"):
        scaled_dot_product_attention(q, k8, v)
