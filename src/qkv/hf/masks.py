"""The mask function registered for ``attn_implementation="qkv"`` (True = may attend).

transformers builds every attention mask through the function registered under the model's
``attn_implementation`` in ``AttentionMaskInterface``; with no function registered it passes
**no mask at all** (padding silently ignored). :func:`qkv_mask` is that function for "qkv".

It returns what transformers' own ``sdpa_mask`` returns, which is already qkv's convention:

- a bool tensor ``(B, 1, Tq, Tk)``, **True = may attend**, holding everything the model asked
  for (causal, sliding window, chunked, padding, packed sequences), positions offset by the
  cache (``q_offset``/``kv_offset``); or
- ``None`` when nothing needs to be masked beyond what the attention call itself knows:
  a plain causal mask without padding (``is_causal`` of the attention module, aligned as
  qkv's ``causal=True``: bottom-right, or ``Tq == Tk``, or a static cache prefill, see
  :mod:`qkv.hf.attention`), or a bidirectional mask without padding.

Keeping ``None`` for those cases lets the adapter pass ``causal=True`` to qkv, so the fused
kernel skips the blocks above the diagonal instead of reading a ``Tq×Tk`` mask.

Rows that see no key (a left-padding query of a decoder, every query of an all-padding
encoder row and the decoder's cross-attention over it): qkv's own convention gives them zeros,
transformers' eager adds ``finfo(dtype).min`` to every score of the row, which absorbs the
scores (``s + min == min`` in fp32 and bf16), so softmax spreads the row evenly over **all**
``Tk`` keys. The adapter gives eager's result: :func:`empty_rows` finds those rows and
:func:`fill_empty_rows` / :func:`fill_empty_weights` put the mean of the values (weights
``1/Tk``) there. Adding ``min`` as a bias instead would not do: the fused kernels'
log-sum-exp ``min + log Tk`` rounds to ``min``, so their backward and the weights recomputed
from it would be ``Tk`` times too large.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from transformers.masking_utils import causal_mask_function, sdpa_mask

__all__ = ["eager_empty_rows", "empty_rows", "fill_empty_rows", "fill_empty_weights", "qkv_mask"]


def qkv_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable = causal_mask_function,
    attention_mask: Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    **kwargs,
) -> Tensor | None:
    """The boolean mask ``(B, 1, Tq, Tk)`` (True = may attend) of one attention pattern, or None.

    Called by transformers (``create_causal_mask``, ``create_bidirectional_mask``,
    ``create_sliding_window_causal_mask``...) with these keyword arguments:

    Args:
        batch_size, q_length, kv_length: the mask is ``(batch_size, 1, q_length, kv_length)``.
        q_offset, kv_offset: position of the first query / key (tokens already in the cache).
        mask_function: ``(b, h, q_idx, kv_idx) -> bool`` describing the pattern (causal,
            sliding window, bidirectional...), built by transformers.
        attention_mask: the 2-D padding mask ``(B, past + Tq)``, True/1 = real token.
        local_size: the sliding-window / chunk size of the layer, if any.
        allow_is_causal_skip, allow_is_bidirectional_skip: may return ``None`` when the
            pattern is plain causal / full without padding (see the module docstring).
        use_vmap, device: as for ``sdpa_mask``; other keyword arguments (``dtype``,
            ``config``) are accepted and ignored.

    >>> qkv_mask(1, 3, 3, allow_is_causal_skip=False)[0, 0].int().tolist()
    [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=allow_is_causal_skip,
        allow_is_bidirectional_skip=allow_is_bidirectional_skip,
        use_vmap=use_vmap,
        device=device,
    )


def empty_rows(mask: Tensor | None, tk: int) -> Tensor | None:
    """``(B|1, h|1, Tq, 1)`` bool, True where the bool ``mask`` hides every one of the ``tk``
    keys; ``None`` when no row is (or there is no mask, or no key: nothing to average).

    >>> m = torch.tensor([[True, False], [False, False]]).reshape(1, 1, 2, 2)
    >>> empty_rows(m, 2).flatten().tolist()
    [False, True]
    """
    if mask is None or mask.dtype != torch.bool or tk == 0:
        return None
    empty = ~mask.any(dim=-1, keepdim=True)
    # one host sync per call; rows like these are rare, so the common case stays untouched
    return empty if bool(empty.any()) else None


