"""The fused C++ flash kernel (qkv/csrc/flash_cpu.cpp) against the reference math and SDPA.

The kernel runs for fp32/bf16 CPU inputs with every option; fp64 stays on the PyTorch-ops
kernel (tests/kernels/test_flash.py). Both kernels are checked here on the same inputs: the
PyTorch-ops one with the fused kernel switched off. Biases, ALiBi, relative tables,
soft-capping and block masks: tests/kernels/test_flash_variants.py.
"""

import math
import os

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as TF
from hypothesis import given, settings

import qkv.kernels.flash as flash_mod
from native import assert_level_ok, other_levels, require_built
from qkv import masks
from qkv.dispatch import UNTUNED_LEVELS
from qkv.functional import attention_steps, explain_dispatch
from qkv.kernels._native import native_level, native_module, native_ops, native_status
from qkv.kernels.flash import flash_attention
from strategies import draw_mask_and_bias

require_built(native_ops() is not None, "fused CPU kernel", native_status())


@pytest.fixture
def ops_kernel(monkeypatch):
    """Run flash_attention on its PyTorch-ops kernel (the fused one switched off)."""
    monkeypatch.setattr(flash_mod, "native_ops", lambda: None)


def _ref(q, k, v, **kw):
    """fp64 reference output, lse and gradients for upstream gradient ``g``."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    steps = attention_steps(q64, k64, v64, **kw)
    return steps, (q64, k64, v64)


@st.composite
def native_case(draw):
    B, h_kv, G = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    Tq, Tk = draw(st.integers(1, 90)), draw(st.integers(1, 90))
    d, d_v = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**16))
    kw = dict(
        causal=draw(st.booleans()),
        window=draw(st.none() | st.integers(1, 30)),
        scale=draw(st.none() | st.floats(0.05, 2.0)),
    )
    blocks = dict(block_q=draw(st.integers(1, 40)), block_k=draw(st.integers(1, 70)))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, h_kv * G, Tq, d, generator=g)
    k = torch.randn(B, h_kv, Tk, d, generator=g)
    v = torch.randn(B, h_kv, Tk, d_v, generator=g)
    mask, _ = draw_mask_and_bias(draw, g, B, h_kv * G, Tq, Tk, torch.float32)  # bool masks
    if mask is not None:
        kw["mask"] = mask
    return q, k, v, kw, blocks


@given(native_case())
def test_fused_fp32_equals_math_values_lse_gradients(case):
    """Random shapes, GQA, causal, windows, scales, block sizes and bool masks (all kinds)."""
    q, k, v, kw, blocks = case
    if "mask" in kw and kw["mask"].shape[-1] > 1:  # the fused kernel runs (not the fallback)
        assert flash_mod._native_ok(q, k, v, kw["mask"], 1.0)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    out, lse = flash_attention(q, k, v, **kw, **blocks, return_lse=True)
    ref, ref_inputs = _ref(q, k, v, **kw)
    torch.testing.assert_close(out.double(), ref.output, atol=2e-5, rtol=1e-4)
    assert torch.equal(lse == float("-inf"), ref.lse == float("-inf"))
    finite = ref.lse > float("-inf")
    torch.testing.assert_close(lse.double()[finite], ref.lse[finite], atol=2e-5, rtol=1e-4)
    g = torch.randn_like(out)
    ours = torch.autograd.grad(out, inputs, g)
    theirs = torch.autograd.grad(ref.output, ref_inputs, g.double())
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.double(), b, atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("kernel", ["fused", "ops"])
@pytest.mark.parametrize(
    "shape",
    [
        dict(B=2, h=4, h_kv=4, Tq=300, Tk=300, d=64, d_v=64, causal=False, window=None),
        dict(B=1, h=6, h_kv=2, Tq=257, Tk=300, d=64, d_v=32, causal=True, window=None),
        dict(B=1, h=2, h_kv=1, Tq=200, Tk=200, d=33, d_v=17, causal=True, window=40),
        dict(B=2, h=2, h_kv=2, Tq=130, Tk=70, d=16, d_v=16, causal=False, window=25),
        dict(
            B=2,
            h=4,
            h_kv=2,
            Tq=200,
            Tk=200,
            d=64,
            d_v=64,
            causal=True,
            window=None,
            padding=(150, 37),
        ),
    ],
)
def test_bf16_error_within_pytorch_bf16_error(shape, kernel, request):
    """bf16 against fp64 math, bounded by PyTorch's own bf16 SDPA error (with the same mask).

    Covers both bf16 matmul layouts of the fused kernel: packed for AMX (even d) and plain.
    """
    if kernel == "ops":
        request.getfixturevalue("ops_kernel")
    s = dict(shape)
    causal, window, padding = s.pop("causal"), s.pop("window"), s.pop("padding", None)
    torch.manual_seed(4)
    q = torch.randn(s["B"], s["h"], s["Tq"], s["d"]).bfloat16().requires_grad_()
    k = torch.randn(s["B"], s["h_kv"], s["Tk"], s["d"]).bfloat16().requires_grad_()
    v = torch.randn(s["B"], s["h_kv"], s["Tk"], s["d_v"]).bfloat16().requires_grad_()
    pad = None if padding is None else masks.padding(torch.tensor(padding), s["Tk"])
    ref, ref_inputs = _ref(q, k, v, causal=causal, window=window, mask=pad)
    g = torch.randn_like(ref.output)
    ref_grads = torch.autograd.grad(ref.output, ref_inputs, g)
    ours = flash_attention(q, k, v, causal=causal, window=window, mask=pad)
    allowed = masks.sliding_window(s["Tq"], s["Tk"], window, causal=causal) if window else None
    if allowed is None and causal:
        allowed = masks.causal(s["Tq"], s["Tk"])
    allowed = masks.combine(pad, allowed)
    theirs = TF.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    # rows with no visible key: torch gives NaN there (qkv gives 0, checked elsewhere)
    dead = ~allowed.any(-1, keepdim=True) if allowed is not None else torch.tensor(False)
    err_ours = (ours.double() - ref.output).masked_fill(dead, 0).abs().max()
    err_theirs = (theirs.double() - ref.output).masked_fill(dead, 0).abs().max()
    assert err_ours <= 4 * err_theirs + 1e-3, (err_ours, err_theirs)
    ours_g = torch.autograd.grad(ours, (q, k, v), g.bfloat16())
    scale = max(t.abs().max() for t in ref_grads)
    for a, r in zip(ours_g, ref_grads):
        # bf16 rounding of the inputs to the block matmuls: a few bf16 ulps of the largest grad
        assert (a.double() - r).abs().max() <= 0.05 * scale, ((a.double() - r).abs().max(), scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_with_no_visible_key_are_zero_with_zero_grads(dtype):
    """Causal with Tq > Tk (bottom-right): the first Tq - Tk queries see nothing."""
    torch.manual_seed(5)
    q = torch.randn(1, 2, 12, 8, dtype=dtype, requires_grad=True)
    k = torch.randn(1, 2, 5, 8, dtype=dtype, requires_grad=True)
    v = torch.randn(1, 2, 5, 8, dtype=dtype, requires_grad=True)
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True, block_q=4, block_k=2)
    assert torch.all(out[:, :, :7] == 0) and torch.all(lse[:, :, :7] == float("-inf"))
    assert lse[:, :, 7:].isfinite().all()
    out.sum().backward()
    assert not any(t.grad.isnan().any() for t in (q, k, v))
    assert torch.all(q.grad[:, :, :7] == 0)


def test_fused_and_ops_kernels_agree(monkeypatch):
    torch.manual_seed(6)
    q, k, v = (torch.randn(2, 4, 333, 48) for _ in range(3))
    fused = flash_attention(q, k, v, causal=True, window=100, return_lse=True)
    monkeypatch.setattr(flash_mod, "native_ops", lambda: None)
    ops = flash_attention(q, k, v, causal=True, window=100, return_lse=True)
    for a, b in zip(fused, ops):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)


def test_explain_dispatch_names_the_flash_kernel():
    q = torch.randn(1, 2, 64, 16)
    assert explain_dispatch(q, q, q, causal=True, backend="flash").kernel == "fused C++ kernel"
    mask = torch.ones(64, 64, dtype=torch.bool)
    assert explain_dispatch(q, q, q, mask=mask, backend="flash").kernel == "fused C++ kernel"
    bias = torch.zeros(64, 64)
    assert explain_dispatch(q, q, q, bias=bias, backend="flash").kernel == "fused C++ kernel"
    q64 = q.double()
    why = str(explain_dispatch(q64, q64, q64, bias=bias.double(), backend="flash"))
    assert "PyTorch-ops kernel" in why and "float64" in why


def _qkv(T, dtype, grad):
    return [torch.randn(1, 2, T, 8, dtype=dtype, requires_grad=grad) for _ in range(3)]


@pytest.mark.parametrize(
    "T, dtype, grad, kw, expected, untuned",  # untuned: on the portable and neon levels
    [
        (64, torch.bfloat16, True, {}, "flash", "flash"),  # training, bf16: fused flash
        (64, torch.float32, True, {}, "torch", "torch"),  # training, fp32, short: torch
        (2048, torch.float32, True, {"causal": True}, "flash", "torch"),
        (512, torch.float32, False, {}, "torch", "torch"),  # short fp32 inference
        (1024, torch.float32, False, {}, "flash", "torch"),
        (512, torch.bfloat16, False, {"causal": True, "window": 256}, "flash", "torch"),
        (1024, torch.bfloat16, False, {"causal": True, "window": 256}, "flash", "flash"),
        (512, torch.bfloat16, False, {"causal": True}, "torch", "torch"),  # short bf16 inference
        (4096, torch.bfloat16, False, {"causal": True}, "flash", "torch"),
        (2048, torch.bfloat16, True, {"mask": "padding"}, "flash", "flash"),  # masks are fused too
        (2048, torch.bfloat16, True, {"bias": "zeros"}, "flash", "flash"),  # biases are fused too
    ],
)  # fmt: skip
def test_auto_rules_for_the_fused_kernel(T, dtype, grad, kw, expected, untuned):
    """The rule table of qkv.dispatch, on this machine's kernel level (the portable and neon
    levels have their own measured rows)."""
    if native_level() in UNTUNED_LEVELS:
        expected = untuned
    q, k, v = _qkv(T, dtype, grad)
    if kw.get("mask") == "padding":
        kw = {"mask": masks.padding(torch.tensor([T - 3]), T)}
    if kw.get("bias") == "zeros":
        kw = {"bias": torch.zeros(T, T, dtype=dtype)}
    decision = explain_dispatch(q, k, v, **kw)
    assert decision.backend == expected, str(decision)
    if expected == "flash":
        assert decision.kernel == "fused C++ kernel"


def test_auto_grad_rule_follows_no_grad_and_kernel_availability(monkeypatch):
    q, k, v = _qkv(64, torch.bfloat16, True)
    assert explain_dispatch(q, k, v).backend == "flash"
    with torch.no_grad():
        assert explain_dispatch(q, k, v).backend == "torch"
    monkeypatch.setattr(flash_mod, "native_ops", lambda: None)
    decision = explain_dispatch(q, k, v)
    assert decision.backend == "torch"


_LEVEL_CHECK_SCRIPT = """
import torch
from qkv.functional import attention_steps
from qkv.kernels._native import native_module, native_status
from qkv.kernels.flash import flash_attention
torch.manual_seed(0)
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
    q = torch.randn(2, 4, 70, 16).to(dtype).requires_grad_()
    k, v = (torch.randn(2, 2, 90, 16).to(dtype).requires_grad_() for _ in range(2))
    for mask in (None, torch.rand(70, 90) > 0.3):
        kw = dict(causal=True, window=30, mask=mask)
        out = flash_attention(q, k, v, **kw, block_q=16, block_k=32)
        ref = attention_steps(*(t.double() for t in (q, k, v)), **kw).output
        assert (out.double() - ref).abs().max() < tol, dtype
        g = torch.autograd.grad(out.sum(), (q, k, v))
        r = torch.autograd.grad(ref.sum(), (q, k, v))
        assert max((a.double() - b.double()).abs().max() for a, b in zip(g, r)) < 10 * tol
    # huge logits (exponent argument), huge blocks (clamped), an empty batch: as AVX-512
    x = torch.randn(2, 4, 64, 32).to(dtype)
    out = flash_attention(x, x, x, scale=1e10)
    ref = attention_steps(*(x.double() for _ in "qkv"), scale=1e10).output
    assert torch.isfinite(out).all() and (out.double() - ref).abs().max() < tol, dtype
    out = flash_attention(q, k, v, causal=True, block_q=2**20, block_k=2**20)
    ref = attention_steps(*(t.double() for t in (q, k, v)), causal=True).output
    assert (out.double() - ref).abs().max() < tol, dtype
    assert flash_attention(x[:0], x[:0], x[:0]).shape == (0, 4, 64, 32)
    bound = native_module().max_abs_product(q.detach(), k.detach())
    assert bound == float(q.detach().double().abs().max() * k.detach().double().abs().max())
