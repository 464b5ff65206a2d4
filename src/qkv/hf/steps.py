"""Every step of one attention call of a transformers model: the notes' walk, checked.

Inside :func:`record_call`, the attention adapter (:mod:`qkv.hf.attention`) keeps what one
chosen module hands it — the projected (and, for RoPE models, rotated) ``query``, ``key`` and
``value`` and the mask, bias, scale and soft-cap as qkv runs them — and hooks keep the
module's input and output. :func:`walk` then replays the call with
:func:`qkv.functional.attention_steps` (QKᵀ → scaled → masked → softmax → ·V), concatenates
the heads and applies the module's own output projection when it has one (``o_proj``,
``out_proj``, ...; BERT applies it outside the attention module), and reports how far that
replay is from what the module really returned (``check``).

>>> with record_call(model, "model.layers.0.self_attn") as calls:   # doctest: +SKIP
...     model(ids)
>>> w = walk(calls[0], head=1)                                      # doctest: +SKIP
>>> w["weights"].shape  # (Tq, Tk) of head 1                          # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.functional import attention_steps
from qkv.hf.ablate import zero_heads
from qkv.hf.masks import empty_rows, fill_empty_rows, fill_empty_weights

__all__ = ["HFCall", "output_projection", "record_call", "walk"]

# the output projection's name in the attention modules of transformers' models
_OUT_NAMES = ("o_proj", "out_proj", "out_lin", "c_proj", "o", "dense")


@dataclass
class HFCall:
    """One call of an attention module, as the attention function saw it."""

    module: nn.Module
    query: Tensor  # (B, h, Tq, d)
    key: Tensor  # (B, h_kv, Tk, d)
    value: Tensor  # (B, h_kv, Tk, d_v)
    options: dict  # mask, bias, causal, scale, softcap: qkv's arguments for this call
    hidden: Tensor | None = None  # (B, Tq, d_model): the module's input
    context: Tensor | None = None  # (B, Tk, d_model): cross-attention's encoder states
    module_output: Tensor | None = None  # (B, Tq, d_out): what the module returned


_RECORDING: ContextVar[tuple[nn.Module, list[HFCall]] | None] = ContextVar(
    "qkv_hf_record_call", default=None
)


def note(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, options: dict) -> None:
    """Called by the attention adapter for every call it computes itself."""
    rec = _RECORDING.get()
    if rec is not None and rec[0] is module:
        rec[1].append(HFCall(module, query.detach(), key.detach(), value.detach(),
                             {k: v for k, v in options.items() if k != "dropout_p"}))  # fmt: skip


@contextmanager
def record_call(model: nn.Module, layer: str) -> Iterator[list[HFCall]]:
    """Record every call of attention module ``layer`` (a name from
    :func:`qkv.hf.attention_modules`) in this block; the model runs with
    ``attn_implementation="qkv"`` inside it. Calls that fall back to transformers' own
    attention are not recorded."""
    from qkv.hf import running_qkv
    from qkv.hf.capture import attention_modules

    modules = dict(attention_modules(model))
    if layer not in modules:
        raise ValueError(f"layer must be one of {list(modules)}, got {layer!r}")
    module = modules[layer]
    calls: list[HFCall] = []
    pending: list[tuple[int, Tensor | None, Tensor | None]] = []  # per open forward call

    def before(_m, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        context = kwargs.get("key_value_states", kwargs.get("encoder_hidden_states"))
        pending.append((len(calls), hidden, context))

    def after(_m, args, kwargs, out):
        index, hidden, context = pending.pop()
        if index < len(calls):  # the adapter noted this call (not a fallback)
            call = calls[index]
            call.hidden = None if hidden is None else hidden.detach()
            call.context = None if context is None else context.detach()
            call.module_output = (out[0] if isinstance(out, tuple) else out).detach()

    with running_qkv(model):
        hooks = [module.register_forward_pre_hook(before, with_kwargs=True),
                 module.register_forward_hook(after, with_kwargs=True)]  # fmt: skip
        token = _RECORDING.set((module, calls))
        try:
            yield calls
        finally:
            _RECORDING.reset(token)
            for h in hooks:
                h.remove()


def output_projection(module: nn.Module, width: int) -> nn.Module | None:
    """The module's own output projection taking the ``width`` concatenated head features,
    or None (BERT's lives outside its attention module)."""
    for name in _OUT_NAMES:
        proj = getattr(module, name, None)
        if proj is None or not isinstance(proj, nn.Module):
            continue
        w = getattr(proj, "weight", None)
        if w is None or w.dim() != 2:
            continue
        # nn.Linear stores (out, in); GPT-2's Conv1D stores (in, out)
        fan_in = w.shape[0] if type(proj).__name__ == "Conv1D" else w.shape[1]
        if fan_in == width:
            return proj
    return None


@torch.no_grad()
def walk(call: HFCall, head: int) -> dict:
    """The steps of ``call`` for query head ``head`` (batch row 0).

    Returns tensors ``hidden`` (Tq, d_model) or None, ``context`` or None, ``q`` (Tq, d),
    ``k``, ``v`` (Tk, d) of the head's kv head, ``scores``, ``scaled``, ``mask`` (bool),
    ``masked``, ``weights`` (Tq, Tk), ``output`` (Tq, d_v), ``concat`` (Tq, h·d_v), ``wo``
    (Tq, d_model) or None, and floats ``scale`` and ``check`` (largest difference between the
    replay and the module's real output; None when there is nothing to compare).
    """
    q, k, v = call.query[:1], call.key[:1], call.value[:1]
    h, h_kv = q.shape[1], k.shape[1]
    if not 0 <= head < h:
        raise ValueError(f"head must be in [0, {h - 1}], got {head}")
    opts = dict(call.options)
    for name in ("mask", "bias"):
        if opts.get(name) is not None and opts[name].shape[0] > 1:
            opts[name] = opts[name][:1]
    s = attention_steps(q, k, v, **opts)
    output, weights = s.output, s.weights
    empty = empty_rows(opts.get("mask"), k.shape[2])
    if empty is not None:  # rows that see no key: eager's even weights, as the adapter gives
        output, weights = fill_empty_rows(empty, v, output), fill_empty_weights(empty, weights)
    out = zero_heads(call.module, output.transpose(1, 2))  # (1, Tq, h, d_v): ablation kept
    concat = out.reshape(1, out.shape[1], -1)  # (1, Tq, h·d_v)
    proj = output_projection(call.module, concat.shape[-1])
    wo = None if proj is None else proj(concat.to(call.query.dtype))  # (1, Tq, d_model)
    replay = concat if proj is None else wo
    real = call.module_output
    check = None
    if real is not None and real.shape[1:] == replay.shape[1:]:
        check = float((replay.float() - real[:1].float()).abs().max())
    mask = s.mask
    if mask is not None:
        mask = mask.expand(s.scores.shape)[0, head]  # (Tq, Tk)
    kv = head // (h // h_kv)
    return {
        "hidden": None if call.hidden is None else call.hidden[0],
        "context": None if call.context is None else call.context[0],
        "q": q[0, head], "k": k[0, kv], "v": v[0, kv],
        "scores": s.scores[0, head], "scaled": s.scaled[0, head], "mask": mask,
        "masked": s.masked[0, head], "weights": weights[0, head],
        "output": out[0, :, head], "concat": concat[0], "wo": None if wo is None else wo[0],
        "scale": s.scale, "check": check,
    }  # fmt: skip