def fill_empty_rows(empty: Tensor, value: Tensor, out: Tensor) -> Tensor:
    """Eager's output on the ``empty`` rows: every key weighted ``1/Tk``, the mean of the values.

    Args:
        empty: ``(B|1, h|1, Tq, 1)`` from :func:`empty_rows`.
        value: ``(B, h_kv, Tk, d_v)``; query head ``j`` reads kv head ``j // (h / h_kv)``.
        out: ``(B, h, Tq, d_v)``.

    Its gradient reaches ``value`` only: use :func:`eager_empty_rows` where eager's gradient
    into the scores is wanted too.
    """
    h, h_kv = out.shape[1], value.shape[1]
    mean = value.mean(dim=-2, keepdim=True)  # (B, h_kv, 1, d_v)
    if h != h_kv:
        mean = mean.repeat_interleave(h // h_kv, dim=1)  # (B, h, 1, d_v)
    return torch.where(empty, mean.to(out.dtype), out)


def fill_empty_weights(empty: Tensor, weights: Tensor, heads: list[int] | None = None) -> Tensor:
    """Eager's weights ``1/Tk`` on the ``empty`` rows of ``weights`` ``(B, h or len(heads), Tq,
    Tk)``; ``heads``: the query heads ``weights`` holds, when not all of them."""
    if heads is not None and empty.shape[1] > 1:
        empty = empty[:, heads]
    uniform = torch.full((), 1.0 / weights.shape[-1], dtype=weights.dtype, device=weights.device)
    return torch.where(empty, uniform, weights)


def eager_empty_rows(
    empty: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    *,
    bias: Tensor | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> Tensor:
    """:func:`fill_empty_rows` with eager's gradients: the scores of the empty rows are
    computed (scaled, soft-capped, plus ``bias``, as eager) and weighted by
    ``softmax(s - s.detach())``, exactly ``1/Tk`` like eager's ``softmax(s + min)``, with the
    same Jacobian, so q, k and the bias get what eager gives them (T5's learned bias, with an
    all-padding source, gets a gradient through its cross-attention). Only the rows of the
    batch elements that have them are computed: ``(h, n, Tk)`` scores for ``n`` empty rows.
    No dropout on them (eager drops some of their weights at random): drawing no random
    numbers keeps every other row's dropout the same as eager's.

    Args:
        empty: ``(B|1, h|1, Tq, 1)`` from :func:`empty_rows`; query ``(B, h, Tq, d)``; key,
            value ``(B, h_kv, Tk, d)``; out ``(B, h, Tq, d_v)``; bias broadcasting to
            ``(B, h, Tq, Tk)``; scale and softcap as qkv takes them.
    """
    B, h, Tq, d = query.shape
    group = h // key.shape[1]
    scale = d**-0.5 if scale is None else scale
    hit = empty.any(dim=1)[..., 0].expand(B, Tq)  # (B, Tq): rows empty for some head
    rows_of = [hit[b].nonzero()[:, 0] for b in range(B)]
    outs = []
    for b, rows in enumerate(rows_of):
        if rows.numel() == 0:
            outs.append(out[b])
            continue
        k, v = key[b], value[b]  # (h_kv, Tk, d)
        if group > 1:
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        s = query[b][:, rows] @ k.transpose(-1, -2) * scale  # (h, n, Tk)
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if bias is not None:
            full = bias.expand(bias.shape[0], h, Tq, k.shape[1])  # (B|1, h, Tq, Tk)
            s = s + full[min(b, bias.shape[0] - 1)][:, rows]
        p = torch.softmax(s - s.detach(), dim=-1)  # every logit 0: weights exactly 1/Tk
        filled = torch.zeros_like(out[b]).index_copy(1, rows, (p.to(v.dtype) @ v).to(out.dtype))
        outs.append(torch.where(empty[min(b, empty.shape[0] - 1)], filled, out[b]))
    return torch.stack(outs)