print("ok")
"""


@pytest.mark.parametrize("level", other_levels())
def test_every_level_gives_the_same_answers(level):
    """Each other kernel level this CPU can run (the portable build included: plain C++
    loops, what a CPU without AVX2 runs) is right too."""
    assert_level_ok(_LEVEL_CHECK_SCRIPT, level)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_max_abs_product_is_the_dispatchers_logit_bound(dtype):
    """max|q|·max|k| in one pass (the bound on the scores that picks math for huge logits),
    equal to torch's, NaN when an input holds one, over views and empty tensors too."""
    module = native_module()  # what qkv.dispatch._logit_bound calls
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(2, 3, 37, 8, generator=g) * 7).to(dtype)
    k = (torch.randn(2, 3, 41, 8, generator=g) * 3).to(dtype)
    k.view(-1)[100] = -1e3  # a negative maximum of |k|
    ref = float(q.double().abs().max() * k.double().abs().max())
    assert module.max_abs_product(q, k) == ref
    assert module.max_abs_product(q.transpose(1, 2), k) == ref  # not contiguous
    assert module.max_abs_product(q[:0], k) == 0.0
    inf = q.clone()
    inf.view(-1)[5] = -float("inf")
    assert module.max_abs_product(inf, k) == float("inf")
    inf.view(-1)[6] = float("nan")
    assert math.isnan(module.max_abs_product(inf, k))


