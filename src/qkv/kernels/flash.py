"""Tiled ("flash") attention: online softmax, O(T) memory, block skipping.

Two kernels behind one function. fp16 inputs run in fp32 (fp16 cannot hold ``q·kᵀ`` of
moderate inputs, nor the backward's ``dO·vᵀ``, and CPU fp16 matmuls ran ~17× slower than the
fp32 fused kernel: T=1024, h=8, d=64, causal, 1 thread). fp32/bf16 CPU calls run the fused
C++ kernel (``qkv/csrc/flash_cpu.cpp``, loaded by :mod:`qkv.kernels._native`;
:func:`fused_kernel_rejects` says when it does not apply) with every option: causal/window
structure, bool masks, :class:`qkv.block_mask.BlockMask` (empty blocks skipped, full ones
unmasked), biases (and their gradient), ALiBi slopes, relative-position tables and
soft-capping, applied per score row. All other calls (fp64, no compiler) run the
PyTorch-ops kernel of this module, described below, with ALiBi, relative tables and block
masks expanded to a dense bias/mask first.

FlashAttention's algorithm (Dao et al. 2022; backward of FlashAttention-2), written with block
matmuls. For each query block the keys are visited in blocks, keeping per row a running
maximum ``m`` and sum ``l`` of ``exp(s - m)``::

    s     = q_blk k_blkᵀ · scale  (→ softcap → + bias → mask)      (N, G·bq, bk)
    m'    = max(m, rowmax(s));   p = exp(s - m');   α = exp(m - m')
    l     = α·l + rowsum(p);     acc = α·acc + p v_blk
    out   = acc / l;             lse = m + log(l)                   (never Tq×Tk in memory)

fp32/fp64 (``_forward``) run exactly this, each pass over a score block in place, on blocks
of a few heads sized to stay in L2 (``TILE_ELEMENTS``); only the key blocks on a causal/window
edge are masked. bf16 (``_forward_low``) keep ``(m, l)`` as the log-sum-exp and ``acc``
normalised, so each block is one fused ``torch.softmax`` on the bf16 scores (fp32 inside):
``lse' = logaddexp(lse, lse_blk)``, ``acc = e^(lse - lse')·acc + e^(lse_blk - lse')·(p v)``.
Speed vs PyTorch's SDPA: ``bench/flash_vs_sdpa.py`` and README ``## Speed (issue 3)``.

Backward recomputes ``p = exp(s - lse)`` block by block from the saved log-sum-exp:
``D = rowsum(dO∘O)``, ``dV += pᵀ dO``, ``dP = dO vᵀ``, ``dS = p∘(dP − D)``, ``dQ += dS k``,
``dK += dSᵀ q``. Key blocks that ``causal``/``window`` make empty are never visited, so a
sliding window costs O(T·w). Grouped-query heads fold the ``G`` query heads of one kv head into
the rows of one matmul, so K/V are never repeated in memory.

bf16: matmuls run in the input dtype (fp32 accumulation inside the matmul), the softmax
statistics, ``acc`` and the gradients accumulate in fp32; the scores ``q kᵀ`` and the block
softmax are rounded to the input dtype (a pure-PyTorch CPU matmul cannot return fp32 from
bf16 inputs), so the bf16 forward error is up to ~3× PyTorch's fused kernel's (gradients:
about equal; both bounded in tests/kernels/test_flash.py).

Shapes: as :func:`qkv.functional.scaled_dot_product_attention`; the mask is bool, **True = may
attend**. Internal layout: see :mod:`qkv.kernels._blocks`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv._validate import (
    AttentionShape,
    check_bias,
    check_block_mask,
    check_mask,
    check_options,
    check_per_head,
    check_qkv,
)
from qkv.block_mask import BlockMask
from qkv.kernels._blocks import (
    Structure,
    block,
    from_5d_grad,
    reduce_to,
    to_5d,
    to_internal,
    unit_key_stride,
)
from qkv.kernels._native import native_ops, native_status
from qkv.kernels._settings import check_bf16_matmul
from qkv.kernels.reference import dense_attention

__all__ = ["flash_attention", "fused_kernel_rejects", "run_flash", "BLOCK_Q", "BLOCK_K"]

# Measured on this repository's 2-core Xeon (AMX) machine, T=1024-4096, h=8, d=64, 1 thread
# (bench/flash_vs_sdpa.py); see README.
BLOCK_Q = 256
BLOCK_K = 1024
BLOCK_K_LOW = 512  # bf16: the fused-softmax path (_forward_low) prefers smaller blocks
BLOCK_Q_WINDOW = 64  # with a window, small query blocks waste less of each key block
# The fused C++ kernel (qkv/csrc/flash_cpu.cpp): tiles measured best for fwd and fwd+bwd,
# fp32 and bf16, T=1024-4096 (bench/flash_vs_sdpa.py)
NATIVE_BLOCK_Q = 256
NATIVE_BLOCK_K = 256
TILE_ELEMENTS = 1 << 18  # scores per block (1 MiB fp32), see _head_chunk

_NEG_INF = float("-inf")
_EXP_FLOOR = -80.0  # see _sub_exp
_FP32_MAX = float(torch.finfo(torch.float32).max)
_CAP_LSE = 2.0**14  # |lse| from which the backward clamps exp(s - lse) at 1 (see _sub_exp)


@dataclass(frozen=True)
class _Plan:
    shape: AttentionShape
    structure: Structure
    c: float  # q is multiplied by c once: scale, or scale / softcap
    softcap: float | None
    block_q: int
    block_k: int
    dtype: torch.dtype  # of q, k, v
    native: bool  # run the fused C++ kernel (see _native_ok)
    scale: float
    block_mask: BlockMask | None = None  # fused kernel only (otherwise expanded to a mask)

    @property
    def acc_dtype(self) -> torch.dtype:
        return torch.float64 if self.dtype == torch.float64 else torch.float32


@functools.lru_cache(maxsize=64)
def _blocked(structure: Structure, qs: int, qe: int, ks: int, ke: int, dev: torch.device):
    """``~block_mask`` (True = blocked), cached: diagonal blocks recur per head chunk."""
    allowed = structure.block_mask(qs, qe, ks, ke, dev)
    return None if allowed is None else ~allowed


def _scores(
    plan: _Plan, qb: Tensor, kb: Tensor, bias5: Tensor | None, mask5: Tensor | None,
    qs: int, qe: int, ks: int, ke: int,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """Scores of one block ``(N, G·bq, bk)``, masked with -inf.

    In the input dtype unless a soft-cap or bias needs more precision (then in the
    accumulation dtype).
    Also returns ``tanh(x)`` when soft-capping (the backward needs it).
    """
    N, G, bq, bk = qb.shape[0], plan.shape.group, qe - qs, ke - ks
    s = torch.bmm(qb, kb.transpose(1, 2))  # (N, G·bq, bk)
    if plan.softcap is not None or bias5 is not None:
        s = s.to(plan.acc_dtype)
    t = None
    if plan.softcap is not None:
        t = torch.tanh(s)
        s = t * plan.softcap
    if bias5 is not None:  # a -inf bias masks its key, even where the score is NaN or +inf
        b = block(bias5, qs, qe, ks, ke)
        s.view(-1, plan.shape.h_kv, G, bq, bk).add_(b).masked_fill_(b == _NEG_INF, _NEG_INF)
    blocked = _blocked(plan.structure, qs, qe, ks, ke, s.device)  # (bq, bk) or None
    if blocked is not None:
        s.view(N, G, bq, bk).masked_fill_(blocked, _NEG_INF)
    if mask5 is not None:
        s.view(-1, plan.shape.h_kv, G, bq, bk).masked_fill_(~block(mask5, qs, qe, ks, ke), _NEG_INF)
    return s, t


def _sub_exp(
    s: Tensor, shift: Tensor, acc_dtype: torch.dtype, floor: bool, cap: bool = False
) -> Tensor:
    """``exp(s - shift)`` in ``acc_dtype``, in place when ``s`` has that dtype.

    ``cap``: clamp the exponent at 0 (the backward, where ``shift`` is the row's log-sum-exp
    and ``p <= 1`` in exact arithmetic; with logits of ~1e9 the rounding of the saved lse
    alone would push ``exp`` past fp32's range).

    ``floor``: first clamp at -80, for blocks with masked (-inf) scores. This is for speed,
    not math: PyTorch's vectorised CPU ``exp`` takes a ~10-40× slower path for inputs that
    underflow (measured 48 µs vs 489 µs with -inf, 1.9 ms with -200, 256K floats, 1 core).
    ``e^-80 ≈ 2e-35`` is zero next to the row maximum's ``e^0 = 1``; rows with no visible
    key are zeroed by the callers. Unmasked blocks skip the extra pass. The clamped
    entries' weights are then set to 0, as their ``exp`` would round to (far enough below):
    a clamped weight kept at ``e^-80`` would turn an inf value there into inf, not the
    ``0 · inf = NaN`` of the rule (qkv._nonfinite).
    Converting first: mixed-dtype ops are slow on CPU.
    """
    s = s.to(acc_dtype).sub_(shift)
    low = s < _EXP_FLOOR if floor else None
    if floor or cap:
        s.clamp_(min=_EXP_FLOOR if floor else None, max=0.0 if cap else None)
    s = s.exp_()
    return s if low is None else s.masked_fill_(low, 0.0)


def _head_chunk(plan: _Plan, n_heads: int, rows: int, cols: int, masked: bool) -> int:
    """How many of the ``N`` kv heads one block covers, so a score block stays ~L2-sized.

    The elementwise passes over the scores (max, sub, exp, sum) run ~2× faster on a block
    that stays in the 2 MiB L2 than on one that spills (measured, 1 core). A mask/bias is
    indexed over all heads at once, so it keeps whole blocks.
    """
    if masked:
        return n_heads
    return max(1, min(n_heads, TILE_ELEMENTS // max(1, rows * cols)))


def _forward(
    plan: _Plan, q4: Tensor, k3: Tensor, v3: Tensor, bias5: Tensor | None, mask5: Tensor | None
) -> tuple[Tensor, Tensor]:
    """``q4 (N, G, Tq, d)`` pre-multiplied by ``plan.c`` → out ``(N, G, Tq, d_v)``, lse ``(N, G, Tq)``.

    fp32/fp64 (bf16/fp16: :func:`_forward_low`). The classic online softmax, every pass over
    a score block in place (measured ~1.3× faster than one fused softmax per block)::

        m' = max(m, rowmax(s));  p = exp(s - m');  α = exp(m - m')
        l  = α·l + rowsum(p);    acc = α·acc + p v;     finally out = acc / l, lse = m + log l
    """
    N, G, Tq, d = q4.shape
    d_v = v3.shape[-1]
    acc_dtype, dev = plan.acc_dtype, q4.device
    out = torch.zeros(N, G, Tq, d_v, dtype=q4.dtype, device=dev)
    lse_all = torch.full((N, G, Tq), _NEG_INF, dtype=acc_dtype, device=dev)
    masked = bias5 is not None or mask5 is not None
    for qs in range(0, Tq, plan.block_q):
        qe = min(qs + plan.block_q, Tq)
        lo, hi = plan.structure.key_range(qs, qe)
        if hi <= lo:
            continue  # no visible key: zeros, lse = -inf
        hc = _head_chunk(plan, N, G * (qe - qs), min(plan.block_k, hi - lo), masked)
        for n0 in range(0, N, hc):
            n1 = min(n0 + hc, N)
            n, rows = n1 - n0, G * (qe - qs)
            qb = q4[n0:n1, :, qs:qe].reshape(n, rows, d)  # (n, G·bq, d)
            m = l = acc = None  # running max, sum (n, G·bq, 1) and output (n, G·bq, d_v)
            for ks, ke in plan.structure.key_blocks(qs, qe, plan.block_k):
                vb = v3[n0:n1, ks:ke]
                s, _ = _scores(plan, qb, k3[n0:n1, ks:ke], bias5, mask5, qs, qe, ks, ke)
                m_blk = s.amax(dim=-1, keepdim=True)  # (n, G·bq, 1)
                m_new = m_blk if m is None else torch.maximum(m, m_blk)
                floor = masked or plan.structure.block_mask(qs, qe, ks, ke, dev) is not None
                # a row with no visible key yet has m = -inf: shift by 0 (its p is ~0); also
                # unmasked, where an inf in q or k makes a row's scores all -inf
                shift = m_new.masked_fill(m_new == _NEG_INF, 0.0)
                p = _sub_exp(s, shift, acc_dtype, floor)  # (n, G·bq, bk), in place for fp32
                if m is None:  # first key block: nothing to rescale
                    l = p.sum(dim=-1, keepdim=True)
                    acc = torch.bmm(p, vb)
                else:
                    alpha = (m - shift).exp_()  # (n, G·bq, 1)
                    l.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
                    acc.mul_(alpha).baddbmm_(p, vb)  # acc += p v without a temporary
                m = m_new
            acc.div_(l).masked_fill_(m == _NEG_INF, 0.0)  # rows with no visible key → 0
            out[n0:n1, :, qs:qe] = acc.view(n, G, -1, d_v)
            lse_all[n0:n1, :, qs:qe] = (m + l.log()).view(n, G, -1)  # -inf for an empty row
    return out, lse_all


def _block_softmax(s: Tensor, acc_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Softmax of a score block and its log-sum-exp: ``(p (N, rows, bk), lse_blk (N, rows))``.

    One fused ``torch.softmax`` instead of sub/exp/sum passes; the block's log-sum-exp comes
    from the row maxima: ``max(p) = exp(m - lse)``, so ``lse = m - log max(p)``.
    Rows with no visible key (all ``-inf``) get ``p = 0`` and ``lse = -inf``.
    """
    m = s.amax(dim=-1)  # (N, rows)
    p = torch.softmax(s, dim=-1)  # same dtype as s
    empty = m == _NEG_INF
    if bool(empty.any()):
        p.masked_fill_(empty.unsqueeze(-1), 0.0)  # softmax of an all -inf row is NaN
    p_max = p.amax(dim=-1).to(acc_dtype)
    lse = (m.to(acc_dtype) - p_max.log()).masked_fill_(empty, _NEG_INF)
    return p, lse


def _forward_low(
    plan: _Plan, q4: Tensor, k3: Tensor, v3: Tensor, bias5: Tensor | None, mask5: Tensor | None
) -> tuple[Tensor, Tensor]:
    """:func:`_forward` for bf16: one fused ``torch.softmax`` per block on the low-precision
    scores (it computes in fp32 inside), fewer passes than converting the block to fp32
    first (measured 0.30× vs 0.25× SDPA, bf16 causal T=1024, 1 core).

    The running (max, sum) pair of the online softmax is kept as one number per row, its
    log-sum-exp ``lse = m + log l``, and ``acc`` stays normalised (it is the output so far)::

        lse' = logaddexp(lse, lse_blk);  acc = e^(lse - lse')·acc + e^(lse_blk - lse')·(p_blk v_blk)
    """
    N, G, Tq, d = q4.shape
    d_v = v3.shape[-1]
    acc_dtype = plan.acc_dtype
    out = torch.zeros(N, G, Tq, d_v, dtype=q4.dtype, device=q4.device)
    lse_all = torch.full((N, G, Tq), _NEG_INF, dtype=acc_dtype, device=q4.device)
    for qs in range(0, Tq, plan.block_q):
        qe = min(qs + plan.block_q, Tq)
        lo, hi = plan.structure.key_range(qs, qe)
        if hi <= lo:
            continue  # no visible key: zeros, lse = -inf
        rows = G * (qe - qs)
        qb = q4[:, :, qs:qe].reshape(N, rows, d)  # (N, G·bq, d)
        acc = lse = None
        # plain blocks: cutting out the diagonal band (as _forward does) adds blocks, and
        # this path's per-block cost is in ops, not in masking (bf16 window 1.7× → 1.2×)
        for ks in range(lo, hi, plan.block_k):
            ke = min(ks + plan.block_k, hi)
            vb = v3[:, ks:ke]
            s, _ = _scores(plan, qb, k3[:, ks:ke], bias5, mask5, qs, qe, ks, ke)
            p, lse_blk = _block_softmax(s, acc_dtype)  # (N, G·bq, bk), (N, G·bq)
            pv = torch.bmm(p.to(vb.dtype), vb).to(acc_dtype)  # (N, G·bq, d_v)
            if acc is None:
                acc, lse = pv, lse_blk
                continue
            lse_new = torch.logaddexp(lse, lse_blk)
            safe = lse_new.masked_fill(lse_new == _NEG_INF, 0.0)  # rows with nothing yet
            acc.mul_((lse - safe).exp_().unsqueeze(-1))
            acc.add_(pv.mul_((lse_blk - safe).exp_().unsqueeze(-1)))
            lse = lse_new
        out[:, :, qs:qe] = acc.view(N, G, -1, d_v)
        lse_all[:, :, qs:qe] = lse.view(N, G, -1)  # -inf for an empty row
    return out, lse_all


def _backward(
    plan: _Plan, dout: Tensor, q4: Tensor, k3: Tensor, v3: Tensor, out: Tensor, lse: Tensor,
    bias5: Tensor | None, mask5: Tensor | None, need_dbias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:  # fmt: skip
    """Gradients w.r.t. the pre-scaled ``q4``, ``k3``, ``v3`` (and the 5-D bias)."""
    N, G, Tq, d = q4.shape
    acc_dtype, low = plan.acc_dtype, q4.dtype != plan.acc_dtype
    # Rows with no visible key: out is constantly 0 there, so their dO must not reach
    # dQ/dK/dV through the e^-80 floor of _sub_exp.
    dout = dout.masked_fill((lse == _NEG_INF).unsqueeze(-1), 0.0)
    D = (dout.to(acc_dtype) * out.to(acc_dtype)).sum(-1)  # (N, G, Tq)
    dq = torch.zeros(N, G, Tq, d, dtype=acc_dtype, device=q4.device)
    dk = torch.zeros(k3.shape, dtype=acc_dtype, device=q4.device)
    dv = torch.zeros(v3.shape, dtype=acc_dtype, device=q4.device)
    dbias5 = torch.zeros(bias5.shape, dtype=acc_dtype, device=q4.device) if need_dbias else None
    masked = bias5 is not None or mask5 is not None
    lse = lse.masked_fill(lse == _NEG_INF, 0.0)  # empty rows: their dO is 0 (above)
    cap = bool(lse.abs().amax() >= _CAP_LSE)  # huge logits: keep exp(s - lse) <= 1

    def add_mm(target: Tensor, x: Tensor, y: Tensor) -> None:
        """``target += x @ y``: in place for fp32 (no temporary); bf16 matmul, fp32 sum."""
        if low:
            target.add_(torch.bmm(x.to(q4.dtype), y))
        else:
            target.baddbmm_(x, y)

    for qs in range(0, Tq, plan.block_q):
        qe = min(qs + plan.block_q, Tq)
        lo, hi = plan.structure.key_range(qs, qe)
        if hi <= lo:
            continue
        rows = G * (qe - qs)
        # bf16: plain blocks, as in _forward_low (fewer, larger blocks measured faster)
        if low:
            blocks = [(ks, min(ks + plan.block_k, hi)) for ks in range(lo, hi, plan.block_k)]
        else:
            blocks = plan.structure.key_blocks(qs, qe, plan.block_k)
        hc = _head_chunk(plan, N, rows, min(plan.block_k, hi - lo), masked)
        for n0 in range(0, N, hc):
            n1 = min(n0 + hc, N)
            n = n1 - n0
            qb = q4[n0:n1, :, qs:qe].reshape(n, rows, d)  # (n, G·bq, d)
            dob = dout[n0:n1, :, qs:qe].reshape(n, rows, -1)  # (n, G·bq, d_v)
            lse_b = lse[n0:n1, :, qs:qe].reshape(n, rows, 1)
            D_b = D[n0:n1, :, qs:qe].reshape(n, rows, 1)
            dq_b = torch.zeros(n, rows, d, dtype=acc_dtype, device=q4.device)
            for ks, ke in blocks:
                kb, vb = k3[n0:n1, ks:ke], v3[n0:n1, ks:ke]
                s, t = _scores(plan, qb, kb, bias5, mask5, qs, qe, ks, ke)
                floor = masked or plan.structure.block_mask(qs, qe, ks, ke, q4.device) is not None
                p = _sub_exp(s, lse_b, acc_dtype, floor, cap)  # (n, G·bq, bk)
                add_mm(dv[n0:n1, ks:ke], p.transpose(1, 2), dob)  # dV += pᵀ dO
                ds = torch.bmm(dob, vb.transpose(1, 2)).to(acc_dtype).sub_(D_b).mul_(p)  # dS
                if dbias5 is not None:  # (masked: one chunk of all N heads)
                    ds5 = ds.view(-1, plan.shape.h_kv, G, qe - qs, ke - ks)
                    target = block(dbias5, qs, qe, ks, ke)
                    target.add_(reduce_to(ds5, target.shape))
                if t is not None:  # d(cap·tanh(x))/dx = cap·(1 - tanh²)
                    ds.mul_(t.square_().neg_().add_(1.0).mul_(plan.softcap))
                ds = ds.to(q4.dtype) if low else ds  # convert once for both matmuls
                add_mm(dq_b, ds, kb)  # dQ += dS K
                add_mm(dk[n0:n1, ks:ke], ds.transpose(1, 2), qb)  # dK += dSᵀ Q
            dq[n0:n1, :, qs:qe] = dq_b.view(n, G, -1, d)
    return dq, dk, dv, dbias5


def fused_kernel_rejects(
    device: torch.device | str, dtype: torch.dtype, *, scale: float | None = None
) -> str | None:
    """Why the fused C++ kernel cannot run a call (``None``: it runs; see :mod:`._native`).

    It covers fp32/bf16 on the CPU (fp16 converted to fp32) with every option (masks, block
    masks, biases, ALiBi, relative tables, soft-capping), so only the device, the dtype and
    the scale decide; fp64 runs on the PyTorch-ops kernel of this module.
    """
    if torch.device(device).type != "cpu":
        return f"device {torch.device(device).type}: the fused kernel is CPU-only"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {dtype}: the fused kernel takes float32/bfloat16 (and float16 as float32)"
    if scale is not None and not 0 < scale < _FP32_MAX:
        return f"scale={scale} is not a positive fp32 number"
    if native_ops() is None:
        return f"fused kernel {native_status()}"
    return None


def _native_ok(q: Tensor, k: Tensor, v: Tensor, mask, scale: float) -> bool:
    empty = 0 in (q.numel(), k.numel(), v.numel())
    reason = fused_kernel_rejects(q.device, q.dtype, scale=scale)
    # a mask broadcast over the keys (last dim 1 < Tk) is left to the PyTorch-ops kernel
    mask_ok = (
        mask is None
        or isinstance(mask, BlockMask)
        or (mask.dtype == torch.bool and mask.shape[-1] == k.shape[-2])
    )
    return reason is None and not empty and mask_ok and k.dtype == v.dtype == q.dtype


class _Empty(torch.autograd.Function):
    """The answer when a batch dim, ``h``, ``Tq`` or ``Tk`` is 0 (``AttentionShape.empty``).

    Output zeros ``(..., h, Tq, d_v)`` (with ``Tk = 0`` every query sees no key), lse
    ``-inf``; the gradients of q, k, v and bias are zeros, as the math path gives.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, shape):  # type: ignore[override]
        ctx.like = [None if t is None else (t.shape, t.dtype, t.device) for t in (q, k, v, bias)]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = q.new_zeros(*shape.batch, shape.h, shape.Tq, shape.d_v)
        lse = torch.full((*shape.batch, shape.h, shape.Tq), _NEG_INF, dtype=acc, device=q.device)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):  # type: ignore[override]
        grads = [
            None if t is None else torch.zeros(t[0], dtype=t[1], device=t[2]) for t in ctx.like
        ]
        return (*grads, None)


def _mask_view(mask: Tensor | None, shape: AttentionShape) -> Tensor | None:
    """The mask as the fused kernel reads it: a broadcast view ``(Nb, h_kv, G, Tq, Tk)``."""
    if mask is None:
        return None
    mask = unit_key_stride(mask)  # the kernel reads each row's key bytes in one run
    m5 = to_5d(mask, shape)  # (Nb|1, h_kv|1, G|1, Tq|1, Tk)
    nb = math.prod(shape.batch)
    return m5.expand(nb, shape.h_kv, shape.group, shape.Tq, shape.Tk)


def _window_arg(structure: Structure) -> int:
    return -1 if structure.window is None else structure.window


def _bias_view(bias: Tensor | None, shape: AttentionShape) -> Tensor | None:
    """The bias as the fused kernel reads it: fp32 or bf16 (read in place), a broadcast view
    ``(Nb, h_kv, G, Tq, Tk)`` with key stride 0 or 1."""
    if bias is None:
        return None
    b = bias.detach()
    if b.dtype not in (torch.float32, torch.bfloat16):
        b = b.float()
    b = unit_key_stride(b, broadcast_ok=True)
    b5 = to_5d(b, shape)  # (Nb|1, h_kv|1, G|1, Tq|1, Tk|1)
    return b5.expand(math.prod(shape.batch), shape.h_kv, shape.group, shape.Tq, shape.Tk)


def _block_views(plan: _Plan) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The block mask's index as a view ``(Nb, h_kv, G, nqb, nkb)``, its tiles and spans."""
    bm, shape = plan.block_mask, plan.shape
    if bm is None:
        return None, None, None
    idx = bm.index  # (B|1, H|1, nqb, nkb), B = prod(batch)
    idx = idx.unsqueeze(2) if idx.shape[1] == 1 else idx.unflatten(1, (shape.h_kv, shape.group))
    nb = math.prod(shape.batch)
    return idx.expand(nb, shape.h_kv, shape.group, *idx.shape[-2:]), bm.tiles, bm.spans


def _per_head(t: Tensor | None, shape: AttentionShape) -> Tensor | None:
    """ALiBi slopes ``(h,)`` → ``(h_kv, G)``; a relative table ``(h, L)`` → ``(h_kv, G, L)``."""
    if t is None:
        return None
    return t.detach().float().contiguous().view(shape.h_kv, shape.group, *t.shape[1:])


class _FlashFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, mask, alibi, rel, plan):  # type: ignore[override]
        shape = plan.shape
        q4, k3, v3 = to_internal(q, k, v, shape)
        if plan.native:
            st = plan.structure
            blocks, tiles, spans = _block_views(plan)
            if plan.dtype == torch.bfloat16:  # the kernel reads QKV_BF16_MATMUL: checked first
                check_bf16_matmul(native_ops())
            out4, lse4 = native_ops().fwd(
                q4.contiguous(), k3.contiguous(), v3.contiguous(), _mask_view(mask, shape),
                plan.scale, st.causal, _window_arg(st), plan.block_q, plan.block_k,
                _bias_view(bias, shape), _per_head(alibi, shape), _per_head(rel, shape),
                plan.softcap, blocks, tiles, spans,
            )  # fmt: skip
        else:
            q4c = q4 * plan.c  # (N, G, Tq, d_k), scale folded into q once
            fwd = _forward if plan.dtype == plan.acc_dtype else _forward_low
            out4, lse4 = fwd(plan, q4c, k3, v3, to_5d(bias, shape), to_5d(mask, shape))
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, bias, mask, alibi, rel, out4, lse4)
        out = out4.view(*shape.batch, shape.h, shape.Tq, shape.d_v)
        lse = lse4.view(*shape.batch, shape.h, shape.Tq)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):  # type: ignore[override]
        q, k, v, bias, mask, alibi, rel, out4, lse4 = ctx.saved_tensors
        plan: _Plan = ctx.plan
        shape = plan.shape
        q4, k3, v3 = to_internal(q, k, v, shape)
        dout4 = dout.reshape(out4.shape)
        need_dbias = bias is not None and ctx.needs_input_grad[3]
        if plan.native:
            st = plan.structure
            N, G, f32 = q4.shape[0], shape.group, dict(dtype=torch.float32, device=q.device)
            dbias5 = None
            if need_dbias:  # batch and kv-head dims full (one thread each), the rest as bias
                b5 = to_5d(bias, shape)
                dbias5 = torch.zeros(math.prod(shape.batch), shape.h_kv, *b5.shape[2:], **f32)
            dalibi = torch.zeros(N, G, **f32) if ctx.needs_input_grad[5] else None
            drel = torch.zeros(N, G, rel.shape[-1], **f32) if ctx.needs_input_grad[6] else None
            blocks, tiles, spans = _block_views(plan)
            if plan.dtype == torch.bfloat16:
                check_bf16_matmul(native_ops())
            dq, dk, dv = native_ops().bwd(
                q4.contiguous(), k3.contiguous(), v3.contiguous(), out4, dout4.contiguous(),
                lse4, _mask_view(mask, shape), plan.scale, st.causal, _window_arg(st),
                plan.block_q, plan.block_k, _bias_view(bias, shape), _per_head(alibi, shape),
                _per_head(rel, shape), plan.softcap, blocks, tiles, spans, dbias5, drel,
                dalibi,
            )  # fmt: skip
            dbias = None
            if need_dbias:
                g5 = reduce_to(dbias5, to_5d(bias, shape).shape)
                dbias = from_5d_grad(g5, bias, shape).to(bias.dtype)
            if dalibi is not None:  # (Nb·h_kv, G) summed over the batch → (h,)
                dalibi = dalibi.view(-1, shape.h).sum(0).to(alibi.dtype)
            if drel is not None:
                drel = drel.view(-1, shape.h, rel.shape[-1]).sum(0).to(rel.dtype)
            return (
                dq.to(q.dtype).view(q.shape), dk.to(k.dtype).view(k.shape),
                dv.to(v.dtype).view(v.shape), dbias, None, dalibi, drel, None,
            )  # fmt: skip
        bias5 = to_5d(bias, shape)
        dq, dk, dv, dbias5 = _backward(
            plan, dout4, q4 * plan.c, k3, v3, out4, lse4, bias5, to_5d(mask, shape), need_dbias
        )
        dq = (dq * plan.c).to(q.dtype).view(q.shape)
        dbias = from_5d_grad(dbias5, bias, shape).to(bias.dtype) if need_dbias else None
        return (
            dq, dk.to(k.dtype).view(k.shape), dv.to(v.dtype).view(v.shape), dbias, None, None,
            None, None,
        )  # fmt: skip


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    causal: bool = False,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    rel_bias: Tensor | None = None,
    return_lse: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Tiled attention with the online softmax; same math as the reference ``"math"`` path.

    Args:
        q: ``(..., h, Tq, d_k)``; k ``(..., h_kv, Tk, d_k)``; v ``(..., h_kv, Tk, d_v)``.
        mask: bool, **True = may attend**, ``(Tq, Tk)`` or ``(..., h|1, Tq|1, Tk|1)``, or a
            :class:`qkv.block_mask.BlockMask` (its block size sets ``block_q``/``block_k``).
        bias: float, same shapes as ``mask``, added to the scaled (soft-capped) scores;
            receives a gradient when it requires one.
        causal, window, scale, softcap, alibi_slopes, rel_bias: as
            :func:`qkv.functional.scaled_dot_product_attention`.
        return_lse: also return the log-sum-exp ``(..., h, Tq)`` (fp32; ``-inf`` for a row
            with no visible key).
        block_q, block_k: tile sizes (default :data:`BLOCK_Q`, :data:`BLOCK_K`), at most
            the sequence lengths (larger ones are clamped).

    Returns:
        ``out (..., h, Tq, d_v)`` or ``(out, lse)``. Rows with no visible key are zeros.
        NaN and inf follow the rule of :mod:`qkv._nonfinite` (docs/errors.md), as every
        backend of :func:`qkv.functional.scaled_dot_product_attention`: a call whose
        non-finite value sits at a key some rows see and others do not runs the reference
        math instead.

    >>> q = k = v = torch.randn(1, 2, 300, 16)  # (B, h, T, d_k)
    >>> flash_attention(q, k, v, causal=True, block_q=64, block_k=64).shape
    torch.Size([1, 2, 300, 16])
    """
    args = dict(mask=mask, bias=bias, causal=causal, window=window, scale=scale,
                softcap=softcap, alibi_slopes=alibi_slopes, rel_bias=rel_bias)  # fmt: skip
    shape = check_qkv(q, k, v)
    if isinstance(mask, BlockMask):
        check_block_mask(mask, shape, q.device)
    else:
        check_mask(mask, shape, q.device)
    check_bias(bias, shape, q.device)
    if q.device.type != "cuda" and not shape.empty:
        from qkv._nonfinite import values_for_flash  # (it imports this module)

        v, exact = values_for_flash(
            v, mask=mask, bias=bias, causal=causal, window=window, Tq=shape.Tq
        )
        if not exact:
            out, lse = reference_attention(q, k, v, shape, **args)
            return (out, lse) if return_lse else out
    return run_flash(q, k, v, **args, return_lse=return_lse, block_q=block_q, block_k=block_k)


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, shape: AttentionShape, *, mask, bias, causal: bool,
    window: int | None, scale: float | None, softcap: float | None, alibi_slopes, rel_bias,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(out, lse)`` by the reference math (:func:`qkv.kernels.reference.dense_attention`),
    the fused kernel's structure and extras spelt out densely: for calls only the reference
    computes under the NaN/inf rule."""
    block_mask = mask if isinstance(mask, BlockMask) else None
    mask, bias = _densify(q, block_mask, None if block_mask else mask, bias, alibi_slopes,
                          rel_bias, shape)  # fmt: skip
    structure = Structure(shape.Tq, shape.Tk, bool(causal), window)
    dense = structure.block_mask(0, shape.Tq, 0, shape.Tk, q.device)  # (Tq, Tk) or None
    if dense is not None:
        mask = dense if mask is None else mask & dense
    scale = 1.0 / math.sqrt(shape.d_k) if scale is None else float(scale)
    return dense_attention(q, k, v, mask=mask, bias=bias, scale=scale, softcap=softcap)


