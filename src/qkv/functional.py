"""Scaled dot-product attention, the reference math, step by step.

    Attention(Q, K, V) = softmax(Q Kᵀ · scale + bias, masked) · V,   scale = 1/√d_k

Shapes (the leading ``...`` is any batch shape, usually ``B``)::

    q        (..., h,    Tq, d_k)
    k        (..., h_kv, Tk, d_k)      h % h_kv == 0 (grouped / multi-query heads)
    v        (..., h_kv, Tk, d_v)
    mask     (Tq, Tk) or (..., h|1, Tq|1, Tk|1)   bool, **True = may attend**;
             or a qkv.masks.BlockMask (B|1, H|1, Tq, Tk) summarised per block
    bias     same shapes as mask, floating: added to the scaled scores
    alibi_slopes  (h,)              bias -slope_h·|p(i) - j| without a (Tq, Tk) tensor
    rel_bias      (h, Tq + Tk - 1)  bias rel_bias[h, Tk - 1 + j - p(i)] (relative positions)
    output   (..., h,    Tq, d_v)
    weights  (..., h,    Tq, Tk)

Order of operations: ``scores = q kᵀ`` → ``scaled = scores · scale`` → soft-capping
``c·tanh(scaled/c)`` → ``+ bias`` → mask (``-inf`` where not allowed) → softmax → dropout
→ ``weights · v``; for bf16/fp16 inputs all of it is computed in float32 (fp16 cannot hold
``q·kᵀ`` of moderate inputs) and only the results are rounded. A query row with no visible
key gets zero weights and a zero output (never NaN), and its gradients are zero. NaN and inf
in the inputs follow one rule on every backend (:mod:`qkv._nonfinite`): a NaN or ``+inf``
logit at a key a row may see makes the row NaN, ``-inf`` masks, and values at keys a row
may not see take no part.

Empty inputs: a zero batch dim, ``h``, ``Tq`` or ``Tk`` gives the same on every backend, an
output of zeros of shape ``(..., h, Tq, d_v)`` (with ``Tk = 0`` each query sees no key, so its
row is zero) and zero gradients; ``d_k = 0`` is a ``ValueError``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv import dispatch, masks
from qkv._nonfinite import scores_may_be_nonfinite, values_for_flash, values_for_kernel
from qkv._validate import (
    check_bias,
    check_block_mask,
    check_mask,
    check_options,
    check_per_head,
    check_qkv,
)
from qkv.block_mask import BlockMask
from qkv.cache import dequantize_rows
from qkv.dispatch import explain_dispatch
from qkv.kernels.decode import run_decode
from qkv.kernels.flash import _densify, run_flash
from qkv.kernels.reference import safe_softmax, weights_times_values
from qkv.weights import weights_from_lse

__all__ = [
    "AttentionSteps",
    "attention_steps",
    "explain_dispatch",
    "scaled_dot_product_attention",
    "structure_mask",
]


@dataclass
class AttentionSteps:
    """Every intermediate of one attention call (see the module docstring for shapes).

    ``mask`` is the combined boolean mask that was applied (True = may attend) or ``None``;
    ``masked`` holds ``-inf`` where attention is not allowed; ``lse`` is the log-sum-exp of
    each row of ``masked`` (``-inf`` for a row with no visible key).
    """

    q: Tensor
    k: Tensor  # (..., h, Tk, d_k), after repeating kv heads for GQA
    v: Tensor  # (..., h, Tk, d_v)
    scores: Tensor  # (..., h, Tq, Tk)  q kᵀ (float32 for bf16/fp16 inputs, as what follows)
    scale: float
    scaled: Tensor  # (..., h, Tq, Tk)  scores · scale (soft-capped, plus bias, when given)
    mask: Tensor | None  # broadcastable to (..., h, Tq, Tk)
    masked: Tensor  # (..., h, Tq, Tk)
    lse: Tensor  # (..., h, Tq)
    weights: Tensor  # (..., h, Tq, Tk)
    output: Tensor  # (..., h, Tq, d_v)


def structure_mask(
    Tq: int,
    Tk: int,
    *,
    causal: bool = False,
    window: int | None = None,
    device: torch.device | str | None = None,
) -> Tensor | None:
    """The ``(Tq, Tk)`` mask that ``causal``/``window`` describe (True = may attend), or None."""
    if window is not None:
        return masks.sliding_window(Tq, Tk, window, causal=causal, device=device)
    if causal:
        return masks.causal(Tq, Tk, device=device)
    return None


def repeat_kv(x: Tensor, group: int) -> Tensor:
    """``(..., h_kv, T, d)`` → ``(..., h_kv·group, T, d)``: query head i uses kv head i // group."""
    return x if group == 1 else x.repeat_interleave(group, dim=-3)


