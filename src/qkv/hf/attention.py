"""The ``attn_implementation="qkv"`` adapter: transformers' attention call → qkv.

transformers' attention modules project and reshape, then call the function registered in
``AttentionInterface`` with one signature; :func:`qkv_attention_forward` maps it onto
:func:`qkv.functional.scaled_dot_product_attention`. Shapes::

    query         (B, h,    Tq, d)        keys/values come from the cache when there is one
    key, value    (B, h_kv, Tk, d)        h % h_kv == 0: grouped heads, never repeated here
    attention_mask  None, bool (B|1, 1, Tq, Tk) True = may attend  (from qkv.hf.masks.qkv_mask),
                    or a float additive mask (a 4-D mask the user built) → qkv ``bias``
    position_bias   (B|1, h, Tq, Tk) float (T5)                    → qkv ``bias``
    returns       (B, Tq, h, d), weights (B, h, Tq, Tk) when ``output_attentions`` else None

Arguments, as transformers passes them, and what qkv gets:

=====================  ==========================================================
transformers           qkv
=====================  ==========================================================
``attention_mask``     ``mask`` (bool) or ``bias`` (float); ``None`` see below
``scaling``            ``scale`` (T5 passes 1.0: its scores are not scaled)
``softcap``            ``softcap`` (Gemma 2), before the mask as in eager
``position_bias``      ``bias`` (+ a float mask when there is one)
``dropout``            ``dropout_p`` (transformers passes 0 in eval)
``is_causal``/module   with no mask: ``causal=True`` for ``Tq > 1`` (as sdpa)
``sliding_window``     already in the mask (a layer gets ``None`` only while
                       ``Tk < window``), as for sdpa
``output_attentions``  ``return_weights=True``: exact per-head weights
``s_aux`` (sinks)      one extra logit per head with no value (gpt-oss): the output
                       and weights scaled by ``sigmoid(lse - sink)``
=====================  ==========================================================

A query whose bool mask hides every key gets eager's answer, not qkv's zeros: weights
``1/Tk`` on every key, the mean of the values (see :mod:`qkv.hf.masks`); with sinks eager's
answer is zeros, as qkv's.

``None`` mask: transformers skips building the mask exactly when sdpa's ``is_causal`` (or no
mask) means the same; qkv's ``causal=True`` is aligned bottom-right, which is the same for
``Tq == Tk`` and for one query over a cache. The one other case, a static cache's prefill
(``Tk > Tq``, the cache's tail still empty), is cut to the first ``Tq`` keys, as sdpa does.

What falls back (one ``warnings.warn`` per reason per process, then transformers' own path):
paged caches (continuous batching), a mask that is neither bool nor float or does not
broadcast as ``(B|1, h|1, Tq, Tk)``, and q/k/v of different dtypes or head counts that do
not group. Such a call is still seen: :func:`qkv.hf.steps.fallback_replay` states it as qkv
arguments, which :func:`qkv.hf.steps.record_call` records for the step-by-step replay and
:func:`qkv.hf.capture_attention` uses for the weights when sdpa (which returns none) ran it.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn

from qkv.functional import attention_steps, scaled_dot_product_attention
from qkv.hf import capture as _capture
from qkv.hf import steps as _steps
from qkv.hf.ablate import zero_heads
from qkv.hf.masks import eager_empty_rows, empty_rows, fill_empty_rows, fill_empty_weights
from qkv.kernels.flash import flash_attention
from qkv.weights import weights_from_lse

__all__ = ["qkv_attention_forward", "fallback_reason"]

_WARNED: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(
            f"attn_implementation='qkv': {reason}; using transformers' own attention for it",
            stacklevel=3,
        )


def fallback_reason(
    query: Tensor, key: Tensor, value: Tensor, attention_mask: object, kwargs: dict
) -> tuple[str, str] | None:
    """``(reason, "eager" | "sdpa")`` when qkv cannot run this call exactly, else ``None``."""
    cache = kwargs.get("cache")
    if cache is not None and type(cache).__name__ == "PagedAttentionCache":
        return "paged attention caches (continuous batching) are not supported by qkv", "sdpa"
    if not (query.dtype == key.dtype == value.dtype):
        return f"q/k/v dtypes differ ({query.dtype}, {key.dtype}, {value.dtype})", "eager"
    h, h_kv = query.shape[1], key.shape[1]
    if h_kv == 0 or h % h_kv or value.shape[1] != h_kv:
        return f"query heads ({h}) are not a multiple of key/value heads ({h_kv})", "eager"
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor):
        return f"attention masks of type {type(attention_mask).__name__}", "sdpa"
    if attention_mask.dtype != torch.bool and not attention_mask.dtype.is_floating_point:
        return f"attention masks of dtype {attention_mask.dtype} (not bool/float)", "eager"
    B, Tq, Tk = query.shape[0], query.shape[2], key.shape[2]
    target = (B, h, Tq, Tk)
    if attention_mask.dim() != 4 or any(
        s not in (1, t) for s, t in zip(attention_mask.shape, target)
    ):
        return f"attention masks of shape {tuple(attention_mask.shape)} (not (B|1, h|1, Tq, Tk))", (
            "sdpa"
        )
    return None


def _eager_function(module: nn.Module) -> Callable | None:
    """The model's own ``eager_attention_forward``, or None (then sdpa runs the call)."""
    modeling = sys.modules.get(type(module).__module__)
    return getattr(modeling, "eager_attention_forward", None)


