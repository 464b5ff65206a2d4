"""What the prepared decoders (:class:`~qkv.models.incremental.IncrementalDecoder`,
:class:`~qkv.models.lm_decoder.LMDecoder`) share: :class:`PreparedSteps`, their base.

* the preparation cached per model, beside it (rebuilt when a weight or an attention backend
  changes), and :func:`_unprepared`, what keeps any prepared decoder from running a model;
* the embedding and output ends, the residual sub-layers (pre-LN or post-LN);
* attention through the path :func:`qkv.functional.scaled_dot_product_attention` would choose
  (``qkv.dispatch``), resolved once per kind of call and key length range instead of per
  step; the decode kernel reads reordered beams and remaining sentences in place, any other
  path gets them gathered first (:func:`_gather`).

Shapes: ``q (N, h, Tq, d_k)``, ``k, v (N', h_kv, Tk, d_k)`` (``N' >= N``: rows that left the
batch stay in the cache); the source mask bool ``(B, 1, 1, S)``, True = may attend.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as TF
from torch import Tensor, nn

from qkv import dispatch
from qkv import functional as F
from qkv._validate import AttentionShape
from qkv._versions import version
from qkv.attention import MultiHeadAttention
from qkv.cache import dequantize_rows
from qkv.kernels._native import decode_ops
from qkv.kernels._settings import check_decode
from qkv.kernels.decode import _mask_arg
from qkv.kernels.int8 import Int8Linear
from qkv.models.decode_state import DecodeState
from qkv.models.prepared_weights import _prepared
from qkv.positional import RotaryEmbedding

__all__ = ["PreparedSteps"]


def _gather(x: Tensor, rows: Tensor) -> Tensor:
    """``out[b, :, p] = x[rows[b, p], :, p]`` for ``x (N, h, T, d)``: the keys or values of
    beams reordered through a table, as one tensor (paths other than the decode kernel)."""
    T = x.shape[2]
    pos = torch.arange(T, device=x.device)
    return x.transpose(1, 2)[rows[:, :T], pos].transpose(1, 2)  # (N, h, T, d)


def _unprepared(model: nn.Module, embedding: Tensor, attention: list | None,
                modules: list | None) -> str | None:  # fmt: skip
    """What keeps any prepared decoder from running ``model`` (``None``: nothing)."""
    if model.training:
        return "model in training mode (dropout)"
    if attention is None:
        attention = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    for m in attention:
        if m.recorder is not None or m.head_mask is not None:
            return "an inspection hook (recorder/head_mask) is set"
        if m.position is not None and not isinstance(m.position, RotaryEmbedding):
            return f"position {type(m.position).__name__} inside attention"
    w = embedding
    if w.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return f"weights of dtype {w.dtype}"
    int8 = {isinstance(m, Int8Linear) for m in (model.modules() if modules is None else modules)
            if isinstance(m, (nn.Linear, Int8Linear))}  # fmt: skip
    if len(int8) > 1:
        return "int8 and float linear layers mixed (quantize_linears with skip=)"
    if True in int8 and w.dtype != torch.float32:
        return "int8 linear layers in a model that is not fp32"
    return None


# model → its prepared decoder, kept beside the model (not on it: copying or pickling the model
# must not meet oneDNN's opaque packed weights), dropped with the model
_PREPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _state_key(model: nn.Module, children: list[nn.Module], attention: list) -> tuple:
    """What the prepared copy depends on: every weight (replaced or written in place) and
    each attention's backend. A weight made under ``torch.inference_mode()`` has no version:
    it counts as unchanged while it stays at the same address (preparing the model again at
    every call would cost more than the call)."""
    weights = tuple(
        (id(p), p.data_ptr(), version(p)) for m in (model, *children)
        for p in (*m._parameters.values(), *m._buffers.values()) if p is not None
    )  # fmt: skip
    return weights, tuple(m.backend for m in attention)


class PreparedSteps:
    """What the prepared decoders (:class:`~qkv.models.incremental.IncrementalDecoder`,
    :class:`~qkv.models.lm_decoder.LMDecoder`) share: the cached preparation per model, the
    embedding and output ends, residual sub-layers, and attention resolved once per kind of
    call. A subclass defines :meth:`unsupported` and prepares its layers after
    :meth:`_prepare_ends`."""

    pre_norm: bool
    scale: float

    def _prepare_ends(self, cfg, embed: nn.Module, norm: nn.Module, out: nn.Module) -> None:
        """Sizes, the token embedding and positions, the final norm and the output layer."""
        self.d, self.h, self.h_kv, self.d_k = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.d_k
        self.pre_norm = cfg.norm_first
        self.scale = 1.0 / math.sqrt(cfg.d_k)  # the default of qkv's attention
        # the embedding times √d_model, once: the same products the Embedder takes per token
        self.embedding = embed.embedding.weight.detach() * math.sqrt(cfg.d_model)  # (V, d)
        self.position = embed.position  # sinusoidal / learned module, or None (rope)
        self.final_norm = None
        if isinstance(norm, nn.LayerNorm):
            self.final_norm = (norm.weight.detach(), norm.bias.detach(), norm.eps)
        self.out = _prepared(out)

    @staticmethod
    def unsupported(model: nn.Module, attention: list | None = None,
                    modules: list | None = None) -> str | None:  # fmt: skip
        """Why this kind of prepared decoder cannot run ``model`` (``None``: it can)."""
        raise NotImplementedError

    @classmethod
    def for_model(cls, model: nn.Module):
        """The prepared decoder of ``model`` (kept while its weights and attention backends
        stay the same), or ``None`` where :meth:`unsupported` says it cannot run the model."""
        held = _PREPARED.get(model)
        if held is not None:
            kind, children, attention, key, made = held
            if (kind is cls and cls.unsupported(model, attention, children) is None
                    and _state_key(model, children, attention) == key):  # fmt: skip
                return made
        children = list(model.modules())[1:]  # not the model itself: the entry must not keep it
        attention = [m for m in children if isinstance(m, MultiHeadAttention)]
        if cls.unsupported(model, attention, children) is not None:
            return None
        made = cls(model)
        _PREPARED[model] = (cls, children, attention, _state_key(model, children, attention), made)
        return made

    def _sub_in(self, x: Tensor, norm: tuple[Tensor, Tensor, float]) -> Tensor:
        """A sublayer's input: normalised first in pre-LN, as is in post-LN."""
        return torch.layer_norm(x, x.shape[-1:], *norm) if self.pre_norm else x

    def _sub_out(self, x: Tensor, y: Tensor, norm: tuple[Tensor, Tensor, float]) -> Tensor:
        """The residual after a sublayer: ``x + y`` in pre-LN, normalised after in post-LN.

        ``x`` is the decoder's own running activation (made by this class, needed no more):
        the sum is written into it."""
        x = x.add_(y)
        return x if self.pre_norm else torch.layer_norm(x, x.shape[-1:], *norm)

    def _attend(self, kind: str, backend: str, q: Tensor, k: Tensor, v: Tensor,
                mask: Tensor | None, state: DecodeState | None, rows: Tensor | None = None,
                batch: Tensor | None = None) -> Tensor:  # fmt: skip
        """Attention as ``qkv.functional`` would run it, its path resolved once per kind and
        key-length range (``Tk`` up to the next power of two) of a call, not per step.

        ``rows (N, >= Tk)``: batch row ``rows[b, p]`` of ``k``/``v`` holds row ``b``'s
        key/value at position ``p`` (beams reordered without copying the cache); ``batch
        (N,)``: batch row ``batch[b]`` of ``k``/``v`` is row ``b``'s (sentences that finished
        left the batch, the cache was not compacted). The decode kernel reads them there;
        any other path gets them gathered first."""
        choices = state.choices if state is not None else {}
        key = (kind, k.shape[-2].bit_length())
        choice = choices.get(key)
        if choice is None:  # shapes, dtype and backend are fixed for a state: only Tk grows
            n = q.shape[0]  # k and v may hold more batch rows than q (see rows, batch)
            # described as the call they make (only metadata is read): int8 rows as int8 rows
            # (the dispatcher's rule table sends them to the decode kernel), a cache in another
            # dtype as widened to q's
            like = [(t if t.dtype == torch.int8 else q).new_zeros(()).expand(t[:n].shape)
                    for t in (k, v)]  # fmt: skip
            case = dispatch.describe(q, *like, mask=mask, causal=kind == "self")
            choice = choices[key] = dispatch.choose(case, backend).backend
        if choice == "decode" and k.shape[-2] > 0 and (k.dtype in (q.dtype, torch.int8) or (
                q.dtype == torch.float32 and k.dtype == torch.bfloat16)):  # fmt: skip
            # a bf16 or int8 cache is read as it is stored: the bytes a step reads halve or
            # quarter (widening it first would read it, write it wide and read that again)
            return self._decode(q, k, v, mask, kind == "self", state, rows, batch)
        if k.dtype == torch.int8:  # an int8 cache's packed rows
            k, v = dequantize_rows(k, q.dtype), dequantize_rows(v, q.dtype)
        elif k.dtype != q.dtype:  # a cache stored in another dtype
            k, v = k.to(q.dtype), v.to(q.dtype)
        if rows is not None:
            k, v = _gather(k, rows), _gather(v, rows)
        elif batch is not None:
            k, v = k.index_select(0, batch), v.index_select(0, batch)
        if choice == "torch":  # what qkv's "torch" backend runs, without re-checking per step
            bias = mask
            if mask is not None and state is not None:
                if state.bias is None:  # an additive mask is faster for few rows; a source
                    # with no visible token keeps the bool mask (zeros, as qkv gives, not NaN)
                    state.bias = mask
                    if bool(mask.any(-1).all()):
                        state.bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
                        state.bias.masked_fill_(~mask, float("-inf"))
                bias = state.bias
            return TF.scaled_dot_product_attention(
                q, k, v, attn_mask=bias, enable_gqa=q.shape[1] != k.shape[1]
            )
        return F.scaled_dot_product_attention(
            q, k, v, mask=mask, causal=kind == "self", backend=choice
        )

    def _decode(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
                state: DecodeState | None, rows: Tensor | None = None,
                batch: Tensor | None = None) -> Tensor:  # fmt: skip
        """The decode kernel's call as :func:`qkv.kernels.decode.run_decode` makes it, its
        mask view built once per query count of a state."""
        m5 = None if mask is None else self._mask5(mask, state, q.shape, k.shape[1], k.shape[2])
        check_decode(k.dtype)
        return decode_ops().fwd(q.contiguous(), k, v, m5, self.scale, causal, -1, 0, rows,
                                batch)[0]  # fmt: skip

    def _mask5(self, mask: Tensor, state: DecodeState | None, q_shape: torch.Size, h_kv: int,
               Tk: int) -> Tensor:  # fmt: skip
        """The decode kernel's view of ``mask``, ``(B, h_kv, G, Tq, Tk)`` bool, built once per
        query count and key length of a state."""
        key = (q_shape[0], q_shape[2], Tk)
        m5 = state.masks5.get(key) if state is not None else None
        if m5 is None:
            shape = AttentionShape((q_shape[0],), q_shape[1], h_kv, q_shape[2], Tk, q_shape[3],
                                   q_shape[3])  # fmt: skip
            m5 = _mask_arg(mask, shape)  # (B, h_kv, G, Tq, Tk) bool view
            if state is not None:
                state.masks5[key] = m5
        return m5