def attention_steps(
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
    dropout_p: float = 0.0,
) -> AttentionSteps:
    """Run the reference attention math and return every intermediate.

    Arguments are those of :func:`scaled_dot_product_attention` (mask: True = may attend).

    >>> q = torch.tensor([[[1.0, 2.0, 3.0]]])  # (h=1, Tq=1, d_k=3)
    >>> k = torch.tensor([[[2.0, 1.0, 0.0], [1.0, 2.0, 3.0]]])  # (1, Tk=2, 3)
    >>> attention_steps(q, k, k, scale=1.0).scores
    tensor([[[ 4., 14.]]])
    """
    shape = check_qkv(q, k, v)
    check_options(window=window, scale=scale, softcap=softcap, dropout_p=dropout_p, dtype=q.dtype)
    check_mask(mask, shape, q.device)
    check_bias(bias, shape, q.device)
    scale = 1.0 / math.sqrt(shape.d_k) if scale is None else float(scale)

    k = repeat_kv(k, shape.group)  # (..., h, Tk, d_k)
    v = repeat_kv(v, shape.group)  # (..., h, Tk, d_v)
    # fp32 for bf16/fp16 inputs: in fp16, q·kᵀ overflows from |q|, |k| ~ 35 at d_k = 64
    wide = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = q.to(wide) @ k.to(wide).transpose(-2, -1)  # (..., h, Tq, Tk)
    scaled = scores * scale
    if softcap is not None:
        scaled = softcap * torch.tanh(scaled / softcap)
    if bias is not None:  # a -inf bias masks its key, even where the score is +inf
        scaled = torch.where(bias == float("-inf"), bias, scaled + bias)
    structure = structure_mask(shape.Tq, shape.Tk, causal=causal, window=window, device=q.device)
    full_mask = masks.combine(mask, structure)
    masked = scaled if full_mask is None else scaled.masked_fill(~full_mask, float("-inf"))
    weights, lse = safe_softmax(masked)  # (fp32 for bf16/fp16, as the scores)
    attn = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    # in fp32 for bf16/fp16 as well: the backward's dO·vᵀ overflows fp16 from |v| ~ 1e4
    # values at keys a row may not see take no part, even a NaN there, and a row whose
    # logits are all -inf is zeros (see qkv._nonfinite)
    output = weights_times_values(attn, v.to(wide), full_mask, bias, lse).to(
        q.dtype
    )  # (..., h, Tq, d_v)
    weights = weights.to(q.dtype)
    return AttentionSteps(q, k, v, scores, scale, scaled, full_mask, masked, lse, weights, output)