def _fallback(
    how: str, module: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask, **kwargs
) -> tuple[Tensor, Tensor | None]:
    """Run transformers' ``eager`` (the model's own function) or ``sdpa`` attention."""
    if how == "eager":
        fn = _eager_function(module)
        if fn is not None:
            causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
            if mask is None and causal and query.shape[2] > 1:  # eager masks only with a mask:
                mask = _steps.causal_mask(query.shape[2], key.shape[2], query.device)  # sdpa's
            if isinstance(mask, Tensor) and mask.dtype == torch.bool:  # eager adds the mask
                mask = torch.zeros_like(mask, dtype=query.dtype).masked_fill(
                    ~mask, torch.finfo(query.dtype).min
                )
            return fn(module, query, key, value, mask, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, mask, **kwargs)


def qkv_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: Tensor | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """transformers' attention-function signature, computed by qkv (see the module docstring).

    Args:
        module: the calling attention module (``is_causal``, ``training`` are read from it).
        query: ``(B, h, Tq, d)``; key, value: ``(B, h_kv, Tk, d)``.
        attention_mask: ``None``, bool ``(B|1, 1, Tq, Tk)`` True = may attend, or float
            additive.
        dropout: dropout probability on the weights; scaling: score scale (``None``:
            ``1/√d``); is_causal: overrides ``module.is_causal``; position_bias: float
            ``(B|1, h, Tq, Tk)`` added to the scaled scores; softcap: ``c·tanh(s/c)``.
        kwargs: the rest of what the model passes (``output_attentions``, ``s_aux``,
            ``sliding_window``, cache positions...).

    Returns:
        ``(output (B, Tq, h, d), weights (B, h, Tq, Tk) or None)``; the heads switched off by
        :func:`qkv.hf.ablate.heads_off` have zero output.
    """
    out, weights = _attention(module, query, key, value, attention_mask, dropout, scaling,
                              is_causal, position_bias, softcap, **kwargs)  # fmt: skip
    return zero_heads(module, out), weights  # (B, Tq, h, d)


