"""Attention of one block of queries against one block of keys, forward and backward.

This is the per-block math the ring runs at every step. fp32/bf16 CPU blocks run qkv's fused
C++ flash kernel (``qkv/csrc/flash_cpu.cpp``, its ``fwd_at``/``bwd_at`` ops: the same kernel
as :func:`qkv.kernels.flash.flash_attention`, with the query rows placed at their global
offset from the keys, and the global ``lse`` passed to the backward). Elsewhere (another
device or dtype, or no compiler to build the kernel) the PyTorch-ops code of this module runs.

Shapes (``g = h // h_kv`` query heads share one key/value head)::

    q      (B, h,    Tq, d)     rows sit at global positions q_start .. q_start + Tq - 1
    k, v   (B, h_kv, Tk, d)     keys sit at global positions k_start .. k_start + Tk - 1
    out    (B, h,    Tq, d)     softmax over THIS block's keys only (zeros for a row with none)
    lse    (B, h,    Tq)        float32 log-sum-exp of the row's scaled, masked scores (-inf: none)

Which keys a query may see is a function of ``delta = k_pos - q_pos`` only (True = may
attend when ``lo <= delta <= hi``): full attention ``(-inf, inf)``, causal ``(-inf, 0]``,
causal window ``w``: ``[-(w-1), 0]``, window without causal: ``[-(w-1), w-1]``. Because the
positions are global, the same block code serves contiguous and zigzag shards.

Memory: the scores are built ``rows`` query rows at a time (``TILE_ELEMENTS`` scores per
tile), so a block never holds its full ``Tq × Tk`` score matrix. The backward is
FlashAttention-2's, from the saved global ``lse``: ``P = exp(S·scale − lse)``,
``D = rowsum(dO ∘ O)``, ``dV = Pᵀ dO``, ``dP = dO Vᵀ``, ``dS = P ∘ (dP − D)``,
``dQ = dS K · scale``, ``dK = dSᵀ Q · scale``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from qkv.kernels._native import native_ops

__all__ = ["band", "visibility", "block_forward", "block_backward", "TILE_ELEMENTS"]

TILE_ELEMENTS = 1 << 20  # scores (all heads) held at once per tile: 4 MiB in fp32
# tiles of the fused kernel (those of qkv.kernels.flash.NATIVE_BLOCK_Q/K)
FUSED_BLOCK_Q = 256
FUSED_BLOCK_K = 256
_FP32_MAX = float(torch.finfo(torch.float32).max)


def _fused_ops(q: Tensor, k: Tensor, v: Tensor, scale: float):
    """The fused kernel's ops if they can run this block (fp32/bf16 on the CPU), else None."""
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not (k.dtype == v.dtype == q.dtype) or not 0 < scale < _FP32_MAX:
        return None
    if 0 in (q.shape[-1], v.shape[-1]):
        return None
    ops = native_ops()
    return ops if ops is not None and hasattr(ops, "fwd_at") else None


def _kernel_args(Tq: int, Tk: int, q_start: int, k_start: int, causal: bool, window):
    """(causal, window, shift) for the kernel: its row i sits at key ``Tk - Tq + shift + i``."""
    shift = (q_start - k_start) - (Tk - Tq)
    return bool(causal), -1 if window is None else int(window), shift


def band(causal: bool, window: int | None) -> tuple[float, float]:
    """The allowed range ``[lo, hi]`` of ``k_pos - q_pos`` (True = may attend inside it)."""
    if window is None:
        return (-math.inf, 0.0) if causal else (-math.inf, math.inf)
    return (-(window - 1.0), 0.0) if causal else (-(window - 1.0), window - 1.0)


def visibility(q_start: int, Tq: int, k_start: int, Tk: int, lohi: tuple[float, float]) -> str:
    """``"none"``, ``"all"`` or ``"some"``: how much of a ``Tq × Tk`` block may attend.

    Over the block ``k_pos - q_pos`` takes every integer in ``[k_start - q_last, k_last - q_start]``.
    """
    if Tq == 0 or Tk == 0:
        return "none"
    lo, hi = lohi
    d_min = k_start - (q_start + Tq - 1)
    d_max = (k_start + Tk - 1) - q_start
    if d_max < lo or d_min > hi:
        return "none"
    if lo <= d_min and d_max <= hi:
        return "all"
    return "some"


