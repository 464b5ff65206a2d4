"""The int8 KV cache: its row format, the decode kernel reading it, and the models using it.

A stored row (one token, one kv head) is ``d`` int8 values and an fp32 scale
(``qkv.cache.quantize_rows``). The kernel's answers are checked against fp64 attention over
the *dequantized* keys and values (what the cache holds), with the fp32 tolerances of
``test_decode`` plus what the int8 path adds: two more fp32 roundings (the scale times
each score, the scale times each weight) and, where it takes integer dot products (AVX-512
VNNI, d = 64 or 128), the queries rounded to int16, each within ``max|q row| / 65534``, so a
score moves by at most ``scale · that · Σ|k|``; and (VNNI, d_v a multiple of 64) the weights
of each block of 64 keys rounded to int16 per row, within ``1/65534`` of the block's largest,
which moves the output by at most ``64 / 65534 · max|v|`` (the blocks' largest weights sum to
at most the row's sum). The quantization error of the cache itself
is checked separately, against its bound ``max|row| / 254`` per element.
"""

from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from native import assert_level_ok, assert_script_ok, other_levels
from qkv import MultiHeadAttention
from qkv._validate import check_qkv
from qkv.cache import KVCache, dequantize_rows, quantize_rows
from qkv.kernels._native import decode_ops, native_status
from qkv.kernels.decode import as_unpacked, decode_attention, run_decode
from test_decode import check_decode, decode_case

# --- the row format ----------------------------------------------------------------------


