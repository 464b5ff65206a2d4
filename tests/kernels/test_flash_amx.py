"""qkv's own AMX tile forward (csrc/flash_amx.cpp) against fp64 math and against oneDNN's
brgemm path on the same tiles: shapes that end mid-tile, mid-block and mid-item, GQA, causal,
windows, ring attention's offset, block masks (whole 32-row, 32-key chunks), rows whose max
climbs past the lazy rescaling's margin, and the NaN/inf rule. Runs on the amx level only (the tiles exist nowhere else)."""

from __future__ import annotations

import math
import os
from contextlib import contextmanager

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from qkv import block_mask as masks
from qkv.kernels._native import native_level, native_ops
from qkv.kernels.flash import flash_attention

pytestmark = pytest.mark.skipif(
    native_level() != "amx" or os.environ.get("ONEDNN_MAX_CPU_ISA") is not None,
    reason="the AMX tile kernel runs on the amx level only",
)


@contextmanager
def bf16_path(name: str):
    old = os.environ.get("QKV_BF16_MATMUL")
    os.environ["QKV_BF16_MATMUL"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("QKV_BF16_MATMUL")
        else:
            os.environ["QKV_BF16_MATMUL"] = old


def fwd(q, k, v, path: str, **kw):
    """The native forward op itself (no dispatcher, no Python fallback for small calls)."""
    B, h, Tq, d = q.shape
    h_kv, Tk, dv = k.shape[1], k.shape[2], v.shape[-1]
    G = h // h_kv
    qq = q.reshape(B * h_kv, G, Tq, d).contiguous()
    kk, vv = k.reshape(B * h_kv, Tk, d).contiguous(), v.reshape(B * h_kv, Tk, dv).contiguous()
    scale = kw.get("scale") or 1 / math.sqrt(d)
    window = kw.get("window") or -1
    with bf16_path(path):
        if "shift" in kw:
            out, lse = torch.ops.qkv_flash.fwd_at(qq, kk, vv, scale, kw.get("causal", False),
                                                  window, 256, 256, kw["shift"])  # fmt: skip
        else:
            out, lse = torch.ops.qkv_flash.fwd(qq, kk, vv, None, scale, kw.get("causal", False),
                                               window, 256, 256)  # fmt: skip
    return out.reshape(B, h, Tq, dv), lse.reshape(B, h, Tq)


def reference(q, k, v, *, causal=False, window=None, scale=None, shift=0):
    """fp64 softmax(q kᵀ · scale) v with qkv's structure (query i at key Tk - Tq + shift + i)."""
    q, k, v = q.double(), k.double(), v.double()
    Tq, Tk = q.shape[-2], k.shape[-2]
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = q @ k.transpose(-1, -2) * (scale or 1 / math.sqrt(q.shape[-1]))
    pos = torch.arange(Tq)[:, None] + Tk - Tq + shift
    j = torch.arange(Tk)[None, :]
    ok = torch.ones(Tq, Tk, dtype=torch.bool)
    if causal:
        ok &= j <= pos
    if window:
        ok &= (j > pos - window) & (j < pos + window) if not causal else j > pos - window
    s = s.masked_fill(~ok, -math.inf)
    lse = torch.logsumexp(s, -1)
    w = torch.softmax(s, -1).nan_to_num(0.0)
    return w @ v, lse


def check(q, k, v, **kw):
    out, lse = fwd(q, k, v, "amx", **kw)
    old, old_lse = fwd(q, k, v, "onednn", **kw)
    ref, ref_lse = reference(q, k, v, **kw)
    vmax = max(1.0, v.abs().max().item())
    # p and the output are rounded to bf16 on both paths: the same bound, well inside it
    err = (out.double() - ref).abs().max().item()
    err_old = (old.double() - ref).abs().max().item()
    assert err <= 2e-2 * vmax, err
    assert err <= 2 * err_old + 4e-3 * vmax, (err, err_old)
    seen = ref_lse > -math.inf  # rows that see no key: lse -inf, output 0
    assert torch.equal(lse.isneginf(), ~seen)
    assert (out[~seen] == 0).all()
    torch.testing.assert_close(lse[seen].double(), ref_lse[seen], atol=2e-4, rtol=1e-4)


def bf16(*shape, scale=1.0, generator=None):
    return (torch.randn(*shape, generator=generator) * scale).bfloat16()


@pytest.mark.parametrize(
    "Tq,Tk,d,dv,G",
    [(1, 1, 32, 32, 1), (31, 257, 64, 64, 1), (33, 300, 128, 128, 2), (257, 513, 64, 96, 1),
     (300, 40, 32, 64, 3), (600, 600, 128, 64, 1)],
)  # fmt: skip
@pytest.mark.parametrize("causal", [False, True])
def test_tile_forward_equals_fp64_and_the_onednn_path(Tq, Tk, d, dv, G, causal):
    g = torch.Generator().manual_seed(Tq * 7 + Tk)
    q = bf16(1, 2 * G, Tq, d, scale=2.0, generator=g)
    k, v = bf16(1, 2, Tk, d, generator=g), bf16(1, 2, Tk, dv, generator=g)
    check(q, k, v, causal=causal)


@settings(max_examples=20, deadline=None)
@given(
    Tq=st.integers(1, 300), Tk=st.integers(1, 700), d=st.sampled_from([32, 64, 96, 128]),
    dv=st.sampled_from([32, 64, 128]), G=st.integers(1, 3), causal=st.booleans(),
    window=st.none() | st.integers(1, 400), shift=st.none() | st.integers(-50, 50),
    seed=st.integers(0, 2**16),
)  # fmt: skip
def test_tile_forward_random_shapes_windows_and_ring_offsets(Tq, Tk, d, dv, G, causal, window,
                                                             shift, seed):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    q = bf16(1, G, Tq, d, scale=1.5, generator=g)
    k, v = bf16(1, 1, Tk, d, generator=g), bf16(1, 1, Tk, dv, generator=g)
    kw = {"causal": causal, "window": window}
    if shift is not None:
        if window is not None:  # ring blocks have no window
            return
        kw["shift"] = shift
    check(q, k, v, **kw)


def test_rows_whose_max_climbs_block_after_block_are_rescaled():
    """Scores that rise along the keys by more than the lazy margin (2^8 in p) from one key
    block to the next: every block raises the row's max, and O must be rescaled each time."""
    T, d = 1024, 64
    q = torch.ones(1, 1, 64, d).bfloat16()
    k = (torch.arange(T, dtype=torch.float32)[:, None] / 32).expand(T, d).reshape(1, 1, T, d)
    v = bf16(1, 1, T, d)
    check(q, k.bfloat16(), v, scale=0.5)
    check(q, k.flip(2).bfloat16(), v, scale=0.5)  # falling: the first block holds the max


def test_nan_and_inf_follow_the_rule():
    """A NaN in a key a row sees makes that row NaN (and its lse); +inf scores take the row
    code; rows that see no key give zeros even where V holds NaN (public entry point)."""
    T, d = 300, 64
    q, k, v = bf16(1, 1, T, d), bf16(1, 1, T, d), bf16(1, 1, T, d)
    k[0, 0, 200, 3] = float("nan")
    with bf16_path("amx"):
        out = flash_attention(q, k, v, causal=True)
    with bf16_path("onednn"):
        old = flash_attention(q, k, v, causal=True)
    assert torch.equal(out.isnan(), old.isnan())
    assert out[0, 0, :200].isfinite().all() and out[0, 0, 200:].isnan().all()
    out, lse = fwd(q, k, v, "amx", causal=True)
    assert lse[0, 0, 200:].isnan().all() and lse[0, 0, :200].isfinite().all()
    q2 = q.clone()
    q2[0, 0, 10] = float("inf")  # +inf and -inf scores in row 10
    a, b = fwd(q2, k, v, "amx")[0], fwd(q2, k, v, "onednn")[0]
    assert torch.equal(a.isnan(), b.isnan())


def test_every_path_names_itself():
    with bf16_path("amx"):
        assert native_ops().bf16_path().startswith("amx (qkv tile kernel")
    with bf16_path("onednn"):
        assert native_ops().bf16_path() == "amx (oneDNN brgemm, AMX tiles)"


def masked_reference(q, k, v, dense):
    """fp64 softmax over the keys dense (True: may attend) allows; rows with none give 0."""
    q, k, v = q.double(), k.double(), v.double()
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~dense, -math.inf)
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(["document", "prefix", "sink_window", "mask_fn"]),
    T=st.integers(1, 700), bs=st.sampled_from([(32, 32), (64, 64), (128, 128), (32, 96)]),
    d=st.sampled_from([32, 64]), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_block_masks_on_tiles_equal_fp64_and_the_onednn_path(kind, T, bs, d, seed):
    """Block masks whose blocks are whole chunks of 32 rows and 32 keys run on the tiles (a
    kernel key block of 256 spans several mask blocks: empty, full and partial ones, partial
    rows read as spans or as bytes); empty blocks skipped, rows that see no key give 0."""
    g = torch.Generator().manual_seed(seed)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    if kind == "document":
        ids = torch.randint(0, 5, (T,), generator=g).sort().values
        bm = masks.document_mask(ids, causal=True, block_size=bs)
        dense = (ids[:, None] == ids[None, :]) & (j <= i)
    elif kind == "prefix":
        L = int(torch.randint(0, T + 1, (), generator=g))
        bm = masks.prefix_lm_mask(L, T, block_size=bs)
        dense = (j <= i) | (j < L)
    elif kind == "sink_window":
        bm = masks.sliding_window_mask(T, 100, sinks=4, block_size=bs)
        dense = (j <= i) & ((i - j < 100) | (j < 4))
    else:  # bytes, not spans: two runs per row
        bm = masks.create_block_mask(lambda b, h, q, kv: (kv <= q) & ((q - kv) % 7 != 3),
                                     None, None, T, T, block_size=bs)  # fmt: skip
        dense = (j <= i) & ((i - j) % 7 != 3)
    q = bf16(1, 2, T, d, scale=1.5, generator=g)
    k, v = bf16(1, 1, T, d, generator=g), bf16(1, 1, T, d, generator=g)
    with bf16_path("amx"):
        out, lse = flash_attention(q, k, v, mask=bm, return_lse=True)
    with bf16_path("onednn"):
        old = flash_attention(q, k, v, mask=bm)
    ref = masked_reference(q, k, v, dense)
    err = (out.double() - ref).abs().max().item()
    err_old = (old.double() - ref).abs().max().item()
    assert err <= 2e-2 and err <= 2 * err_old + 4e-3, (err, err_old)
    seen = dense.any(-1)
    assert torch.equal(lse[0, :].isneginf(), ~seen.expand(2, T))
    assert (out[0, :, ~seen] == 0).all()
