"""Every step of one attention call of a transformers model: the notes' walk, checked.

Inside :func:`record_call`, the attention adapter (:mod:`qkv.hf.attention`) keeps what one
chosen module hands it — the projected (and, for RoPE models, rotated) ``query``, ``key`` and
``value`` and the mask, bias, scale and soft-cap as qkv runs them — and hooks keep the
module's input and output. :func:`walk` then replays the call with
:func:`qkv.functional.attention_steps` (QKᵀ → scaled → masked → softmax → ·V), concatenates
the heads and applies the module's own output projection when it has one (``o_proj``,
``out_proj``, ...; BERT applies it outside the attention module), and reports how far that
replay is from what the module really returned (``check``).

Calls the adapter hands back to transformers (:func:`qkv.hf.attention.fallback_reason`) are
recorded too: :func:`fallback_replay` turns what transformers' eager or sdpa attention was
given into qkv's arguments that compute the same (the mask as eager adds it or sdpa applies
it, eager's repeated key/value heads, sdpa's causal flag, a common dtype), so their steps are
replayed with the same reference math; ``HFCall.fallback`` says why transformers computed the
call and ``check`` compares the replay with what it returned. A call cannot be replayed when
its mask is not a tensor (a flex-attention ``BlockMask``: no per-score matrix to read), its
mask does not broadcast to the scores, or its key/value heads pair with no query head even
after eager's repetition (transformers cannot run those two either); it is recorded with
``unavailable`` saying so. gpt-oss's sinks are replayed too
(``weights`` and ``output`` scaled by ``sigmoid(lse - sink)``, as the adapter computes them).

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
from qkv.hf.capture import attention_modules
from qkv.hf.masks import empty_rows, fill_empty_rows, fill_empty_weights
from qkv.hf.registry import running_qkv

__all__ = ["HFCall", "causal_mask", "fallback_replay", "output_projection", "record_call", "walk"]

# the output projection's name in the attention modules of transformers' models
_OUT_NAMES = ("o_proj", "out_proj", "out_lin", "c_proj", "o", "dense")


@dataclass
class HFCall:
    """One call of an attention module, as the attention function saw it."""

    module: nn.Module
    query: Tensor | None  # (B, h, Tq, d); None when ``unavailable``
    key: Tensor | None  # (B, h_kv, Tk, d)
    value: Tensor | None  # (B, h_kv, Tk, d_v)
    options: dict  # mask, bias, causal, scale, softcap: qkv's arguments for this call
    hidden: Tensor | None = None  # (B, Tq, d_model): the module's input
    context: Tensor | None = None  # (B, Tk, d_model): cross-attention's encoder states
    module_output: Tensor | None = None  # (B, Tq, d_out): what the module returned
    fallback: str | None = None  # why transformers computed the call itself (None: qkv did)
    unavailable: str | None = None  # why it cannot be replayed (query/key/value are None)


_RECORDING: ContextVar[tuple[nn.Module, list[HFCall]] | None] = ContextVar(
    "qkv_hf_record_call", default=None
)


def note(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, options: dict) -> None:
    """Called by the attention adapter for every call it computes itself (``options``: qkv's
    arguments, plus ``sinks`` for gpt-oss)."""
    rec = _RECORDING.get()
    if rec is not None and rec[0] is module:
        rec[1].append(HFCall(module, query.detach(), key.detach(), value.detach(),
                             {k: v for k, v in options.items() if k != "dropout_p"}))  # fmt: skip


def recording(module: nn.Module) -> bool:
    """Whether :func:`record_call` is recording ``module`` in this context."""
    rec = _RECORDING.get()
    return rec is not None and rec[0] is module


def note_fallback(module: nn.Module, reason: str, replay: tuple | str) -> None:
    """Called by the attention adapter for a call it hands to transformers: ``replay`` is
    :func:`fallback_replay`'s answer for it."""
    rec = _RECORDING.get()
    if rec is None or rec[0] is not module:
        return
    if isinstance(replay, str):
        rec[1].append(HFCall(module, None, None, None, {}, fallback=reason, unavailable=replay))
        return
    q, k, v, options = replay
    rec[1].append(HFCall(module, q.detach(), k.detach(), v.detach(), options, fallback=reason))


