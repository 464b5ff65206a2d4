"""Attention weights of selected heads, recomputed from a saved log-sum-exp.

A fast path never holds the ``(Tq, Tk)`` weights; when a user wants to look at some heads,
``weights = exp(s - lse)`` is recomputed for those heads only, so inspecting one head costs
one head's ``Tq×Tk``, not all of them on the slow path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from qkv import masks

__all__ = ["weights_from_lse"]


def _heads(t: Tensor | None, index: Tensor) -> Tensor | None:
    """Select heads of a mask/bias ``(Tq, Tk)`` or ``(..., h|1, Tq|1, Tk|1)``."""
    if t is None or t.dim() == 2 or t.shape[-3] == 1:
        return t
    return t.index_select(-3, index)


@torch.no_grad()
def weights_from_lse(
    q: Tensor,
    k: Tensor,
    lse: Tensor,
    *,
    heads: Sequence[int] | None = None,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    causal: bool = False,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Weights ``(..., len(heads), Tq, Tk)`` of the given query heads (all when ``None``).

    Args:
        q: ``(..., h, Tq, d_k)``; k ``(..., h_kv, Tk, d_k)``; lse ``(..., h, Tq)`` as returned
            by :func:`qkv.kernels.flash.flash_attention` with ``return_lse=True``.
        heads: query-head indices to recompute.
        mask, bias, causal, window, scale, softcap: the options of the attention call
            (mask: bool, **True = may attend**).

    Returns the weights without gradient (for inspection). Rows with no visible key are zero.

    >>> from qkv.kernels.flash import flash_attention
    >>> q = k = v = torch.randn(1, 4, 6, 8)  # (B, h, T, d_k)
    >>> out, lse = flash_attention(q, k, v, return_lse=True)
    >>> weights_from_lse(q, k, lse, heads=[2]).shape
    torch.Size([1, 1, 6, 6])
    """
    h, h_kv = q.shape[-3], k.shape[-3]
    index = torch.arange(h, device=q.device) if heads is None else torch.as_tensor(heads)
    index = index.to(device=q.device, dtype=torch.long)
    if index.dim() != 1 or (len(index) and (int(index.min()) < 0 or int(index.max()) >= h)):
        raise ValueError(f"heads must be a list of head indices in [0, {h}), got {heads!r}")
    Tq, Tk = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    qh = q.index_select(-3, index)  # (..., n, Tq, d_k)
    kh = k.index_select(-3, index // (h // h_kv))  # (..., n, Tk, d_k): each head's kv head
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = (qh.to(acc) * scale) @ kh.to(acc).transpose(-2, -1)  # (..., n, Tq, Tk), never fp16
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    b = _heads(bias, index)
    if b is not None:
        s = s + b
    structure = None
    if window is not None:
        structure = masks.sliding_window(Tq, Tk, window, causal=causal, device=q.device)
    elif causal:
        structure = masks.causal(Tq, Tk, device=q.device)
    allowed = masks.combine(_heads(mask, index), structure)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    lse_h = lse.index_select(-2, index).to(acc).unsqueeze(-1)  # (..., n, Tq, 1)
    # exp(s - lse) <= 1 in exact arithmetic; the clamp keeps rounding from reaching inf
    w = torch.exp((s - lse_h.masked_fill(lse_h == float("-inf"), 0.0)).clamp_max_(0.0))
    # With logits of ~1e5 and more, the saved fp32 lse is off by more than the gaps between
    # them, and its rows no longer sum to 1: those rows are recomputed by a softmax of s.
    total = w.sum(dim=-1, keepdim=True)  # (..., n, Tq, 1): 1, or 0 for a row with no key
    off = ((total - 1).abs() > 1e-3) & (lse_h != float("-inf"))
    if bool(off.any()):
        m = s.amax(dim=-1, keepdim=True)
        e = torch.exp(s - m.masked_fill(m == float("-inf"), 0.0))
        w = torch.where(off, e / e.sum(dim=-1, keepdim=True).clamp_min(1e-30), w)
    return w.to(q.dtype)
