"""qkv's options as arguments of PyTorch's ``scaled_dot_product_attention`` (the "torch"
backend): its bool ``attn_mask`` is also True = may attend; its ``is_causal`` is top-left
aligned, ours bottom-right, so it is passed only where the two agree.

Grouped-query calls with few queries (decoding: ``Tq <= ROWS_MAX_TQ``) run on the grouped-rows
layout: the ``G`` query heads of one kv head as ``G·Tq`` query rows of one head (q viewed as
``(..., h_kv, G·Tq, d)``, no copy), with a mask that is the same for every query head. PyTorch's
``enable_gqa`` repeats K and V per query head first: on the CPUs measured here the rows layout
read the cache 1.6-2.8× faster (`bench/results/decode_attention_zen3_avx2.md`, "torch gqa" vs
"torch rows").
"""

from __future__ import annotations

from collections.abc import Callable

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


ROWS_MAX_TQ = 16  # queries per call up to which a grouped-query call runs on grouped rows


def _rows_ok(Tq: int, h: int, h_kv: int, mask: object, bias: object) -> bool:
    """Whether the call can run as ``G·Tq`` rows per kv head: grouped query heads, few
    queries, no bias, and a mask (if any) without a query-head dimension (``(..., 1, Tq|1,
    Tk)`` or 2-D), the same for every query head of a group."""
    if h == h_kv or h_kv == 0 or Tq > ROWS_MAX_TQ or bias is not None:
        return False
    return mask is None or (isinstance(mask, Tensor) and (mask.dim() < 3 or mask.shape[-3] == 1))


def _as_rows(q: Tensor, h_kv: int) -> Tensor:
    """q ``(..., h, Tq, d)`` as ``(..., h_kv, G·Tq, d)``: query head ``hk·G + g`` is rows
    ``g·Tq ..`` of kv head ``hk`` (a view of a contiguous q). The output goes back with
    ``reshape``, not ``view``: SDPA may return any strides (CUDA's kernels write
    ``(B, T, h, d)`` memory), and then the rows cannot be regrouped without a copy."""
    *lead, h, Tq, d = q.shape
    return q.reshape(*lead, h_kv, h // h_kv * Tq, d)


def _rows_mask(m: Tensor | None, G: int) -> Tensor | None:
    """A mask ``(..., 1|Tq, Tk)`` over the rows layout's ``G·Tq`` rows (one per query row)."""
    if m is None or m.dim() < 2 or m.shape[-2] == 1:
        return m
    return m.unsqueeze(-3).expand(*m.shape[:-2], G, *m.shape[-2:]).flatten(-3, -2)


def torch_run(case: Case, mask: object, bias: object) -> Callable[..., Tensor] | None:
    """``run(q, k, v, mask, bias)``: torch SDPA for every call of this signature, its keyword
    arguments worked out once (``None`` where a mask must be built per call)."""
    kw = _torch_kwargs(case)
    if kw is None:
        return None
    sdpa = TF.scaled_dot_product_attention
    s = case.shape
    if not kw.get("is_causal") and _rows_ok(s.Tq, s.h, s.h_kv, mask, bias):
        kw.pop("enable_gqa")
        G, out = s.group, (*s.batch, s.h, s.Tq, s.d_v)
        return lambda q, k, v, mask, bias: sdpa(
            _as_rows(q, s.h_kv), k, v, attn_mask=_rows_mask(mask, G), **kw
        ).reshape(out)
    return lambda q, k, v, mask, bias: sdpa(q, k, v, attn_mask=mask, **kw)


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
    h, h_kv = q.shape[-3], k.shape[-3]
    gqa = h != h_kv
    is_causal = _passes_through(Tq, Tk, causal, window, mask is not None, bias is not None)
    rows = not is_causal and _rows_ok(Tq, h, h_kv, mask, bias)  # grouped rows (module docstring)
    if is_causal is not None and not rows:  # the mask as given: nothing to combine it with
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
    if rows:  # (no bias there)
        out = TF.scaled_dot_product_attention(
            _as_rows(q, h_kv), k, v, attn_mask=_rows_mask(allowed, h // h_kv),
            dropout_p=dropout_p, scale=scale,
        )  # fmt: skip
        return out.reshape(*q.shape[:-1], v.shape[-1])
    if bias is None:
        attn_mask = allowed
    elif allowed is None:
        attn_mask = bias.to(q.dtype)
    else:
        attn_mask = torch.where(allowed, bias.to(q.dtype), float("-inf"))
    return TF.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa,
    )  # fmt: skip
