"""int8 linear layers (qkv/csrc/int8_cpu.cpp, qkv.kernels.int8).

The integer sums must equal a torch int64 matmul of the same quantized operands exactly;
the quantization of the rows must equal the formula written here with torch ops; the float
output must stay within the documented error bound of the fp64 linear.
"""

import doctest

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import qkv.kernels.int8 as int8_mod
from native import assert_level_ok, other_levels, require_built
from qkv.generate import beam_search, greedy_search
from qkv.kernels._native import int8_ops, native_status
from qkv.kernels.int8 import (
    Int8Linear,
    SmallBatchInt8Linear,
    fuse_packed,
    int8_linear,
    quantize_linears,
    quantize_rows,
    quantize_weight,
)
from qkv.models import Seq2SeqTransformer, TransformerConfig
from qkv.models.incremental import IncrementalDecoder, unsupported

torch.set_num_threads(1)

require_built(int8_ops() is not None, "int8 kernel", native_status())

FLT_MIN = torch.finfo(torch.float32).tiny


def ref_quantize_rows(x: torch.Tensor):
    """Per-row asymmetric uint8 quantization, as documented: s = (max(x,0) - min(x,0)) / 255
    (divided before subtracting, at least FLT_MIN), z = round(-min/s), q = round(x/s) + z."""
    zero = torch.zeros(x.shape[0])
    lo = torch.minimum(x.amin(1), zero) if x.shape[1] else zero
    hi = torch.maximum(x.amax(1), zero) if x.shape[1] else zero
    s = torch.clamp(hi / 255 - lo / 255, min=FLT_MIN)
    inv = 1 / s
    z = torch.round(-lo * inv).clamp(0, 255)
    q = (torch.round(x * inv[:, None]) + z[:, None]).clamp(0, 255)
    return q.to(torch.uint8), s, z.to(torch.int32)


def error_bound(x, w, sx, sw, b=None):
    """The documented bound Σ_k |x| s_w/2 + |w| s_x/2 + s_x s_w/4, plus float rounding."""
    x, w, sx, sw = x.double(), w.double(), sx.double(), sw.double()
    K = x.shape[1]
    ax, aw = x.abs(), w.abs()
    bound = ax.sum(1, keepdim=True) * sw / 2 + sx[:, None] * aw.sum(1) / 2
    bound += K * sx[:, None] * sw / 4
    mag = ax @ aw.T + (0 if b is None else b.double().abs())
    return bound * (1 + 1e-3) + 1e-5 * mag + 1e-30