@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 70)),
    scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e4, 1e30]),
    seed=st.integers(0, 2**16),
)
def test_quantized_rows_are_within_half_a_step(shape, scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * scale
    x[0, 0] = 0.0  # a row of zeros: scale 0, values 0
    packed = quantize_rows(x)
    assert packed.dtype == torch.int8 and packed.shape == (*shape[:-1], shape[-1] + 4)
    back = dequantize_rows(packed)
    assert back.dtype == torch.float32 and back.shape == x.shape
    step = x.abs().amax(-1, keepdim=True) / 127
    # half a step, plus the fp32 roundings of x / scale and of scale · value
    assert ((back - x).abs() <= step * (0.5 + 1e-5) + 1e-37).all()
    assert (back[0, 0] == 0).all() and (packed[0, 0] == 0).all()
    values = packed[..., :-4]
    assert int(values.abs().max()) <= 127
    # the largest element of each nonzero row is stored as ±127
    assert (values.abs().amax(-1)[x.abs().amax(-1) > 0] == 127).all()


def test_row_format_errors_name_the_argument():
    with pytest.raises(TypeError, match="x must be a floating tensor"):
        quantize_rows(torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="packed must be int8 rows"):
        dequantize_rows(torch.zeros(2, 3))
    assert quantize_rows(torch.zeros(2, 0, 8)).shape == (2, 0, 12)


# --- the decode kernel over int8 rows ------------------------------------------------------

needs_kernel = pytest.mark.skipif(decode_ops() is None, reason=f"kernel {native_status()}")


def _packed_view(x, layout, g):
    """Packed int8 rows of ``x (B, h_kv, Tk, d)``, laid out as a cache may hold them."""
    if layout == "slice":  # a preallocated buffer filled up to Tk
        more = torch.randn(*x.shape[:2], 37, x.shape[3], generator=g)
        return quantize_rows(torch.cat([x.float(), more], 2))[:, :, : x.shape[2]]
    if layout == "tokens-first":  # (B, T, h_kv, d + 4) seen as (B, h_kv, T, d + 4)
        return quantize_rows(x.float().transpose(1, 2).contiguous()).transpose(1, 2)
    return quantize_rows(x)


def _check(q, k8, v8, out, lse, **kw):
    """The kernel's out and lse against fp64 attention over the dequantized rows."""
    check_decode(q, dequantize_rows(k8), dequantize_rows(v8), out, lse, int16=True, **kw)


@st.composite
def int8_case(draw):
    """decode_case's shapes, masks and options, its keys and values stored as int8 rows."""
    q, k, v, kw, threads, splits = draw(decode_case())
    layout = draw(st.sampled_from(["contiguous", "slice", "tokens-first"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    return q, _packed_view(k, layout, g), _packed_view(v, layout, g), kw, threads, splits


@needs_kernel
@settings(max_examples=120)
@given(int8_case())
def test_decode_over_int8_rows_matches_fp64(case):
    q, k8, v8, kw, threads, splits = case
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if splits:  # the keys cut into that many pieces, merged by log-sum-exp
            shape = check_qkv(q, as_unpacked(k8, q), as_unpacked(v8, q))
            out, lse = run_decode(q, k8, v8, shape, **{"mask": None, **kw}, splits=splits)
        else:
            out, lse = decode_attention(q, k8, v8, **kw, return_lse=True)
    finally:
        torch.set_num_threads(before)
    _check(q, k8, v8, out, lse, **kw)


@needs_kernel
@pytest.mark.parametrize("splits", [0, 3, 7])
def test_pieces_merge_over_a_long_int8_cache(splits):
    """More than 100k keys, cut into pieces merged by log-sum-exp."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 2, 64, generator=g)
    k8, v8 = (quantize_rows(torch.randn(1, 2, 100_003, 64, generator=g)) for _ in range(2))
    out, lse = decode_ops().fwd(q, k8, v8, None, 0.125, True, -1, splits, None, None)
    _check(q, k8, v8, out, lse, causal=True, scale=0.125)


@needs_kernel
@pytest.mark.parametrize("G, Tq", [(1, 1), (4, 1), (4, 4), (4, 8), (4, 16), (2, 16)])
@pytest.mark.parametrize("gathered", [False, True])
def test_int8_rows_for_1_to_64_query_rows(G, Tq, gathered):
    """1 to 64 query rows per kv head: read as stored up to 31 (in blocks of up to 4 rows),
    from 32 (beams, drafts) runs of keys widened to fp32 once for all rows; the answers are
    those of the dequantized rows all the same, across blocks and runs (Tk not a multiple of
    either), a window, a mask and beams' gathered rows."""
    g = torch.Generator().manual_seed(10 + G + Tq)
    B, h_kv, Tk, d = 2, 2, 300, 64
    q = torch.randn(B, h_kv * G, Tq, d, generator=g)
    k8, v8 = (quantize_rows(torch.randn(B + 1, h_kv, Tk, d, generator=g)) for _ in range(2))
    mask = torch.rand(Tq, Tk, generator=g) > 0.2
    if gathered:
        rows = torch.randint(0, B + 1, (B, Tk), generator=g)
        out, lse = decode_ops().fwd(q, k8, v8, None, 0.125, True, 100, 2, rows, None)
        pos = torch.arange(Tk)
        k8 = torch.stack([k8[rows[b], :, pos].transpose(0, 1) for b in range(B)])
        v8 = torch.stack([v8[rows[b], :, pos].transpose(0, 1) for b in range(B)])
        _check(q, k8, v8, out, lse, causal=True, window=100, scale=0.125)
    else:
        k8, v8 = k8[:B], v8[:B]
        out, lse = decode_attention(q, k8, v8, mask=mask, return_lse=True)
        _check(q, k8, v8, out, lse, mask=mask)


@needs_kernel
def test_beams_read_in_place_from_int8_rows():
    """rows (beams never reordered) and kv_batch (sentences gone) index int8 rows as fp32."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, 8, 2, 64, generator=g)
    k8, v8 = (quantize_rows(torch.randn(4, 2, 90, 64, generator=g)) for _ in range(2))
    rows = torch.randint(0, 4, (3, 95), generator=g)
    out, lse = decode_ops().fwd(q, k8, v8, None, 0.125, True, -1, 2, rows, None)
    pick = rows[:, :90]  # (3, 90): batch row of each position
    kg = torch.stack([k8[pick[b], :, torch.arange(90)].transpose(0, 1) for b in range(3)])
    vg = torch.stack([v8[pick[b], :, torch.arange(90)].transpose(0, 1) for b in range(3)])
    _check(q, kg, vg, out, lse, causal=True, scale=0.125)
    batch = torch.tensor([3, 0, 2])
    out, lse = decode_ops().fwd(q, k8, v8, None, 0.125, False, -1, 0, None, batch)
    _check(q, k8[batch], v8[batch], out, lse, scale=0.125)


@needs_kernel
def test_int8_call_errors_name_the_argument():
    q = torch.randn(1, 2, 1, 8)
    k8 = quantize_rows(torch.randn(1, 2, 5, 8))
    with pytest.raises(TypeError, match="k and v must both be int8 rows"):
        decode_attention(q, k8, torch.randn(1, 2, 5, 8))
    with pytest.raises(ValueError, match="d_k"):  # rows of another head size
        decode_attention(q, quantize_rows(torch.randn(1, 2, 5, 6)), k8)


_LEVEL_INT8 = """
import torch
from qkv.cache import quantize_rows, dequantize_rows
from qkv.functional import attention_steps
from qkv.kernels._native import decode_ops
g = torch.Generator().manual_seed(0)
k8, v8 = (quantize_rows(torch.randn(2, 3, 301, 40, generator=g)) for _ in range(2))
for Tq in (3, 16):  # 6 and 32 query rows per kv head: read as stored, and widened runs
    q = torch.randn(2, 6, Tq, 40, generator=g)
    out, lse = decode_ops().fwd(q, k8, v8, None, 0.2, True, 50, 2, None, None)
    ref = attention_steps(q.double(), dequantize_rows(k8).double(),
                          dequantize_rows(v8).double(), causal=True, window=50, scale=0.2)
    err = (out.double() - ref.output).abs().max()
    assert err < 1e-5, err
    assert (lse.double() - ref.lse).abs()[torch.isfinite(ref.lse)].max() < 1e-5
print('ok')
"""


@needs_kernel
@pytest.mark.parametrize("level", other_levels())
def test_every_level_reads_int8_rows(level):
    assert_level_ok(_LEVEL_INT8, level)


_INT8_CASES = f"""
import os, sys
sys.path[:0] = {[str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]!r}
from qkv.kernels._native import native_status
assert os.environ["QKV_INT8_PATH"] in native_status(), native_status()
import conftest  # the suite's Hypothesis profile, as under pytest
import test_kv_int8 as t
t.test_decode_over_int8_rows_matches_fp64()
for G, Tq in ((1, 1), (4, 1), (4, 4), (2, 16)):
    for gathered in (False, True):
        t.test_int8_rows_for_1_to_64_query_rows(G, Tq, gathered)
t.test_beams_read_in_place_from_int8_rows()
print("ok")
"""


@needs_kernel
def test_int8_rows_widened_to_fp32_as_without_vnni():
    """QKV_DECODE_INT8=widen: keys and values widened to fp32 for the FMA loops, in its own
    process, over the same cases."""
    assert_script_ok(_INT8_CASES, QKV_DECODE_INT8="widen",
                     QKV_INT8_PATH="int8 K/V: widened to fp32")  # fmt: skip


# the int8 path each level takes by default (d = 64 or 128, fewer than 32 rows per kv head)
_INT8_PATHS = {"portable": "widened to fp32", "avx2": "int16 dot products (vpmaddwd)",
               "avx2_vnni": "int16 dot products (vpdpwssd, AVX-VNNI)",
               "avx512": "widened to fp32",
               "avx512_vnni": "int16 dot products (vpdpwssd, AVX512_VNNI)",
               "avx512_bf16": "int16 dot products (vpdpwssd)",
               "amx": "int16 dot products (vpdpwssd)", "neon": "widened to fp32"}  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("level", other_levels())
def test_every_level_takes_its_int8_path_and_matches_fp64(level):
    """Head sizes 64 and 128 (the int16-pair loops), the levels that are not loaded by default
    here, each forced in its own process: the avx2 level's vpmaddwd loops run on AVX-512
    machines only this way."""
    assert_script_ok(_INT8_CASES, QKV_ISA=level, QKV_INT8_PATH=f"int8 K/V: {_INT8_PATHS[level]}")


def test_bad_int8_path_setting_is_an_error():
    with pytest.raises(AssertionError, match="QKV_DECODE_INT8 must be auto, int16 or widen"):
        assert_script_ok(_INT8_CASES, QKV_DECODE_INT8="fast", QKV_INT8_PATH="")


# --- the cache ------------------------------------------------------------------------------


def test_int8_cache_stores_packed_rows_through_growth_beams_and_batch_rows():
    g = torch.Generator().manual_seed(5)
    cache = KVCache(dtype=torch.int8, capacity=2)
    written_k, written_v = [], []
    for T in (3, 1, 20):  # grows past its capacity twice
        k, v = torch.randn(2, 3, T, 8, generator=g), torch.randn(2, 3, T, 6, generator=g)
        keys, values = cache.update(k, v)
        written_k.append(k)
        written_v.append(v)
    assert cache.quantized and keys.dtype == torch.int8 and keys.shape == (2, 3, 24, 12)
    assert values.shape == (2, 3, 24, 10) and len(cache) == 24
    assert torch.equal(keys, quantize_rows(torch.cat(written_k, 2)))
    assert torch.equal(cache.values, quantize_rows(torch.cat(written_v, 2)))
    before = cache.keys.clone()
    cache.reorder(torch.tensor([1, 1, 0]))  # beams: 3 rows from 2
    assert torch.equal(cache.keys, before[[1, 1, 0]])
    k, v = torch.randn(2, 3, 1, 8, generator=g), torch.randn(2, 3, 1, 6, generator=g)
    cache.update(k, v, rows=torch.tensor([2, 0]))  # rows 2 and 0 take the new position
    assert torch.equal(cache.keys[[2, 0], :, -1:], quantize_rows(k))
    with pytest.raises(ValueError, match=r"k \(B, 3, T, 8\)"):  # the unpacked width
        cache.update(torch.randn(3, 3, 1, 9), torch.randn(3, 3, 1, 6))
    with pytest.raises(TypeError, match="floating"):
        cache.update(torch.zeros(3, 3, 1, 8, dtype=torch.int8), torch.zeros(3, 3, 1, 6))


@pytest.mark.parametrize("kind", ["self", "causal"])
def test_attention_over_an_int8_cache_equals_the_dequantized_cache(kind):
    """MultiHeadAttention with an int8 cache: the decode kernel's reading of the packed rows
    (few queries) equals attention over the widened rows (what a weights request runs)."""
    torch.manual_seed(6)
    mha = MultiHeadAttention(64, 8, n_kv_heads=2).eval()
    cache = KVCache(dtype=torch.int8)
    causal = kind == "causal"
    with torch.no_grad():
        mha(torch.randn(2, 30, 64), causal=causal, cache=cache)  # prefill: widened rows
        x = torch.randn(2, 1, 64)
        fast = mha(x, causal=causal, cache=cache)
        cache.truncate(len(cache) - 1)
        slow, _ = mha(x, causal=causal, cache=cache, need_weights=True)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