def test_stale_build_lock_is_removed(tmp_path, monkeypatch):
    # a build killed midway leaves PyTorch's `lock` file; loading must not wait on it forever
    from qkv.kernels._native import _build_lock

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale = tmp_path / "qkv_test_ext" / "lock"
    stale.parent.mkdir()
    stale.touch()
    with _build_lock("qkv_test_ext"):
        assert not stale.exists()
    assert (tmp_path / "qkv_test_ext" / "qkv-build.flock").exists()


# --- bf16 matmul paths: AMX tiles, the AVX512_BF16 dot-product kernel, oneDNN's brgemm ---


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _bf16_paths() -> list[str]:
    """QKV_BF16_MATMUL values whose path this machine has (amx and onednn only on the amx
    level, where oneDNN sees AMX)."""
    paths = ["dot", "widen", "brgemm"]
    if native_level() == "amx" and os.environ.get("ONEDNN_MAX_CPU_ISA") is None:
        paths += ["amx", "onednn"]
    return paths


def test_bf16_matmul_switch_picks_the_path_and_rejects_unknown_values(monkeypatch):
    has_dot = "avx512_bf16" in _cpu_flags() and native_level() in ("avx512_bf16", "amx")
    monkeypatch.setenv("QKV_BF16_MATMUL", "dot")
    assert native_ops().bf16_path().startswith("avx512_bf16" if has_dot else "widen")
    monkeypatch.setenv("QKV_BF16_MATMUL", "widen")
    assert native_ops().bf16_path().startswith("widen")
    monkeypatch.delenv("QKV_BF16_MATMUL")  # auto: without AMX or bf16 dot products, widen
    if native_level() != "amx" and not has_dot:  # also a lower level forced on an AMX CPU
        assert native_ops().bf16_path().startswith("widen")
    monkeypatch.setenv("QKV_BF16_MATMUL", "brgemm")
    assert native_ops().bf16_path().startswith("brgemm")
    assert native_status().endswith("bf16 path: " + native_ops().bf16_path())
    if native_level() != "amx":  # asking for AMX where the CPU or level has none: an error
        for name in ("amx", "onednn"):
            monkeypatch.setenv("QKV_BF16_MATMUL", name)
            with pytest.raises(RuntimeError, match=f"QKV_BF16_MATMUL={name}: no AMX here"):
                native_ops().bf16_path()
    else:  # qkv's tile kernel, or every call through oneDNN's brgemm on tiles
        monkeypatch.setenv("QKV_BF16_MATMUL", "amx")
        assert native_ops().bf16_path().startswith("amx (qkv tile kernel")
        monkeypatch.setenv("QKV_BF16_MATMUL", "onednn")
        assert native_ops().bf16_path() == "amx (oneDNN brgemm, AMX tiles)"
    monkeypatch.setenv("QKV_BF16_MATMUL", "sse2")
    with pytest.raises(RuntimeError, match="QKV_BF16_MATMUL must be auto, amx, onednn, dot, widen or brgemm"):
        native_ops().bf16_path()
    q = torch.randn(1, 1, 4, 8).bfloat16()
    with pytest.raises(ValueError, match="QKV_BF16_MATMUL must be"):  # checked before the call
        flash_attention(q, q, q)