@st.composite
def problems(draw):
    M = draw(st.sampled_from([0, 1, 2, 3, 4, 5, 7, 9, 17, 33]))
    K = draw(st.sampled_from([1, 3, 4, 5, 63, 64, 65, 130, 256]))
    N = draw(st.sampled_from([1, 5, 16, 17, 63, 64, 65, 130, 200]))
    x_exp = draw(st.sampled_from([-30, -5, 0, 3, 30]))
    w_exp = draw(st.sampled_from([-20, -3, 0, 2]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * 10.0**x_exp
    if draw(st.booleans()):  # post-ReLU rows: all >= 0
        x = x.clamp_min(0)
    if M and draw(st.booleans()):  # a row of zeros
        x[draw(st.integers(0, M - 1))] = 0
    w = torch.randn(N, K, generator=g) * 10.0**w_exp
    b = torch.randn(N, generator=g) if draw(st.booleans()) else None
    return x, w, b


@given(problems())
def test_integer_sums_exact_and_output_within_bound(problem):
    x, w, b = problem
    M, K = x.shape
    N = w.shape[0]
    pw = quantize_weight(w)
    # the weight: symmetric per channel, |W_q| <= 127
    assert pw.weight.dtype == torch.int8 and int(pw.weight.abs().max()) <= 127
    assert torch.allclose(pw.scale.double(), w.double().abs().amax(1) / 127, rtol=1e-6)
    # the rows, exactly as the documented formula
    q, sx, z = quantize_rows(x)
    rq, rs, rz = ref_quantize_rows(x)
    assert q.shape == (M, (K + 3) // 4 * 4)
    assert torch.equal(q[:, :K], rq) and torch.equal(sx, rs) and torch.equal(z, rz)
    assert not q[:, K:].any()
    # the integer sums equal an int64 matmul of the same operands
    acc = torch.ops.qkv_int8.matmul_s32(q, z, pw.packed, pw.wsum, N)
    ref = (rq.long() - rz[:, None].long()) @ pw.weight.long().T  # (M, N)
    assert torch.equal(acc.long(), ref)
    # the float output: the dequantized integers (float rounding only) ...
    y = int8_linear(x, pw, b)
    assert y.shape == (M, N) and bool(torch.isfinite(y).all())
    yq = ref.double() * rs.double()[:, None] * pw.scale.double()
    if b is not None:
        yq += b.double()
    assert ((y.double() - yq).abs() <= 1e-6 * yq.abs() + 1e-30 + 1e-6 * (b is not None)).all()
    # ... and within the documented bound of the exact linear
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    assert ((y.double() - exact).abs() <= error_bound(x, w, rs, pw.scale, b)).all()


def test_long_rows_exact():
    """Rows around the AVX2 kernel's limit for widening q once per call (2048 values; longer
    rows are widened in its loop), with a tail that is not a whole vector: exact sums."""
    g = torch.Generator().manual_seed(1)
    for K in (2044, 2048, 2052, 4101):
        x, w = torch.randn(5, K, generator=g), torch.randn(70, K, generator=g)
        pw = quantize_weight(w)
        q, _, z = quantize_rows(x)
        acc = torch.ops.qkv_int8.matmul_s32(q, z, pw.packed, pw.wsum, 70)
        ref = (q.long() - z[:, None].long())[:, :K] @ pw.weight.long().T
        assert torch.equal(acc.long(), ref), K


def test_translator_shapes_exact_with_threads():
    """The shapes that matter (K 256/1024; N 256..8000; M up to 160), 1 and 2 threads, the
    rows split among threads too (N = 64 gives one channel group)."""
    g = torch.Generator().manual_seed(0)
    for M, K, N in [(1, 256, 8000), (5, 1024, 256), (160, 256, 768), (160, 1024, 64)]:
        x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) * 0.05
        pw = quantize_weight(w)
        q, sx, z = quantize_rows(x)
        ref = (q.long() - z[:, None].long())[:, :K] @ pw.weight.long().T
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            try:
                acc = torch.ops.qkv_int8.matmul_s32(q, z, pw.packed, pw.wsum, N)
                outs.append(int8_linear(x, pw))
            finally:
                torch.set_num_threads(1)
            assert torch.equal(acc.long(), ref), (M, K, N, threads)
        assert torch.equal(outs[0], outs[1])
        exact = x.double() @ w.double().T
        assert ((outs[0].double() - exact).abs() <= error_bound(x, w, sx, pw.scale)).all()


def test_rows_are_independent():
    """Per-row quantization: a row's output does not depend on the other rows (batching,
    beams, padding change nothing)."""
    g = torch.Generator().manual_seed(1)
    x, lin = torch.randn(9, 100, generator=g), nn.Linear(100, 70)
    pw = quantize_weight(lin.weight)
    full = int8_linear(x, pw, lin.bias.detach())
    for i in range(9):
        assert torch.equal(int8_linear(x[i : i + 1], pw, lin.bias.detach()), full[i : i + 1])


def test_huge_and_tiny_magnitudes_stay_finite():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 64, generator=g)
    for scale in (3e38 / 64, 1e30, 1e-30, 1e-40, 1e-45):  # near FLT_MAX ... denormals
        x = (torch.rand(3, 64, generator=g) * 2 - 1) * scale
        for wscale in (1e-3, 1.0):
            pw = quantize_weight(w * wscale)
            y = int8_linear(x, pw)
            exact = x.double() @ (w * wscale).double().T
            if exact.abs().max() < 3e38:
                assert bool(torch.isfinite(y).all()), (scale, wscale)
                assert (
                    (y.double() - exact).abs()
                    <= error_bound(x, w * wscale, quantize_rows(x)[1], pw.scale)
                ).all()  # noqa: E501
    # weights of every magnitude, denormals included, quantize without inf/NaN
    for wscale in (3e38, 1e-40, 0.0):
        pw = quantize_weight(torch.full((3, 5), wscale))
        assert bool(torch.isfinite(pw.scale).all()) and int(pw.weight.abs().max()) <= 127


def test_non_finite_row_gives_nan_row_only():
    x = torch.randn(3, 20)
    x[1, 4] = float("inf")
    x[2, 0] = float("nan")
    lin = nn.Linear(20, 30)
    for act in ("none", "relu"):
        y = int8_linear(x, quantize_weight(lin.weight), lin.bias.detach(), act)
        assert bool(torch.isfinite(y[0]).all())
        assert bool(y[1:].isnan().all())


def test_relu_and_gelu_fused_like_float():
    lin = nn.Linear(48, 33)
    x = torch.randn(6, 48)
    pw = quantize_weight(lin.weight)
    y = int8_linear(x, pw, lin.bias.detach())
    assert torch.equal(int8_linear(x, pw, lin.bias.detach(), "relu"), y.relu())
    assert torch.allclose(int8_linear(x, pw, lin.bias.detach(), "gelu"), nn.functional.gelu(y))
    m = Int8Linear.from_linear(lin, activation="gelu")  # (B, T, K) in, (B, T, N) out
    assert torch.allclose(m(x.view(2, 3, 48)), nn.functional.gelu(y).view(2, 3, 33))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_empty_shapes():
    """No rows, no outputs, or no inputs (then y = b), as nn.Linear."""
    for M, K, N in [(0, 8, 5), (4, 8, 0), (3, 0, 6)]:
        lin = nn.Linear(K, N)
        x = torch.randn(M, K)
        y = Int8Linear.from_linear(lin)(x)
        assert y.shape == (M, N)
        with torch.no_grad():
            assert torch.equal(y, lin(x)) or M * N == 0


def test_int8_linear_module_and_state_dict():
    lin = nn.Linear(50, 24)
    m = Int8Linear.from_linear(lin)
    x = torch.randn(2, 3, 50)
    y = m(x)
    assert y.shape == (2, 3, 24)
    with torch.no_grad():
        assert (y - lin(x)).abs().max() < 0.05
    assert m.weight.dtype == torch.int8 and "int8" in repr(m)
    m2 = Int8Linear.from_linear(nn.Linear(50, 24))
    m2.load_state_dict(m.state_dict())  # the packed copy follows the loaded weight
    assert torch.equal(m2(x), y)
    assert set(m.state_dict()) == {"weight", "weight_scale", "bias"}
    # other float dtypes are computed in fp32 and returned in their own dtype
    assert m(x.double()).dtype == torch.float64
    assert torch.equal(m(x.double()).float(), y)


def test_small_batch_linear_matches_and_fuses():
    torch.manual_seed(3)
    lins = [nn.Linear(64, n) for n in (64, 16, 16)]
    mods = [Int8Linear.from_linear(lin) for lin in lins]
    x = torch.randn(5, 64)
    fused = SmallBatchInt8Linear.fuse(*mods)
    assert torch.equal(fused(x), torch.cat([m(x) for m in mods], dim=1))
    f = SmallBatchInt8Linear(lins[0].weight, lins[0].bias, "relu")
    assert torch.equal(f(x), mods[0](x).relu())
    assert torch.equal(fuse_packed(mods[0].packed).packed, mods[0].packed.packed)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = TransformerConfig(src_vocab_size=40, tgt_vocab_size=40, d_model=32, n_heads=4,
                            d_ff=64, dropout=0.0)  # fmt: skip
    return Seq2SeqTransformer(cfg).eval()


SRC = torch.tensor([[5, 6, 7, 8, 9, 2], [10, 11, 2, 0, 0, 0], [12, 13, 14, 2, 0, 0]])


def test_quantized_seq2seq_translates():
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    q = quantize_linears(model)
    # the original is untouched; every linear of the copy is int8, embeddings stay float
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not any(isinstance(m, nn.Linear) for m in q.modules())
    assert q.decoder.embed.embedding.weight.dtype == torch.float32
    assert sum(isinstance(m, Int8Linear) for m in q.modules()) == sum(
        isinstance(m, nn.Linear) for m in model.modules()
    )
    with torch.no_grad():
        tgt = torch.tensor([[1, 5, 6, 7]] * 3)
        ref = model(SRC, tgt)
        out = q(SRC, tgt)
    assert (out - ref).abs().max() < 0.05 * ref.std()
    # the prepared incremental decoder runs it on the int8 kernels, token for token as the
    # uncached model
    assert IncrementalDecoder.for_model(q) is not None
    assert isinstance(IncrementalDecoder.for_model(q).out, SmallBatchInt8Linear)
    fast = greedy_search(q, SRC, max_new_tokens=12, ignore_eos=True)
    slow = greedy_search(q, SRC, max_new_tokens=12, ignore_eos=True, use_cache=False)
    assert fast.shape == (3, 12) and torch.equal(fast, slow)
    beams = beam_search(q, SRC, beam_size=3, max_new_tokens=12)
    slow_beams = beam_search(q, SRC, beam_size=3, max_new_tokens=12, use_cache=False)
    assert beams.shape[0] == 3 and int(beams.max()) < 40 and torch.equal(beams, slow_beams)


def test_mixed_int8_and_float_decode_on_the_general_path():
    q = quantize_linears(tiny_model(), skip=["decoder.out"])
    assert "mixed" in unsupported(q) and IncrementalDecoder.for_model(q) is None
    fast = greedy_search(q, SRC, max_new_tokens=8, ignore_eos=True)
    assert torch.equal(fast, greedy_search(q, SRC, max_new_tokens=8, ignore_eos=True,
                                           use_cache=False))  # fmt: skip


def test_quantize_linears_skip():
    model = tiny_model()
    q = quantize_linears(model, skip=["decoder.out", "*.ffn.w_2"])
    assert isinstance(q.decoder.out, nn.Linear)
    assert q.decoder.out.weight is q.decoder.embed.embedding.weight  # the tie is kept
    assert isinstance(q.encoder.layers[0].ffn.w_2, nn.Linear)
    assert isinstance(q.encoder.layers[0].ffn.w_1, Int8Linear)
    with pytest.raises(ValueError, match="skip='decoder.outt' matches no nn.Linear"):
        quantize_linears(model, skip="decoder.outt")


_LIN = nn.Linear(8, 4)
_PW = quantize_weight(_LIN.weight.detach())
BAD_INPUT = [  # (what, call, error, message)
    ("x-width", lambda: int8_linear(torch.randn(2, 7), _PW), ValueError,
     r"x must be a float tensor \(\.\.\., 8\), got \(2, 7\)"),
    ("x-dtype", lambda: int8_linear(torch.ones(2, 8, dtype=torch.long), _PW), ValueError,
     "x must be a float tensor"),
    ("x-grad", lambda: int8_linear(torch.randn(2, 8, requires_grad=True), _PW), RuntimeError,
     "inference only"),
    ("activation", lambda: int8_linear(torch.randn(2, 8), _PW, activation="tanh"), ValueError,
     "activation must be one of"),
    ("bias", lambda: int8_linear(torch.randn(2, 8), _PW, torch.zeros(5)), ValueError,
     r"bias must be a float tensor \(4,\)"),
    ("weight-type", lambda: int8_linear(torch.randn(2, 8), _LIN.weight), TypeError,
     "weight must be a PackedWeight"),
    ("weight-nan", lambda: quantize_weight(torch.tensor([[1.0, float("nan")]])), ValueError,
     "non-finite"),
    ("weight-1d", lambda: quantize_weight(torch.ones(3)), TypeError,
     "weight must be a 2-D float tensor"),
    ("weight-wide", lambda: quantize_weight(torch.zeros(1, 65537)), ValueError,
     "in_features must be <= 65536"),
    ("linear-type", lambda: Int8Linear.from_linear(nn.Conv1d(1, 1, 1)), TypeError,
     "linear must be an nn.Linear"),
    ("model-type", lambda: quantize_linears(_LIN.weight), TypeError,
     "model must be an nn.Module"),
    ("op-x-width", lambda: torch.ops.qkv_int8.linear(
        torch.randn(2, 7), _PW.packed, _PW.scale_padded, _PW.wsum, None, 4, 8, False),
     RuntimeError, "qkv int8: x must be"),
]  # fmt: skip


@pytest.mark.parametrize(("call", "error", "message"), [c[1:] for c in BAD_INPUT],
                         ids=[c[0] for c in BAD_INPUT])  # fmt: skip
def test_bad_input_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_torch_fallback_gives_the_same_integers():
    """Where the kernel cannot be built, PyTorch ops compute the same quantization and sums."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(7, 37, generator=g), torch.randn(21, 37, generator=g)
    pw = quantize_weight(w)
    q, s, z = int8_mod._quantize_rows_torch(x, 40)
    q2, s2, z2 = quantize_rows(x)
    assert torch.equal(q, q2) and torch.equal(s, s2) and torch.equal(z, z2)
    y = int8_mod._linear_torch(x, pw, None, False)
    assert torch.allclose(y, int8_linear(x, pw), rtol=1e-6, atol=1e-6)


def test_doctests():
    failed, tried = doctest.testmod(int8_mod)
    assert tried > 0 and failed == 0


_LEVEL_CHECK_SCRIPT = """
import os
import torch
from qkv.kernels._native import native_status
from qkv.kernels.int8 import int8_path, int8_linear, quantize_rows, quantize_weight
from qkv.kernels.int8 import _quantize_rows_torch
assert int8_path() == os.environ["QKV_INT8_LINEAR_PATH"], (int8_path(), native_status())
g = torch.Generator().manual_seed(0)
for M, K, N in ((1, 256, 130), (9, 67, 64), (40, 1024, 70), (6, 100, 64), (7, 36, 200)):  # R = 1-4
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    x[0] = x[0].clamp_min(0)
    pw = quantize_weight(w)
    q, s, z = quantize_rows(x)
    acc = torch.ops.qkv_int8.matmul_s32(q, z, pw.packed, pw.wsum, N)
    ref = (q.long() - z[:, None].long())[:, :K] @ pw.weight.long().T
    assert torch.equal(acc.long(), ref), (M, K, N)
    y = int8_linear(x, pw, None, "relu")
    yq = (ref.double() * s.double()[:, None] * pw.scale.double()).clamp_min(0)
    assert ((y.double() - yq).abs() <= 1e-6 * yq.abs() + 1e-30).all()
    rq, rs, rz = _quantize_rows_torch(x, q.shape[1])
    assert torch.equal(q, rq) and torch.equal(s, rs) and torch.equal(z, rz), (M, K, N)
print("ok")
"""


# the int8 products each level runs (int8_path)
_LINEAR_PATHS = {"portable": "portable", "avx2": "avx2 (int16 pairs)",
                 "avx2_vnni": "avx2_vnni (vpdpbusd)", "avx512": "avx2 (int16 pairs)",
                 "avx512_vnni": "avx512_vnni", "avx512_bf16": "avx512_vnni",
                 "amx": "avx512_vnni", "neon": "portable"}  # fmt: skip


@pytest.mark.parametrize("level", other_levels())
def test_every_level_gives_the_same_integers(level):
    """Each other kernel level this CPU can run, on its own int8 loops (vpdpbusd, int16
    pairs, plain C++), gives the same quantized rows (as the PyTorch formula) and the same
    integer sums (as an int64 matmul)."""
    assert_level_ok(_LEVEL_CHECK_SCRIPT, level, QKV_INT8_LINEAR_PATH=_LINEAR_PATHS[level])
