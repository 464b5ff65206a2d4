"""Mask and bias builders.

**One convention everywhere: ``True`` means "may attend".** Every mask built here is a
``torch.bool`` tensor in which ``mask[..., i, j]`` is ``True`` when query ``i`` may look at
key ``j``. Conventions of other libraries are converted at the boundary, by the
``from_*`` functions at the bottom of this file and nowhere else.

Shapes: ``Tq`` queries, ``Tk`` keys, ``B`` batch, ``h`` heads.

Queries and keys are aligned **bottom-right**: when ``Tq != Tk`` query ``i`` sits at key
position ``p(i) = Tk - Tq + i``, which is what KV-cached decoding needs (the new queries are
the last ``Tq`` positions of the sequence)::

    causal(2, 5)          keys ->  0 1 2 3 4
        query 0 (pos 3)            x x x x .
        query 1 (pos 4)            x x x x x
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from qkv.block_mask import (
    BlockMask,
    create_block_mask,
    document_mask,
    prefix_lm_mask,
    sliding_window_mask,
)
from qkv.kernels.flash import alibi_dense

__all__ = [
    "BlockMask",
    "create_block_mask",
    "document_mask",
    "prefix_lm_mask",
    "sliding_window_mask",
    "t5_bucket",
    "t5_relative_bias",
    "causal",
    "sliding_window",
    "padding",
    "combine",
    "alibi_slopes",
    "alibi_bias",
    "from_key_padding_mask",
    "from_torch_attn_mask",
]


def _positions(Tq: int, Tk: int, device: torch.device | str | None) -> tuple[Tensor, Tensor]:
    """Query positions (Tq, 1) on the key axis (bottom-right aligned) and key positions (1, Tk)."""
    if Tq < 0 or Tk < 0:
        raise ValueError(f"Tq and Tk must be >= 0, got Tq={Tq}, Tk={Tk}")
    q_pos = torch.arange(Tq, device=device).unsqueeze(1) + (Tk - Tq)  # (Tq, 1)
    k_pos = torch.arange(Tk, device=device).unsqueeze(0)  # (1, Tk)
    return q_pos, k_pos


def causal(Tq: int, Tk: int | None = None, *, device: torch.device | str | None = None) -> Tensor:
    """Causal mask ``(Tq, Tk)``: query ``i`` may attend to keys ``j <= Tk - Tq + i``.

    True = may attend. Bottom-right aligned when ``Tq != Tk`` (see module docstring).

    >>> causal(3).int()
    tensor([[1, 0, 0],
            [1, 1, 0],
            [1, 1, 1]], dtype=torch.int32)
    """
    Tk = Tq if Tk is None else Tk
    q_pos, k_pos = _positions(Tq, Tk, device)
    return k_pos <= q_pos  # (Tq, Tk)


def sliding_window(
    Tq: int,
    Tk: int | None = None,
    window: int = 1,
    *,
    causal: bool = True,
    device: torch.device | str | None = None,
) -> Tensor:
    """Sliding-window (local) mask ``(Tq, Tk)``. True = may attend.

    With ``causal=True`` each query sees the ``window`` most recent keys, itself included:
    ``p(i) - window < j <= p(i)``. With ``causal=False`` it sees keys within distance
    ``window - 1`` on both sides: ``|j - p(i)| < window``.

    >>> sliding_window(4, 4, 2).int()
    tensor([[1, 0, 0, 0],
            [1, 1, 0, 0],
            [0, 1, 1, 0],
            [0, 0, 1, 1]], dtype=torch.int32)
    """
    Tk = Tq if Tk is None else Tk
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    q_pos, k_pos = _positions(Tq, Tk, device)
    allowed = k_pos > q_pos - window
    allowed = allowed & (k_pos <= q_pos) if causal else allowed & (k_pos < q_pos + window)
    return allowed  # (Tq, Tk)


def padding(lengths: Tensor | list[int], T: int | None = None) -> Tensor:
    """Key-padding mask ``(B, 1, 1, T)`` from sequence lengths. True = may attend (a real token).

    The shape broadcasts against scores ``(B, h, Tq, T)``.

    >>> padding([2, 3], 4)[:, 0, 0].int()
    tensor([[1, 1, 0, 0],
            [1, 1, 1, 0]], dtype=torch.int32)
    """
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1 or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise ValueError(
            f"lengths must be a 1-D integer tensor (B,), got shape {tuple(lengths.shape)} "
            f"dtype {lengths.dtype}"
        )
    T = int(lengths.max()) if T is None else T
    if len(lengths) and (int(lengths.min()) < 0 or int(lengths.max()) > T):
        raise ValueError(f"lengths must lie in [0, T={T}], got {lengths.tolist()}")
    keep = torch.arange(T, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)  # (B, T)
    return keep[:, None, None, :]  # (B, 1, 1, T)


def combine(*masks: Tensor | None) -> Tensor | None:
    """Logical AND of masks (``None`` entries are skipped). True = may attend.

    Returns ``None`` when every entry is ``None``. Shapes must broadcast.
    """
    out: Tensor | None = None
    for m in masks:
        if m is None:
            continue
        if m.dtype != torch.bool:
            raise TypeError(f"combine() takes bool masks (True = may attend), got dtype {m.dtype}")
        out = m if out is None else out & m
    return out


def alibi_slopes(n_heads: int) -> Tensor:
    """ALiBi head slopes ``(n_heads,)`` (Press et al. 2022).

    For a power of two ``n`` the slopes are ``2^(-8/n), 2^(-16/n), ...``; otherwise the
    paper's recipe: the slopes of the closest lower power of two, then every other slope of
    the next power of two.
    """
    if n_heads < 1:
        raise ValueError(f"n_heads must be >= 1, got {n_heads}")

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        slopes = power_of_two(n_heads)
    else:
        lower = 2 ** math.floor(math.log2(n_heads))
        slopes = power_of_two(lower) + power_of_two(2 * lower)[0::2][: n_heads - lower]
    return torch.tensor(slopes)


def alibi_bias(
    n_heads: int,
    Tq: int,
    Tk: int | None = None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """ALiBi bias ``(1, n_heads, Tq, Tk)``: ``-slope_h * |p(i) - j|``, added to scaled scores.

    Combine with ``causal=True`` for the paper's decoder setting (only ``j <= p(i)`` counts).
    """
    Tk = Tq if Tk is None else Tk
    _positions(Tq, Tk, device)  # (checks Tq, Tk)
    # the dense form the kernels build for paths without ALiBi (one builder for both)
    return alibi_dense(alibi_slopes(n_heads).to(device=device, dtype=dtype), Tq, Tk)


def t5_bucket(
    relative_position: Tensor, *, bidirectional: bool = True, num_buckets: int = 32,
    max_distance: int = 128,
) -> Tensor:  # fmt: skip
    """T5's bucket of a relative position ``key - query``: exact below ``num_buckets // 4``
    (bidirectional; ``// 2`` otherwise), logarithmic up to ``max_distance``, then the last."""
    n = num_buckets
    ret = torch.zeros_like(relative_position)
    rel = relative_position
    if bidirectional:
        n //= 2
        ret = ret + (rel > 0).long() * n
        rel = rel.abs()
    else:
        rel = -rel.clamp(max=0)
    exact = n // 2
    large = (
        exact
        + (
            torch.log(rel.float().clamp(min=1) / exact)
            / math.log(max_distance / exact)
            * (n - exact)
        ).long()
    )
    large = large.clamp(max=n - 1)
    return ret + torch.where(rel < exact, rel, large)


def t5_relative_bias(
    table: Tensor, Tq: int, Tk: int | None = None, *, bidirectional: bool = True,
    max_distance: int = 128,
) -> Tensor:  # fmt: skip
    """The ``rel_bias`` ``(h, Tq + Tk - 1)`` of a T5 bucket table ``(h, num_buckets)``.

    Entry ``Tk - 1 + r`` is the bias of relative position ``r = j - p(i)`` (key minus query,
    bottom-right aligned); pass it as ``scaled_dot_product_attention(..., rel_bias=...)``.
    Gathered from ``table``, so the table gets its gradient.
    """
    Tk = Tq if Tk is None else Tk
    if table.dim() != 2:
        raise ValueError(f"table must be (h, num_buckets), got shape {tuple(table.shape)}")
    r = torch.arange(-(Tk - 1), Tq, device=table.device)  # (Tq + Tk - 1,)
    buckets = t5_bucket(
        r, bidirectional=bidirectional, num_buckets=table.shape[1], max_distance=max_distance
    )
    return table[:, buckets]  # (h, Tq + Tk - 1)


# --- conversions from other conventions (the only place they are handled) ---------------


def from_key_padding_mask(key_padding_mask: Tensor) -> Tensor:
    """Convert PyTorch's ``key_padding_mask`` ``(B, T)`` (True = *padding, ignore*) to ours.

    Returns ``(B, 1, 1, T)`` with True = may attend.
    """
    if key_padding_mask.dim() != 2:
        raise ValueError(
            f"key_padding_mask must be (B, T), got shape {tuple(key_padding_mask.shape)}"
        )
    if key_padding_mask.dtype != torch.bool:
        raise TypeError(f"key_padding_mask must be bool, got {key_padding_mask.dtype}")
    return (~key_padding_mask)[:, None, None, :]  # (B, 1, 1, T)


def from_torch_attn_mask(attn_mask: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """Convert ``nn.MultiheadAttention``'s ``attn_mask`` to ``(mask, bias)`` in qkv's convention.

    PyTorch's module uses True = *blocked* for bool masks and an additive float mask
    otherwise. A bool mask becomes ``(~attn_mask, None)``; a float mask becomes
    ``(None, attn_mask)``.
    """
    if attn_mask.dtype == torch.bool:
        return ~attn_mask, None
    if attn_mask.dtype.is_floating_point:
        return None, attn_mask
    raise TypeError(f"attn_mask must be bool or floating, got {attn_mask.dtype}")