def _attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float,
    scaling: float | None,
    is_causal: bool | None,
    position_bias: Tensor | None,
    softcap: float | None,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    recorder = _capture.active()
    heads = None if recorder is None else recorder.heads_for(module, query.shape[1])
    why = fallback_reason(query, key, value, attention_mask, kwargs)
    if why is not None:
        reason, how = why
        _warn_once(reason)
        extra = {"position_bias": position_bias} if position_bias is not None else {}
        if softcap is not None:
            extra["softcap"] = softcap
        if is_causal is not None:
            extra["is_causal"] = is_causal
        ran = "eager" if how == "eager" and _eager_function(module) is not None else "sdpa"
        replay = None
        if _steps.recording(module) or (heads is not None and ran != "eager"):
            replay = _steps.fallback_replay(ran, module, query, key, value, attention_mask,
                                            scaling=scaling, is_causal=is_causal,
                                            position_bias=position_bias, softcap=softcap,
                                            sinks=kwargs.get("s_aux"))  # fmt: skip
            _steps.note_fallback(module, f"{reason} (transformers' {ran} computed it)", replay)
        out, weights = _fallback(how, module, query, key, value, attention_mask, dropout=dropout,
                                 scaling=scaling, **extra, **kwargs)  # fmt: skip
        if heads is not None:
            causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
            if ran == "eager":  # eager returns every head's weights
                picked = weights.detach().index_select(1, _index(heads, weights))
            elif isinstance(replay, str):
                raise RuntimeError(f"cannot capture attention weights here: {reason}; {replay}")
            else:  # sdpa returns none: qkv's reference math on what sdpa was given
                picked = _steps.replayed(*replay)[2].detach()
                picked = picked.index_select(1, _index(heads, picked))
            recorder.record(module, picked, heads, causal=causal)
        return out, weights

    Tq, Tk = query.shape[2], key.shape[2]
    mask = bias = None
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            mask = attention_mask
        else:  # an additive float mask (0 / large negative), as eager adds it
            bias = attention_mask.to(query.dtype)
    if position_bias is not None:
        bias = position_bias if bias is None else position_bias + bias
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal = bool(is_causal) and Tq > 1 and attention_mask is None
    if causal and Tk > Tq:  # static-cache prefill: the keys after Tq are the empty cache (as sdpa)
        key, value = key[:, :, :Tq], value[:, :, :Tq]  # (B, h_kv, Tq, d)
        bias = None if bias is None else bias[..., :Tq]

    options = dict(mask=mask, bias=bias, causal=causal, scale=scaling, softcap=softcap,
                   dropout_p=float(dropout))  # fmt: skip
    full = bool(kwargs.get("output_attentions", False))
    sinks = kwargs.get("s_aux")
    # for qkv.hf.steps.record_call: the call as qkv runs it
    _steps.note(module, query, key, value,
                options if sinks is None else {**options, "sinks": sinks.detach()})  # fmt: skip
    if sinks is not None:  # eager's sink takes all of an empty row's weight: zeros, as here
        out, weights, picked = _with_sinks(query, key, value, sinks, full, heads, options)
        if heads is not None:
            recorder.record(module, picked, heads, causal=bool(is_causal))
        return out.transpose(1, 2).contiguous(), weights
    # rows that see no key: qkv gives zeros, eager the mean of the values (qkv.hf.masks)
    empty = empty_rows(mask, key.shape[2])
    weights = None
    if full:
        out, weights = scaled_dot_product_attention(query, key, value, **options,
                                                    return_weights=True)  # fmt: skip
        if empty is not None:
            weights = fill_empty_weights(empty, weights)
        if heads is not None:
            recorder.record(module, weights.detach().index_select(1, _index(heads, weights)),
                            heads, causal=bool(is_causal))  # fmt: skip
    elif heads is not None:
        out, picked = scaled_dot_product_attention(
            query, key, value, **options, return_weights=True, weights_heads=heads
        )
        if empty is not None:
            picked = fill_empty_weights(empty, picked, heads)
        recorder.record(module, picked, heads, causal=bool(is_causal))
    else:
        out = scaled_dot_product_attention(query, key, value, **options)
    if empty is not None:
        grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (query, key, value, bias)
        )
        if grad:  # eager's gradients into q, k and the bias too
            out = eager_empty_rows(empty, query, key, value, out, bias=bias, scale=scaling,
                                   softcap=softcap)  # fmt: skip
        else:
            out = fill_empty_rows(empty, value, out)
    return out.transpose(1, 2).contiguous(), weights  # (B, Tq, h, d)


def _with_sinks(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    sinks: Tensor,
    full: bool,
    heads: list[int] | None,
    options: dict,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Attention with one learned sink logit per head (gpt-oss): ``softmax([s, sink])``.

    The sink takes a share of each row's probability and contributes no value, so with the
    row's log-sum-exp ``lse`` over the real keys, every weight and the output are scaled by
    ``keep = e^lse / (e^lse + e^sink) = sigmoid(lse - sink)`` (0 for a row with no key).
    Prefill without gradients or dropout runs qkv's flash kernel, which returns ``lse`` (the
    chosen heads' weights are recomputed from it); decoding (``Tq = 1``), training and
    ``output_attentions`` run the reference math, which has ``lse`` and every weight.

    Returns ``(output (B, h, Tq, d), all weights or None, the chosen heads' weights or None)``.
    """
    h = query.shape[1]
    sink = sinks.reshape(1, h, 1).float()  # (1, h, 1)
    bias = options["bias"]
    grad = torch.is_grad_enabled() and (
        any(t.requires_grad for t in (query, key, value, sinks))
        or (bias is not None and bias.requires_grad)
    )
    if not (full or grad or options["dropout_p"] > 0) and query.shape[2] > 1:
        flash = {k: v for k, v in options.items() if k != "dropout_p"}
        out, lse = flash_attention(query, key, value, **flash, return_lse=True)
        keep = torch.sigmoid(lse.float() - sink)  # (B, h, Tq)
        out = out * keep.unsqueeze(-1).to(out.dtype)
        if heads is None:
            return out, None, None
        picked = weights_from_lse(query, key, lse, heads=heads, **flash)  # (B, n, Tq, Tk)
        return out, None, picked * keep[:, heads].unsqueeze(-1).to(picked.dtype)
    steps = attention_steps(query, key, value, **options)
    keep = torch.sigmoid(steps.lse.float() - sink).to(query.dtype).unsqueeze(-1)  # (B, h, Tq, 1)
    weights = steps.weights * keep
    picked = None if heads is None else weights.detach()[:, heads]
    return steps.output * keep, (weights if full else None), picked


def _index(heads: list[int], like: Tensor) -> Tensor:
    return torch.as_tensor(heads, device=like.device, dtype=torch.long)
