"""Block bookkeeping shared by the tiled kernels: layouts, key ranges, block masks.

Internal layout (``N = prod(batch) · h_kv``, ``G = h // h_kv`` query heads per kv head)::

    q   (N, G, Tq, d_k)      a query block is folded to (N, G·bq, d_k): one matmul per kv head
    k   (N, Tk, d_k)         never repeated for GQA
    v   (N, Tk, d_v)
    mask/bias  (Nb|1, h_kv|1, G|1, Tq|1, Tk|1)   5-D views of the user's tensors (True = may attend)

Queries and keys are aligned bottom-right: query ``i`` sits at key position ``Tk - Tq + i``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv._validate import AttentionShape


@dataclass(frozen=True)
class Structure:
    """What ``causal``/``window`` allow, as key ranges per query block."""

    Tq: int
    Tk: int
    causal: bool
    window: int | None

    def key_range(self, qs: int, qe: int) -> tuple[int, int]:
        """Keys ``[lo, hi)`` that any query in ``[qs, qe)`` may see (``hi <= lo``: none)."""
        off = self.Tk - self.Tq
        lo, hi = 0, self.Tk
        if self.causal:
            hi = min(hi, off + qe)
        if self.window is not None:
            lo = max(lo, off + qs - self.window + 1)
            if not self.causal:
                hi = min(hi, off + qe - 1 + self.window)
        return lo, hi

    def key_blocks(self, qs: int, qe: int, block_k: int) -> list[tuple[int, int]]:
        """Key blocks ``(ks, ke)`` of at most ``block_k`` covering :meth:`key_range`.

        The keys that *every* query of ``[qs, qe)`` may see are cut apart from the partly
        visible ones, so only the small band along a causal/window edge needs a mask; the
        rest skips masking (and the kernels' -inf handling) entirely.
        """
        lo, hi = self.key_range(qs, qe)
        off, w = self.Tk - self.Tq, self.window
        flo, fhi = lo, hi  # keys every query in the block sees
        if self.causal:
            fhi = min(fhi, off + qs)  # (off + qs itself goes with the diagonal block)
        if w is not None:
            flo = max(flo, off + qe - w)
            if not self.causal:
                fhi = min(fhi, off + qs + w)
        cuts = [lo, hi] if fhi <= flo else [lo, flo, fhi, hi]
        return [
            (ks, min(ks + block_k, b))
            for a, b in zip(cuts, cuts[1:])
            for ks in range(a, b, block_k)
        ]

    # Cached: the kernels revisit each diagonal block once per head chunk (and in the
    # backward); the masks are never written to.
    @functools.lru_cache(maxsize=64)  # noqa: B019 (Structure is small, frozen and hashable)
    def block_mask(self, qs: int, qe: int, ks: int, ke: int, device: torch.device) -> Tensor | None:
        """``(bq, bk)`` bool mask (True = may attend) for a block, or None if it is all True."""
        off = self.Tk - self.Tq
        w = self.window
        need = (self.causal and ke - 1 > off + qs) or (
            w is not None and (ks < off + qe - w or (not self.causal and ke > off + qs + w))
        )
        if not need:
            return None
        q_pos = torch.arange(qs, qe, device=device).unsqueeze(1) + off  # (bq, 1)
        k_pos = torch.arange(ks, ke, device=device).unsqueeze(0)  # (1, bk)
        allowed = torch.ones(qe - qs, ke - ks, dtype=torch.bool, device=device)
        if self.causal:
            allowed &= k_pos <= q_pos
        if w is not None:
            allowed &= k_pos > q_pos - w
            if not self.causal:
                allowed &= k_pos < q_pos + w
        return allowed

    def visible_pairs(self) -> int:
        """Number of (query, key) pairs the structure allows (for FLOP counts)."""
        total = 0
        for i in range(self.Tq):
            lo, hi = self.key_range(i, i + 1)
            total += max(0, hi - lo)
        return total


def to_internal(q: Tensor, k: Tensor, v: Tensor, shape: AttentionShape) -> tuple[Tensor, ...]:
    """q ``(..., h, Tq, d)`` → ``(N, G, Tq, d)``; k, v ``(..., h_kv, Tk, d)`` → ``(N, Tk, d)``."""
    N = math.prod(shape.batch) * shape.h_kv
    q4 = q.reshape(N, shape.group, shape.Tq, shape.d_k)  # (N, G, Tq, d_k)
    k3 = k.reshape(N, shape.Tk, shape.d_k)  # (N, Tk, d_k)
    v3 = v.reshape(N, shape.Tk, shape.d_v)  # (N, Tk, d_v)
    return q4, k3, v3


def unit_key_stride(t: Tensor, *, broadcast_ok: bool = False) -> Tensor:
    """``t`` with stride 1 along its last (key) dim, copied only where it is strided there;
    ``broadcast_ok`` keeps a stride of 0 (a bias broadcast over the keys). A single key's
    column may carry any stride, which ``contiguous()`` leaves as it is (it ignores size-1
    dims): ``unsqueeze`` gives it stride 1."""
    if t.shape[-1] == 1:
        return t if t.stride(-1) == 1 else t[..., 0].unsqueeze(-1)
    if t.stride(-1) == 1 or (broadcast_ok and t.stride(-1) == 0):
        return t
    return t.contiguous()


def to_5d(t: Tensor | None, shape: AttentionShape) -> Tensor | None:
    """A mask/bias ``(Tq, Tk)`` or ``(..., h|1, Tq|1, Tk|1)`` → ``(Nb|1, h_kv|1, G|1, Tq|1, Tk|1)``."""
    if t is None:
        return None
    if t.dim() == 2:
        return t.view(1, 1, 1, *t.shape)
    lead = t.shape[:-3]
    if all(s == 1 for s in lead):
        t = t.reshape(1, *t.shape[-3:])  # (1, h|1, Tq|1, Tk|1)
    else:
        t = t.expand(*shape.batch, *t.shape[-3:]).reshape(-1, *t.shape[-3:])  # (Nb, h|1, ..)
    if t.shape[1] == 1:
        return t.unsqueeze(2)  # (Nb|1, 1, 1, Tq|1, Tk|1)
    return t.unflatten(1, (shape.h_kv, shape.group))  # (Nb|1, h_kv, G, Tq|1, Tk|1)


def from_5d_grad(g5: Tensor, original: Tensor, shape: AttentionShape) -> Tensor:
    """Map a gradient in the 5-D layout of :func:`to_5d` back to ``original``'s shape."""
    if original.dim() == 2:
        return g5.reshape(original.shape)
    g = g5.flatten(1, 2)  # (Nb|1, h|1, Tq|1, Tk|1)
    if g.shape[0] == 1:
        return g.reshape(original.shape)
    g = g.reshape(*shape.batch, *g.shape[1:])
    dims = [i for i, s in enumerate(original.shape[:-3]) if s == 1]
    return g.sum(dim=dims, keepdim=True) if dims else g


def block(t5: Tensor, qs: int, qe: int, ks: int, ke: int) -> Tensor:
    """Slice ``[..., qs:qe, ks:ke]`` of a 5-D mask/bias, keeping size-1 (broadcast) dims."""
    rows = slice(None) if t5.shape[-2] == 1 else slice(qs, qe)
    cols = slice(None) if t5.shape[-1] == 1 else slice(ks, ke)
    return t5[..., rows, cols]


def reduce_to(g: Tensor, like_shape: torch.Size) -> Tensor:
    """Sum ``g`` over the dims where ``like_shape`` is 1 (the reverse of broadcasting)."""
    dims = [i for i, (a, b) in enumerate(zip(g.shape, like_shape)) if b == 1 and a != 1]
    return g.sum(dim=dims, keepdim=True) if dims else g