def run_flash(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None = None, bias: Tensor | None = None,
    causal: bool = False, window: int | None = None, scale: float | None = None,
    softcap: float | None = None, alibi_slopes: Tensor | None = None,
    rel_bias: Tensor | None = None, return_lse: bool = False, block_q: int | None = None,
    block_k: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """:func:`flash_attention` on values the NaN/inf rule has already been applied to (the
    dispatcher's entry, after :func:`qkv._nonfinite.values_for_kernel`)."""
    shape = check_qkv(q, k, v)
    check_options(window=window, scale=scale, softcap=softcap, dropout_p=0.0, dtype=q.dtype)
    block_mask = mask if isinstance(mask, BlockMask) else None
    if block_mask is not None:
        check_block_mask(block_mask, shape, q.device)
        mask = None
    check_mask(mask, shape, q.device)
    check_bias(bias, shape, q.device)
    check_per_head(alibi_slopes, rel_bias, shape, q.device)
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if b is not None and (not isinstance(b, int) or b < 1):
            raise ValueError(f"{name} must be an int >= 1 or None, got {b!r}")
    scale = 1.0 / math.sqrt(shape.d_k) if scale is None else float(scale)
    extra = (block_mask, alibi_slopes, rel_bias)
    if any(t is not None for t in extra) and (
        shape.empty or shape.d_v == 0 or not _native_ok(q, k, v, block_mask, scale)
    ):  # the PyTorch-ops kernel (or the empty answer): all of them as a dense bias/mask
        mask, bias = _densify(q, block_mask, mask, bias, alibi_slopes, rel_bias, shape)
        return run_flash(
            q, k, v, mask=mask, bias=bias, causal=causal, window=window, scale=scale,
            softcap=softcap, return_lse=return_lse, block_q=block_q, block_k=block_k,
        )  # fmt: skip
    if shape.empty:  # no score to compute (and nothing for the C++ kernel to index)
        out, lse = _Empty.apply(q, k, v, bias, shape)
        return (out, lse) if return_lse else out
    if shape.d_v == 0:  # no value column: one zero column gives the lse, then is dropped
        v1 = torch.cat([v, v.new_zeros(*v.shape[:-1], 1)], dim=-1)  # (..., h_kv, Tk, 1)
        out, lse = run_flash(
            q, k, v1, mask=mask, bias=bias, causal=causal, window=window, scale=scale,
            softcap=softcap, return_lse=True, block_q=block_q, block_k=block_k,
        )  # fmt: skip
        out = out[..., :0]  # (..., h, Tq, 0)
        return (out, lse) if return_lse else out
    if q.dtype == torch.float16:  # in fp32 (module docstring); autograd casts the gradients
        out, lse = run_flash(
            q.float(), k.float(), v.float(), mask=block_mask or mask, bias=bias, causal=causal,
            window=window, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
            rel_bias=rel_bias, return_lse=True, block_q=block_q, block_k=block_k,
        )  # fmt: skip
        out = out.to(q.dtype)
        return (out, lse) if return_lse else out
    plan = _make_plan(q, k, v, shape, mask, bias, causal, window, scale, softcap, block_mask,
                      block_q, block_k)  # fmt: skip
    out, lse = _FlashFunction.apply(q, k, v, bias, mask, alibi_slopes, rel_bias, plan)
    return (out, lse) if return_lse else out


def _make_plan(q, k, v, shape, mask, bias, causal, window, scale: float, softcap, block_mask,
               block_q, block_k) -> _Plan:  # fmt: skip
    """The plan of a call that reached the kernels (checked, non-empty, not fp16). It reads
    only the arguments' metadata and options, so it holds for every call of the same
    signature (the dispatcher keeps it: :func:`prepared_call`)."""
    native = _native_ok(q, k, v, mask, scale)
    if block_mask is not None:  # the kernel's blocks are the mask's
        block_q, block_k = block_mask.block_size
    if native:
        default_q, default_k = NATIVE_BLOCK_Q, NATIVE_BLOCK_K
    else:
        default_q = BLOCK_Q if window is None else BLOCK_Q_WINDOW
        default_k = BLOCK_K if q.dtype in (torch.float32, torch.float64) else BLOCK_K_LOW
    return _Plan(
        shape=shape,
        structure=Structure(shape.Tq, shape.Tk, bool(causal), window),
        c=scale if softcap is None else scale / softcap,
        softcap=None if softcap is None else float(softcap),
        block_q=min(block_q or default_q, shape.Tq),  # a block never exceeds the sequence
        block_k=min(block_k or default_k, shape.Tk),
        dtype=q.dtype,
        native=native,
        scale=scale,
        block_mask=block_mask,
    )


def prepared_call(
    q: Tensor, k: Tensor, v: Tensor, shape: AttentionShape, *, mask: Tensor | None,
    bias: Tensor | None, causal: bool, window: int | None, scale: float | None,
    softcap: float | None,
) -> Callable[[Tensor, Tensor, Tensor, Tensor | None, Tensor | None], Tensor] | None:  # fmt: skip
    """``flash_attention(q, k, v, mask=, bias=, ...)`` for every call of this signature, its
    plan made once: ``run(q, k, v, mask, bias) -> out``, for arguments already checked (the
    dispatcher's). ``None`` where flash_attention takes another route (empty inputs, no
    value columns, fp16)."""
    if shape.empty or shape.d_v == 0 or q.dtype == torch.float16:
        return None
    scale = 1.0 / math.sqrt(shape.d_k) if scale is None else float(scale)
    plan = _make_plan(q, k, v, shape, mask, bias, causal, window, scale, softcap, None, None,
                      None)  # fmt: skip
    apply = _FlashFunction.apply

    def run(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None) -> Tensor:
        return apply(q, k, v, bias, mask, None, None, plan)[0]

    return run


def alibi_dense(slopes: Tensor, Tq: int, Tk: int) -> Tensor:
    """``-slope_h·|p(i) - j|`` as a dense bias ``(1, h, Tq, Tk)`` (differentiable in the slopes)."""
    pos = torch.arange(Tq, device=slopes.device)[:, None] + (Tk - Tq)  # (Tq, 1), bottom-right
    dist = (pos - torch.arange(Tk, device=slopes.device)[None, :]).abs()  # (Tq, Tk)
    return (-slopes[:, None, None] * dist.to(slopes.dtype)).unsqueeze(0)


def rel_dense(rel: Tensor, Tq: int, Tk: int) -> Tensor:
    """``rel[h, Tk - 1 + j - p(i)]`` as a dense bias ``(1, h, Tq, Tk)`` (differentiable)."""
    i = torch.arange(Tq, device=rel.device)[:, None]
    j = torch.arange(Tk, device=rel.device)[None, :]
    return rel[:, j - i + Tq - 1].unsqueeze(0)  # Tk - 1 + j - (Tk - Tq + i)


def _lead(t: Tensor, shape: AttentionShape) -> Tensor:
    """``(1|Nb, h|1, Tq, Tk)`` → ``(*batch|1s, h|1, Tq, Tk)`` (the score's rank)."""
    batch = [1] * len(shape.batch) if t.shape[0] == 1 else list(shape.batch)
    return t.reshape(*batch, *t.shape[1:])


def _densify(q, block_mask, mask, bias, alibi_slopes, rel_bias, shape):
    """Block mask → bool mask, ALiBi/relative table → one dense bias (for the other paths)."""
    if block_mask is not None:
        mask = _lead(block_mask.to_dense(), shape)  # (..., H|1, Tq, Tk)
    for t, f in ((alibi_slopes, alibi_dense), (rel_bias, rel_dense)):
        if t is not None:
            extra = _lead(f(t, shape.Tq, shape.Tk), shape)  # (1.., h, Tq, Tk)
            bias = extra if bias is None else bias + extra
    return mask, bias