def fallback_replay(
    ran: str,
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: object,
    *,
    scaling: float | None,
    is_causal: bool | None,
    position_bias: Tensor | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, dict] | str:
    """qkv's arguments that compute what transformers' ``ran`` (``"eager"``: the model's own
    ``eager_attention_forward``, or ``"sdpa"``) computes for this call: ``(q, k, v, options)``
    for :func:`qkv.functional.attention_steps`, or a sentence saying why there are none.

    - the mask: a bool tensor stays qkv's ``mask`` (True = may attend; eager adds it as
      0/``finfo.min``, which gives the same weights); any other tensor is added to the scores,
      as eager adds it and sdpa applies a float mask (``bias``; an integer mask as its float
      values). It is made 4-D ``(B|1, h|1, Tq, Tk)`` (a longer key axis is cut to ``Tk``).
    - key/value heads that do not group with the query heads: repeated as eager's
      ``repeat_kv`` does (``module.num_key_value_groups``).
    - q, k, v of different dtypes: computed in their common dtype.
    - no mask, and the module causal with ``Tq > 1``: the causal mask transformers left out
      (:func:`causal_mask`; sdpa's ``is_causal``, and the adapter hands eager the same), the
      empty tail of a static cache cut off when sdpa ran, as sdpa does.
    - ``position_bias`` is added to the scores, ``softcap`` applied, ``scaling`` as given.
    - ``sinks`` (gpt-oss's ``s_aux``, one logit per head): kept in the options, as the adapter
      notes its own calls (:func:`walk` scales each row by ``sigmoid(lse - sink)``).
    """
    if attention_mask is not None and not isinstance(attention_mask, Tensor):
        return (f"the mask is a {type(attention_mask).__name__}, not a tensor: there is no "
                f"per-score mask to replay the call with")  # fmt: skip
    dtype = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    q, k, v = query.to(dtype), key.to(dtype), value.to(dtype)
    h = q.shape[1]
    if k.shape[1] != v.shape[1] or h % k.shape[1]:
        groups = getattr(module, "num_key_value_groups", 1)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if k.shape[1] != h or v.shape[1] != h:
            return (f"its {key.shape[1]} key and {value.shape[1]} value heads do not pair "
                    f"with its {h} query heads, even repeated as eager does")  # fmt: skip
    B, Tq, Tk = q.shape[0], q.shape[2], k.shape[2]
    mask = bias = None
    if attention_mask is not None:
        m = attention_mask
        m = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape)) if m.dim() < 4 else m
        m = m[..., :Tk] if m.dim() == 4 else m  # a mask over a longer cache: its first Tk
        if m.dim() != 4 or any(s not in (1, t) for s, t in zip(m.shape, (B, h, Tq, Tk))):
            return f"its mask of shape {tuple(attention_mask.shape)} is not (B, h, Tq, Tk)"
        if m.dtype == torch.bool:
            mask = m
        else:
            bias = m.to(dtype)
    elif Tq > 1 and bool(getattr(module, "is_causal", True) if is_causal is None else is_causal):
        if ran == "sdpa" and Tk > Tq:  # a static cache's empty tail, as sdpa cuts it
            k, v, Tk = k[:, :, :Tq], v[:, :, :Tq], Tq
            position_bias = None if position_bias is None else position_bias[..., :Tq]
        mask = causal_mask(Tq, Tk, q.device)  # what sdpa's is_causal and the eager route apply
    if position_bias is not None:
        pb = position_bias.to(dtype)
        bias = pb if bias is None else bias + pb
    options = dict(mask=mask, bias=bias, causal=False, scale=scaling, softcap=softcap)
    if sinks is not None:
        options["sinks"] = sinks.detach()
    return q, k, v, options