def _rows_per_tile(Tq: int, Tk: int, heads: int) -> int:
    """Query rows per tile so that a tile's scores ``(B, h, rows, Tk)`` hold ~TILE_ELEMENTS."""
    return max(1, min(Tq, TILE_ELEMENTS // max(1, Tk * heads)))


def _tiles(Tq: int, Tk: int, q_start: int, k_start: int, lohi, heads: int, device):
    """Yield ``(r0, r1, c0, c1, strips)``: query rows ``r0:r1`` and the only keys ``c0:c1``
    they may see. ``strips`` lists ``(s0, s1, blocked)``: columns ``c0+s0 : c0+s1`` where
    ``blocked (r1-r0, s1-s0)`` is True for a hidden key; every other column is visible to
    every row of the tile (so masks are built only along the diagonal edges)."""
    rows = _rows_per_tile(Tq, Tk, heads)
    lo, hi = lohi
    for r0 in range(0, Tq, rows):
        r1 = min(Tq, r0 + rows)
        qa, qb = q_start + r0, q_start + r1 - 1  # first and last position of the tile
        c0 = 0 if lo == -math.inf else max(0, qa + int(lo) - k_start)
        c1 = Tk if hi == math.inf else min(Tk, qb + int(hi) - k_start + 1)
        if visibility(qa, r1 - r0, k_start + c0, c1 - c0, lohi) == "none":
            continue
        # keys visible to every row: qb + lo <= k <= qa + hi; the edges need a mask
        a = c0 if lo == -math.inf else min(max(c0, qb + int(lo) - k_start), c1)
        b = c1 if hi == math.inf else min(max(c0, qa + int(hi) - k_start + 1), c1)
        edges = [(c0, c1)] if a > b else [(c0, a), (b, c1)]
        strips = []
        for e0, e1 in edges:
            if e1 > e0:
                q_pos = torch.arange(qa, qb + 1, device=device)[:, None]  # (tq, 1)
                k_pos = torch.arange(k_start + e0, k_start + e1, device=device)[None, :]
                delta = k_pos - q_pos  # (tq, e1 - e0)
                strips.append((e0 - c0, e1 - c0, (delta < lo) | (delta > hi)))
        yield r0, r1, c0, c1, strips


def _grouped(q: Tensor, h_kv: int) -> Tensor:
    B, h, Tq, d = q.shape
    return q.view(B, h_kv, h // h_kv, Tq, d)  # (B, h_kv, g, Tq, d)


def _scores(qt: Tensor, k: Tensor, scale: float, strips) -> Tensor:
    """Scaled, masked float32 scores of a tile ``qt (B, h_kv, g, tq, d)``: ``(B, h_kv, g, tq, tk)``."""
    B, h_kv, g, tq, d = qt.shape
    s = (qt.reshape(B, h_kv, g * tq, d) * scale) @ k.transpose(-2, -1)  # (B, h_kv, g·tq, tk)
    s = s.view(B, h_kv, g, tq, -1).float()
    for s0, s1, blocked in strips:
        s[..., s0:s1].masked_fill_(blocked, float("-inf"))
    return s


def block_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    q_start: int = 0,
    k_start: int = 0,
    causal: bool = False,
    window: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of ``q`` against this block's ``k, v`` only: ``(out, lse)`` (see module doc).

    >>> q = k = v = torch.randn(1, 2, 5, 4)
    >>> out, lse = block_forward(q, k, v, scale=0.5, causal=True)
    >>> out.shape, lse.shape
    (torch.Size([1, 2, 5, 4]), torch.Size([1, 2, 5]))
    """
    B, h, Tq, d = q.shape
    h_kv, Tk = k.shape[1], k.shape[2]
    g = h // h_kv
    ops = _fused_ops(q, k, v, scale)
    if ops is not None:
        c, w, shift = _kernel_args(Tq, Tk, q_start, k_start, causal, window)
        out4, lse4 = ops.fwd_at(
            q.reshape(B * h_kv, g, Tq, d).contiguous(),  # (B·h_kv, g, Tq, d)
            k.reshape(B * h_kv, Tk, d).contiguous(),  # (B·h_kv, Tk, d)
            v.reshape(B * h_kv, Tk, -1).contiguous(),
            scale, c, w, FUSED_BLOCK_Q, FUSED_BLOCK_K, shift,
        )  # fmt: skip
        return out4.view(B, h, Tq, -1), lse4.view(B, h, Tq)
    out = q.new_zeros(B, h_kv, g, Tq, v.shape[-1])
    lse = torch.full((B, h_kv, g, Tq), float("-inf"), device=q.device)
    lohi = band(causal, window)
    qg = _grouped(q, h_kv)
    for r0, r1, c0, c1, strips in _tiles(Tq, Tk, q_start, k_start, lohi, B * h, q.device):
        s = _scores(qg[:, :, :, r0:r1], k[:, :, c0:c1], scale, strips)  # (B, h_kv, g, tq, tk)
        m = s.amax(dim=-1, keepdim=True)
        m = m.masked_fill(m == float("-inf"), 0.0)  # a row with no key: any finite shift
        p = s.sub_(m).exp_()  # in place: the tile is the big tensor
        denom = p.sum(dim=-1, keepdim=True)  # (B, h_kv, g, tq, 1)
        pv = p.to(v.dtype).view(B, h_kv, -1, c1 - c0) @ v[:, :, c0:c1]  # (B, h_kv, g·tq, d)
        pv = pv.view(B, h_kv, g, r1 - r0, -1)
        out[:, :, :, r0:r1] = (pv / denom.masked_fill(denom == 0, 1.0)).to(out.dtype)
        lse[:, :, :, r0:r1] = (torch.log(denom) + m).squeeze(-1)  # -inf where denom == 0
    return out.view(B, h, Tq, -1), lse.view(B, h, Tq)


def block_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    lse: Tensor,
    delta: Tensor,
    *,
    scale: float,
    q_start: int = 0,
    k_start: int = 0,
    causal: bool = False,
    window: int | None = None,
    out: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of this block's share of the attention.

    ``lse (B, h, Tq)`` is the log-sum-exp over ALL keys the queries see (the final one, not
    this block's), ``delta = rowsum(dout ∘ out) (B, h, Tq)`` with the final ``out``. Then
    this block's ``P = exp(S·scale − lse)`` are exactly its entries of the full softmax, and
    summing the returned gradients over all blocks gives the full gradients. ``out (B, h, Tq,
    d_v)``, the final output (in q's dtype), lets the fused kernel run (it computes ``delta``
    from it); without it the PyTorch-ops code runs.
    """
    B, h, Tq, d = q.shape
    h_kv, Tk = k.shape[1], k.shape[2]
    g = h // h_kv
    ops = None if out is None or out.dtype != q.dtype else _fused_ops(q, k, v, scale)
    if ops is not None:
        c, w, shift = _kernel_args(Tq, Tk, q_start, k_start, causal, window)
        dq, dk, dv = ops.bwd_at(
            q.reshape(B * h_kv, g, Tq, d).contiguous(),  # (B·h_kv, g, Tq, d)
            k.reshape(B * h_kv, Tk, d).contiguous(),  # (B·h_kv, Tk, d)
            v.reshape(B * h_kv, Tk, -1).contiguous(),
            out.reshape(B * h_kv, g, Tq, -1).contiguous(),
            dout.reshape(B * h_kv, g, Tq, -1).contiguous(),
            lse.reshape(B * h_kv, g, Tq).float().contiguous(),
            scale, c, w, FUSED_BLOCK_Q, FUSED_BLOCK_K, shift,
        )  # fmt: skip
        return dq.view(B, h, Tq, d), dk.view(B, h_kv, Tk, d), dv.view(B, h_kv, Tk, -1)
    dq = torch.zeros(B, h_kv, g, Tq, d, device=q.device, dtype=torch.float32)
    dk = torch.zeros(B, h_kv, Tk, d, device=q.device, dtype=torch.float32)
    dv = torch.zeros(B, h_kv, Tk, v.shape[-1], device=q.device, dtype=torch.float32)
    lohi = band(causal, window)
    qg, dog = _grouped(q, h_kv), _grouped(dout, h_kv)
    # a row that sees no key anywhere has lse = -inf; +inf makes its P = exp(s - inf) = 0
    lse_g = lse.masked_fill(lse == float("-inf"), float("inf")).view(B, h_kv, g, Tq, 1)
    delta_g = delta.float().view(B, h_kv, g, Tq, 1)
    for r0, r1, c0, c1, strips in _tiles(Tq, Tk, q_start, k_start, lohi, B * h, q.device):
        kt, vt = k[:, :, c0:c1].float(), v[:, :, c0:c1].float()  # (B, h_kv, tk, d)
        qt, dot = qg[:, :, :, r0:r1], dog[:, :, :, r0:r1]  # (B, h_kv, g, tq, d)
        p = _scores(qt, kt, scale, strips).sub_(lse_g[:, :, :, r0:r1]).exp_()  # (B,h_kv,g,tq,tk)
        rows_flat = g * (r1 - r0)
        dot_flat = dot.reshape(B, h_kv, rows_flat, -1).float()  # (B, h_kv, g·tq, d)
        p_flat = p.view(B, h_kv, rows_flat, c1 - c0)
        dv[:, :, c0:c1] += p_flat.transpose(-2, -1) @ dot_flat  # (B, h_kv, tk, d): sums g heads
        dp = (dot_flat @ vt.transpose(-2, -1)).view_as(p)  # (B, h_kv, g, tq, tk)
        ds = dp.sub_(delta_g[:, :, :, r0:r1]).mul_(p).view(B, h_kv, rows_flat, c1 - c0)
        dq[:, :, :, r0:r1] = (ds @ kt).view(B, h_kv, g, r1 - r0, d) * scale
        dk[:, :, c0:c1] += (
            ds.transpose(-2, -1) @ qt.reshape(B, h_kv, rows_flat, d).float()
        ) * scale
    return dq.view(B, h, Tq, d), dk, dv