@pytest.mark.parametrize("path", _bf16_paths())
@settings(max_examples=25)
@given(case=native_case())
def test_bf16_paths_equal_math_within_bf16_error(path, case):
    """Every bf16 matmul path against fp64 math: odd head dims and key counts (the dot
    kernel's paired reduction), GQA, tails of every size, causal/window, bool masks."""
    q, k, v, kw, blocks = case
    q, k, v = (t.bfloat16().requires_grad_() for t in (q, k, v))
    ref, ref_inputs = _ref(q, k, v, **kw)
    old = os.environ.get("QKV_BF16_MATMUL")
    os.environ["QKV_BF16_MATMUL"] = path
    try:
        out = flash_attention(q, k, v, **kw, **blocks)
        g = torch.randn(ref.output.shape, generator=torch.Generator().manual_seed(1))
        ours = torch.autograd.grad(out, (q, k, v), g.bfloat16())
    finally:
        if old is None:
            del os.environ["QKV_BF16_MATMUL"]
        else:
            os.environ["QKV_BF16_MATMUL"] = old
    # inputs are exact bf16 numbers; the kernel rounds p (<= 1) and the output to bf16
    ref_out = ref.output
    assert (out.double() - ref_out).abs().max() <= 2e-2 * max(1.0, v.abs().max().item())
    theirs = torch.autograd.grad(ref_out, ref_inputs, g.double())
    for a, r in zip(ours, theirs):
        bound = 0.05 * max(r.abs().max().item(), 1e-3)
        assert (a.double() - r).abs().max() <= bound, ((a.double() - r).abs().max(), bound)
