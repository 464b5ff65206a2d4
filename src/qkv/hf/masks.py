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
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from transformers.masking_utils import causal_mask_function, sdpa_mask

__all__ = ["qkv_mask"]


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
