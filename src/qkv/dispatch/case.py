"""What the dispatcher looks at for one call: its :class:`Case` (shapes, dtypes, options and,
when gradients are needed, a bound of the scores)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qkv._validate import AttentionShape, check_heads, check_qkv
from qkv.kernels._native import native_module
from qkv.kernels.decode import as_unpacked


@dataclass(frozen=True)
class Case:
    """What the dispatcher looks at for one call."""

    shape: AttentionShape
    dtype: torch.dtype
    has_mask: bool
    has_bias: bool
    bias_requires_grad: bool
    causal: bool
    window: int | None
    softcap: float | None
    dropout_p: float
    return_weights: bool
    weights_heads: tuple[int, ...] | None
    device: str = "cpu"
    grad: bool = False  # autograd will need gradients of q, k or v
    logit_bound: float = 0.0  # an upper bound of |scores| (computed only when grad is needed)
    scale: float | None = None
    kv_int8: bool = False  # k/v are an int8 cache's packed rows (qkv.cache)


def describe(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    causal: bool = False,
    window: int | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    weights_heads: list[int] | tuple[int, ...] | None = None,
    scale: float | None = None,
) -> Case:
    """The :class:`Case` of a call with these arguments (``k``/``v`` may be an int8 cache's
    packed rows, :mod:`qkv.cache`)."""
    kv_int8 = isinstance(k, Tensor) and isinstance(v, Tensor) and torch.int8 in (k.dtype, v.dtype)
    if kv_int8:
        if k.dtype != v.dtype:
            raise TypeError(f"k and v must both be int8 rows or neither, got {k.dtype}, {v.dtype}")
        k, v = as_unpacked(k, q), as_unpacked(v, q)  # stand-ins: only their metadata is read
    shape = check_qkv(q, k, v)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    bound = 0.0
    if grad and not shape.empty and not kv_int8:
        bound = max(_logit_bound(q, k, scale), _bias_bound(bias))
    return Case(
        shape=shape,
        dtype=q.dtype,
        has_mask=mask is not None,
        has_bias=bias is not None,
        bias_requires_grad=bias is not None and bias.requires_grad,
        causal=bool(causal),
        window=window,
        softcap=softcap,
        dropout_p=float(dropout_p),
        return_weights=bool(return_weights),
        weights_heads=check_heads(weights_heads, shape.h),
        device=q.device.type,
        grad=grad,
        logit_bound=bound,
        scale=scale,
        kv_int8=kv_int8,
    )


def _logit_bound(q: Tensor, k: Tensor, scale: float | None) -> float:
    """An upper bound of |scores|: ``|q·k|·scale <= max|q|·max|k|·d_k·scale``.

    One pass of the fused kernel's ``max_abs_product`` over q and k on the CPU (~0.5 µs), else
    one ``aminmax`` per tensor (~6 µs for both; abs + amax took 9 µs).
    """
    d_k = q.shape[-1]
    sc = scale if scale is not None else d_k**-0.5
    if q.is_cpu and k.is_cpu:
        module = native_module()
        if module is not None:
            return module.max_abs_product(q, k) * d_k * sc
    (q_lo, q_hi), (k_lo, k_hi) = torch.aminmax(q.detach()), torch.aminmax(k.detach())
    return max(-float(q_lo), float(q_hi)) * max(-float(k_lo), float(k_hi)) * d_k * sc


def _bias_bound(bias: object) -> float:
    """How far below zero the highest entry of a float bias's row lies, for rows whose entries
    are all finite and negative (0 without such rows).

    A row hidden by a huge finite value (``finfo.min`` instead of -inf) has scores of that
    size: its fp32 log-sum-exp ``m + log l`` loses ``log l`` next to ``|m| ~ 3e38``, and the
    backward of torch and flash, which rebuilds the weights from it, gives gradients ``Tk``
    times too large (the forward is right). One pass over the bias, with gradients only.
    """
    if not isinstance(bias, Tensor) or not bias.is_floating_point() or bias.numel() == 0:
        return 0.0
    top = bias.detach().amax(-1)
    top = top[torch.isfinite(top)]
    low = float(top.min()) if top.numel() else 0.0
    return -low if low < 0 else 0.0
