"""qkv's options as arguments of PyTorch's ``scaled_dot_product_attention`` (the "torch"
backend): its bool ``attn_mask`` is also True = may attend; its ``is_causal`` is top-left
aligned, ours bottom-right, so it is passed only where the two agree."""

from __future__ import annotations

import torch
import torch.nn.functional as TF
from torch import Tensor

from qkv import masks
from qkv.dispatch.case import Case


def _passes_through(Tq: int, Tk: int, causal: bool, window, has_mask: bool, has_bias: bool):
    """``is_causal`` for torch SDPA when our options need no mask built (else ``None``).

    ``is_causal`` is used only when it means the same (``Tq == Tk``, no other mask); its
    top-left alignment differs from ours when ``Tq != Tk``, so then an explicit bottom-right
    mask is built (one query, decoding, sees every key: no mask needed).
    """
    is_causal = causal and window is None and Tq == Tk and not has_mask and not has_bias
    if window is None and not has_bias and (is_causal or not causal or Tq == 1):
        return is_causal
    return None


def _torch_kwargs(case: Case) -> dict | None:
    """torch SDPA's keyword arguments (other than ``attn_mask``, the call's own mask) for a
    case that passes straight through to it (else ``None``): only those not at their default,
    since each keyword costs argument parsing on every call."""
    s = case.shape
    is_causal = _passes_through(s.Tq, s.Tk, case.causal, case.window, case.has_mask,
                                case.has_bias)  # fmt: skip
    if is_causal is None:
        return None
    kw: dict = {"is_causal": True} if is_causal else {}
    if case.scale is not None:
        kw["scale"] = case.scale
    if case.dropout_p:
        kw["dropout_p"] = case.dropout_p
    if s.h != s.h_kv:
        kw["enable_gqa"] = True
    return kw


def torch_sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None,
    bias: Tensor | None,
    causal: bool,
    window: int | None,
    scale: float | None,
    dropout_p: float,
) -> Tensor:
    """Our options as PyTorch SDPA arguments (its bool ``attn_mask`` is also True = attend)."""
    Tq, Tk = q.shape[-2], k.shape[-2]
    gqa = q.shape[-3] != k.shape[-3]
    is_causal = _passes_through(Tq, Tk, causal, window, mask is not None, bias is not None)
    if is_causal is not None:  # the mask as given: nothing to combine it with
        return TF.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=gqa,
        )  # fmt: skip
    structure = None
    if window is not None:
        structure = masks.sliding_window(Tq, Tk, window, causal=causal, device=q.device)
    elif causal and Tq > 1:  # (Tq != Tk, or another mask: is_causal would not mean ours)
        structure = masks.causal(Tq, Tk, device=q.device)
    allowed = masks.combine(mask, structure)
    if bias is None:
        attn_mask = allowed
    elif allowed is None:
        attn_mask = bias.to(q.dtype)
    else:
        attn_mask = torch.where(allowed, bias.to(q.dtype), float("-inf"))
    return TF.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa,
    )  # fmt: skip