def scaled_dot_product_attention(
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
    dropout_p: float = 0.0,
    return_weights: bool = False,
    weights_heads: list[int] | tuple[int, ...] | None = None,
    backend: str = "auto",
    alibi_slopes: Tensor | None = None,
    rel_bias: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention ``softmax(q kᵀ / √d_k) v`` with masks, biases and GQA.

    Args:
        q: queries ``(..., h, Tq, d_k)``.
        k: keys ``(..., h_kv, Tk, d_k)``; ``h % h_kv == 0`` gives grouped/multi-query heads.
        v: values ``(..., h_kv, Tk, d_v)``.
        mask: bool, **True = may attend**; ``(Tq, Tk)`` or as many dims as the scores
            ``(..., h, Tq, Tk)`` with 1 where shared. Never broadcast from fewer dims. Or a
            :class:`qkv.masks.BlockMask` (:func:`qkv.masks.create_block_mask`): the fused
            kernel skips its empty blocks and does not mask its full ones.
        bias: float, same shape rules as ``mask``; added to the scaled scores (ALiBi,
            relative positions).
        causal: query ``i`` sees keys ``j <= Tk - Tq + i`` (aligned bottom-right, so the
            last query sees every key: what a KV cache needs).
        window: sliding window; with ``causal`` each query sees its ``window`` most recent
            keys, without it the keys within ``window - 1`` on either side.
        scale: multiplies the scores; default ``1/√d_k``.
        softcap: soft-cap ``c·tanh(s/c)`` on the scaled scores (Gemma 2), before masking.
        dropout_p: dropout on the weights (pass 0 in eval).
        return_weights: also return the weights ``(..., h, Tq, Tk)``.
        weights_heads: with ``return_weights``, only these query heads' weights
            ``(..., len(weights_heads), Tq, Tk)``, recomputed from the fast path's log-sum-exp
            (without gradient) so the rest of the call stays fast.
        backend: ``"auto"`` (default), ``"math"``, ``"torch"``, ``"flash"`` or ``"decode"``; see
            :mod:`qkv.dispatch` for the rule table and :func:`explain_dispatch` for why.
        alibi_slopes: ``(h,)``, ALiBi (FlashAttention's keyword): adds
            ``-slope_h·|p(i) - j|`` (as :func:`qkv.masks.alibi_bias`) with no ``(Tq, Tk)``
            tensor on the fused kernel; the slopes get a gradient if they require one.
        rel_bias: ``(h, Tq + Tk - 1)``, a relative-position bias per head and distance:
            ``rel_bias[h, Tk - 1 + j - p(i)]`` is added to score ``(i, j)``; build it from a
            T5 bucket table with :func:`qkv.masks.t5_relative_bias`. Differentiable.

        With a block mask, ``alibi_slopes`` or ``rel_bias``, ``"auto"`` runs flash's fused
        kernel whenever it applies (fp32/bf16/fp16 on the CPU, no dropout, not every head's
        weights); other backends get the dense mask/bias (O(Tq·Tk)).

    Returns:
        ``output (..., h, Tq, d_v)``, or ``(output, weights)``. A row with no visible key
        gives zeros.

    >>> q = k = v = torch.randn(2, 4, 5, 8)  # (B, h, T, d_k)
    >>> scaled_dot_product_attention(q, k, v, causal=True).shape
    torch.Size([2, 4, 5, 8])
    """
    if weights_heads is not None and not return_weights:
        raise ValueError(
            "weights_heads selects heads of the returned weights: pass return_weights=True"
        )
    if isinstance(mask, BlockMask) or alibi_slopes is not None or rel_bias is not None:
        k, v = _widened(q, k, v)  # (the fused kernel reads no int8 rows)
        shape = check_qkv(q, k, v)
        if isinstance(mask, BlockMask):
            check_block_mask(mask, shape, q.device)
        check_per_head(alibi_slopes, rel_bias, shape, q.device)
        decision = dispatch.extras_decision(
            q.device, q.dtype, backend, empty=shape.empty, scale=scale, dropout_p=dropout_p,
            return_weights=return_weights, weights_heads=weights_heads,
        )  # fmt: skip
        why = decision if isinstance(decision, str) else None
        if why is None:
            v, exact = values_for_flash(
                v, mask=mask, bias=bias, causal=causal, window=window, Tq=shape.Tq
            )
            if not exact:
                why = _NONFINITE_VALUES
        if why is None:
            dispatch.logger.debug("sdpa backend=flash (fused): %s", dispatch.FUSED_EXTRAS)
            check_options(
                window=window, scale=scale, softcap=softcap, dropout_p=dropout_p, dtype=q.dtype
            )
            check_bias(bias, shape, q.device)
            out, lse = run_flash(
                q, k, v, mask=mask, bias=bias, causal=causal, window=window, scale=scale,
                softcap=softcap, alibi_slopes=alibi_slopes, rel_bias=rel_bias, return_lse=True,
            )  # fmt: skip
            if not return_weights:
                return out
            mask, bias = _densify(q, mask if isinstance(mask, BlockMask) else None,
                                  None if isinstance(mask, BlockMask) else mask, bias,
                                  alibi_slopes, rel_bias, shape)  # fmt: skip
            return out, weights_from_lse(
                q, k, lse, heads=weights_heads, mask=mask, bias=bias, causal=causal,
                window=window, scale=scale, softcap=softcap,
            )  # fmt: skip
        dispatch.logger.debug("sdpa: dense mask/bias (%s)", why)
        block_mask = mask if isinstance(mask, BlockMask) else None
        mask, bias = _densify(q, block_mask, None if block_mask else mask, bias, alibi_slopes,
                              rel_bias, shape)  # fmt: skip
    # describe + choose + the chosen backend's argument checks, remembered per call signature
    call = (mask, bias, causal, window, scale, softcap, dropout_p, return_weights, weights_heads)
    case, decision = dispatch._decide(q, k, v, backend, call)
    if case.kv_int8 and decision.backend != "decode":  # only the decode kernel reads int8 rows
        k, v = _widened(q, k, v)
        case, decision = dispatch._decide(q, k, v, backend, call)
    # NaN and inf: one rule on every backend (qkv._nonfinite); the look is one C++ pass
    if decision.look is not None and not decision.look(q, k, v, bias):
        v, exact = values_for_kernel(
            v, mask=mask, bias=bias, causal=causal, window=window, Tq=case.shape.Tq
        )
        scores = decision.backend == "torch" and not decision.lse_check  # (else run checks)
        if not exact or (scores and scores_may_be_nonfinite(q, k, bias)):
            reasons = {decision.backend: _NONFINITE_VALUES}
            decision = dispatch.Decision("math", backend, reasons, why=_NONFINITE_VALUES)
            k, v = _widened(q, k, v)  # an int8 cache's rows as the reference reads them
    if dispatch.logger.isEnabledFor(logging.DEBUG):
        dispatch.log_decision(decision, case)
    if decision.run is not None:  # torch SDPA's arguments or flash's plan, worked out once
        out = decision.run(q, k, v, mask, bias)
        if out is not None:
            return out
        # (lse_check) torch's log-sum-exp showed a NaN or inf from q or k
        decision = dispatch.Decision("math", backend, {"torch": _NONFINITE_VALUES},
                                     why=_NONFINITE_VALUES)  # fmt: skip
    if decision.backend == "torch":
        return dispatch.torch_sdpa(
            q, k, v, mask=mask, bias=bias, causal=causal, window=window, scale=scale,
            dropout_p=dropout_p,
        )  # fmt: skip
    options = dict(mask=mask, bias=bias, causal=causal, window=window, scale=scale, softcap=softcap)
    if decision.backend == "math":  # also every empty input (see dispatch.choose)
        steps = attention_steps(q, k, v, **options, dropout_p=dropout_p)
        if not return_weights:
            return steps.output
        weights = steps.weights
        if weights_heads is not None:
            weights = weights.index_select(-3, torch.as_tensor(weights_heads, device=q.device))
        return steps.output, weights
    if decision.backend == "decode":
        out, lse = run_decode(
            q, k, v, case.shape, mask=mask, causal=causal, window=window, scale=scale
        )
    else:
        out, lse = run_flash(q, k, v, **options, return_lse=True)
    if not return_weights:
        return out
    return out, weights_from_lse(q, k, lse, heads=weights_heads, **options)


def _widened(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """An int8 cache's packed rows (:mod:`qkv.cache`) as values in q's dtype; else as given."""
    if k.dtype == torch.int8 and v.dtype == torch.int8:
        return dequantize_rows(k, q.dtype), dequantize_rows(v, q.dtype)
    return k, v


_NONFINITE_VALUES = (
    "a NaN or inf in the inputs that only the reference keeps to the rule (qkv._nonfinite)"
)