def causal_mask(Tq: int, Tk: int, device: torch.device) -> Tensor:
    """``(1, 1, Tq, Tk)`` bool, True = may attend: query ``i`` sees keys ``0..i`` (top-left, as
    torch's ``is_causal``; for ``Tk > Tq`` the keys after ``Tq`` are a static cache's empty
    tail, as the adapter reads a causal call without a mask)."""
    return torch.ones(Tq, Tk, dtype=torch.bool, device=device).tril()[None, None]


@contextmanager
def record_call(model: nn.Module, layer: str) -> Iterator[list[HFCall]]:
    """Record every call of attention module ``layer`` (a name from
    :func:`qkv.hf.attention_modules`) in this block; the model runs with
    ``attn_implementation="qkv"`` inside it. Calls that fall back to transformers' own
    attention are recorded with ``fallback`` set (see :func:`fallback_replay`)."""
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


def replayed(q: Tensor, k: Tensor, v: Tensor, options: dict) -> tuple:
    """``(steps, output, weights)`` of qkv's reference math on a call's arguments
    (``options``: :func:`fallback_replay`'s or the adapter's, ``sinks`` included), as the
    adapter computes them: gpt-oss's sink takes ``sigmoid(sink - lse)`` of each row (no
    value); otherwise a row that sees no key gets eager's even weights."""
    opts = {n: t for n, t in options.items() if n != "sinks"}
    sinks = options.get("sinks")
    s = attention_steps(q, k, v, **opts)
    output, weights = s.output, s.weights
    if sinks is not None:
        keep = torch.sigmoid(s.lse.float() - sinks.reshape(1, -1, 1).float())  # (1, h, Tq)
        keep = keep.to(weights.dtype).unsqueeze(-1)
        return s, output * keep, weights * keep
    empty = empty_rows(opts.get("mask"), k.shape[2])
    if empty is not None:
        output, weights = fill_empty_rows(empty, v, output), fill_empty_weights(empty, weights)
    return s, output, weights


@torch.no_grad()
def walk(call: HFCall, head: int) -> dict:
    """The steps of ``call`` for query head ``head`` (batch row 0).

    Returns tensors ``hidden`` (Tq, d_model) or None, ``context`` or None, ``q`` (Tq, d),
    ``k``, ``v`` (Tk, d) of the head's kv head, ``scores``, ``scaled``, ``mask`` (bool),
    ``masked``, ``weights`` (Tq, Tk), ``output`` (Tq, d_v), ``concat`` (Tq, h·d_v), ``wo``
    (Tq, d_model) or None, floats ``scale`` and ``check`` (largest difference between the
    replay and the module's real output; None when there is nothing to compare), ``fallback``
    (why transformers computed the call, or None) and ``sink`` (the head's sink logit, or
    None). A call recorded as ``unavailable`` is a ``ValueError`` that says why.
    """
    if call.unavailable is not None:
        raise ValueError(f"this call cannot be replayed: {call.unavailable}")
    q, k, v = call.query[:1], call.key[:1], call.value[:1]
    h, h_kv = q.shape[1], k.shape[1]
    if not 0 <= head < h:
        raise ValueError(f"head must be in [0, {h - 1}], got {head}")
    opts = dict(call.options)
    for name in ("mask", "bias"):
        if opts.get(name) is not None and opts[name].dim() == 4 and opts[name].shape[0] > 1:
            opts[name] = opts[name][:1]
    s, output, weights = replayed(q, k, v, opts)
    sinks = opts.get("sinks")
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
        "scale": s.scale, "check": check, "fallback": call.fallback,
        "sink": None if sinks is None else float(sinks.reshape(-1)[head]),
    }  # fmt: skip
