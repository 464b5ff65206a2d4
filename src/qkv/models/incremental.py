"""Incremental decoding of a :class:`~qkv.models.Seq2SeqTransformer`, one token per step.

The same math as ``model.decode(tgt, memory, mask, cache=...)``, laid out for the generate
loop, where per-step overhead decides the speed:

* weights prepared once per model (and again only when a weight changes): the self-attention
  ``W_q, W_k, W_v`` fused into one matrix, the cross-attention keys/values of *every* layer
  fused into one, and each matrix stored the way a small batch multiplies fastest
  (:class:`SmallBatchLinear`);
* the memory's cross-attention keys/values computed once per sentence — not once per beam:
  the ``K`` beams of a sentence are ``K`` query rows over one copy of them (the rows trick of
  grouped-query attention);
* self-attention keys/values written in place into preallocated :class:`~qkv.KVCache` buffers
  sized for the whole generation, read as views; beams reordered by index;
* attention through the path :func:`qkv.functional.scaled_dot_product_attention` would choose
  (``qkv.dispatch``), resolved once per kind of call and key length range instead of per step.

Where the parts live: the prepared weights in :mod:`qkv.models.prepared_weights`, the state
of one generation in :mod:`qkv.models.decode_state`, what both prepared decoders share (the
per-model cache, residuals, attention routing) in :mod:`qkv.models.prepared_steps`; this
module holds the encoder–decoder's :class:`IncrementalDecoder` and re-exports those names.

Shapes: ``tokens (N,)`` with ``N = B·K`` (sentence-major, beams inner) → logits ``(N, V)``;
memory ``(B, S, d_model)``; the source mask bool ``(B, 1, 1, S)``, True = may attend.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as TF
from torch import Tensor, nn

from qkv import dispatch
from qkv.attention import MultiHeadAttention
from qkv.cache import BufferPool, KVCache
from qkv.kernels._native import decode_ops, native_module
from qkv.kernels._settings import check_decode
from qkv.kernels.decode import MAX_TQ
from qkv.models.decode_state import DecodeState, hypothesis_rows
from qkv.models.prepared_steps import PreparedSteps, _unprepared
from qkv.models.prepared_steps import _gather as _gather  # imported from here by tests
from qkv.models.prepared_weights import (
    SmallBatchLinear,
    _compiled_specs,
    _EncoderLayer,
    _Layer,
    _prepared,
)
from qkv.positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding

__all__ = [
    "IncrementalDecoder",
    "DecodeState",
    "PreparedSteps",
    "SmallBatchLinear",
    "hypothesis_rows",
    "unsupported",
]


def _real_rows(mask: Tensor | None, B: int, S: int) -> Tensor | None:
    """Flat indices ``(n,)`` of the tokens a padding mask ``(B, 1, 1, S)`` lets through, or
    ``None`` when there is nothing to skip (no mask, no padding, or another mask shape)."""
    if mask is None or mask.dtype != torch.bool or mask.shape != (B, 1, 1, S):
        return None
    flat = mask.reshape(B * S)
    if bool(flat.all()):
        return None
    return flat.nonzero().flatten()


def _unpack(x: Tensor, rows: Tensor | None, n: int) -> Tensor:
    """Rows ``x (len(rows), w)`` put back in their places ``(n, w)``, zeros elsewhere."""
    if rows is None:
        return x
    return x.new_zeros(n, x.shape[1]).index_copy_(0, rows, x)


def unsupported(
    model: nn.Module,
    attention: list[MultiHeadAttention] | None = None,
    modules: list[nn.Module] | None = None,
) -> str | None:
    """Why :class:`IncrementalDecoder` cannot run ``model`` (``None``: it can).

    ``attention``, ``modules``: the model's attention modules and all its submodules when
    already known (each saves a walk of the model).
    """
    from qkv.models.seq2seq import Seq2SeqTransformer

    if not isinstance(model, Seq2SeqTransformer):
        return f"not a Seq2SeqTransformer ({type(model).__name__})"
    return _unprepared(model, model.decoder.embed.embedding.weight, attention, modules)


class IncrementalDecoder(PreparedSteps):
    """A :class:`~qkv.models.Seq2SeqTransformer`'s decoder prepared for token-by-token use.

    Build it with :meth:`for_model` (prepared once, rebuilt when a weight changes).

    >>> dec = IncrementalDecoder.for_model(model)  # doctest: +SKIP
    >>> state = dec.start(memory, mask, beams=1, max_steps=20)  # doctest: +SKIP
    >>> logits = dec.step(state, torch.full((B,), bos))  # (B, V)  # doctest: +SKIP
    """

    def __init__(self, model: nn.Module) -> None:
        why = unsupported(model)
        if why is not None:  # for_model() returns None instead
            raise ValueError(f"IncrementalDecoder cannot run this model: {why}")
        cfg, dec = model.cfg, model.decoder
        self.cfg = cfg
        self._prepare_ends(cfg, dec.embed, dec.norm, dec.out)
        self.layers = [_Layer(layer, cfg.activation) for layer in dec.layers]
        kv = [lin for layer in dec.layers for lin in (layer.cross_attn.w_k, layer.cross_attn.w_v)]
        self.cross_kv = _prepared(*kv) if kv else None  # (L·2·h_kv·d_k, d)
        enc = model.encoder
        self.encoder = enc
        self.enc_layers = [_EncoderLayer(layer, cfg.activation) for layer in enc.layers]
        self.enc_norm = None
        if isinstance(enc.norm, nn.LayerNorm):
            self.enc_norm = (enc.norm.weight.detach(), enc.norm.bias.detach(), enc.norm.eps)
        # the self-attention caches' memory, reused from one generation to the next (see
        # KVCache's pool; given back by DecodeState.release)
        self.pool = BufferPool()
        self.fused = self._fused_step()
        self.fused_encoder = self._fused_encoder()

    def _fused_step(self):
        """The whole step in one compiled call (``step_cpu.cpp``: the same operations as
        :meth:`step`'s loop, without a Python call per operation), or ``None`` where it does
        not apply: linears neither fp32 panels on the CPU nor on the compiled int8 kernel,
        RoPE, an attention backend other than ``auto``/``decode``, no compiled extension."""
        module = native_module()
        lins = [m for L in self.layers for m in (L.qkv, L.o, L.cq, L.co, L.w1, L.w2)] + [self.out]
        norms = [n for L in self.layers for n in L.norms]
        norms += [self.final_norm] if self.final_norm is not None else []
        specs = _compiled_specs(lins, norms)
        if (module is None or not hasattr(module, "DecoderStep") or specs is None
                or not self.layers or self.embedding.dtype != torch.float32
                or self.embedding.device.type != "cpu"
                or any(L.rope is not None or not set(L.backends) <= {"auto", "decode"}
                       for L in self.layers)):  # fmt: skip
            return None
        return module.DecoderStep(self.d, self.h, self.h_kv, self.d_k, self.pre_norm, self.scale,
                                  specs, norms, self.embedding.contiguous())  # fmt: skip

    def _fused_encoder(self):
        """The encoder in one compiled call (``step_cpu.cpp``'s ``EncoderStep``), or ``None``
        where it does not apply (as :meth:`_fused_step`; positions must be added to the
        embeddings, not rotated inside attention)."""
        module = native_module()
        emb = self.encoder.embed
        lins = [m for L in self.enc_layers for m in (L.qkv, L.o, L.w1, L.w2)]
        norms = [n for L in self.enc_layers for n in L.norms]
        norms += [self.enc_norm] if self.enc_norm is not None else []
        specs = _compiled_specs(lins, norms)
        w = emb.embedding.weight
        if (module is None or not hasattr(module, "EncoderStep") or specs is None
                or w.dtype != torch.float32 or w.device.type != "cpu"
                or not isinstance(emb.position, (SinusoidalPositionalEncoding,
                                                 LearnedPositionalEmbedding))
                or any(L.rope is not None for L in self.enc_layers)):  # fmt: skip
            return None
        scaled = w.detach() * math.sqrt(self.d)  # the products the Embedder takes per token
        if torch.equal(scaled, self.embedding):  # shared with the decoder: one copy
            scaled = self.embedding
        return module.EncoderStep(self.d, self.h, self.h_kv, self.d_k, self.pre_norm, self.scale,
                                  specs, norms, scaled.contiguous())  # fmt: skip

    def _encode_fused(self, src: Tensor, src_mask: Tensor | None) -> Tensor | None:
        """:meth:`encode` in one compiled call, or ``None`` where that does not apply to
        this call (the Python layers then run it, and raise on bad input)."""
        B, S = src.shape
        if (src.dtype != torch.long or src.numel() == 0 or int(src.min()) < 0
                or int(src.max()) >= self.embedding.shape[0]):  # fmt: skip
            return None
        if src_mask is not None and (src_mask.dtype != torch.bool
                                     or src_mask.shape != (B, 1, 1, S)
                                     or not bool(src_mask.any(-1).all())):  # fmt: skip
            return None  # another mask, or a source with no visible token
        backend = self.enc_layers[0].backend
        if any(L.backend != backend for L in self.enc_layers):
            return None
        q = self.embedding.new_zeros(()).expand(B, self.h, S, self.d_k)
        kv = self.embedding.new_zeros(()).expand(B, self.h_kv, S, self.d_k)
        choice = dispatch.choose(dispatch.describe(q, kv, kv, mask=src_mask), backend).backend
        if choice not in ("decode", "torch"):
            return None
        real = _real_rows(src_mask, B, S)
        if real is None:
            real = torch.arange(B * S)
        pos = self.encoder.embed.position
        table = (pos.table(S) if isinstance(pos, SinusoidalPositionalEncoding)
                 else pos.embedding.weight.detach()[:S])  # fmt: skip
        if table.shape[0] < S:
            return None  # past a learned table: the Python layers say so
        return self.fused_encoder.forward(src.contiguous(), real, src_mask, table.contiguous(),
                                          choice == "decode")  # fmt: skip

    @staticmethod
    def unsupported(model: nn.Module, attention: list | None = None,
                    modules: list | None = None) -> str | None:  # fmt: skip
        return unsupported(model, attention, modules)

    # --- per call -------------------------------------------------------------------------

    def encode(self, src: Tensor, src_mask: Tensor | None) -> Tensor:
        """``model.encode(src, src_mask)`` with the prepared weights: memory ``(B, S, d)``.

        The position-wise layers (projections, feed-forward, norms) run on the real tokens
        only, packed without their padding (a batch of sentences of mixed lengths is
        mostly padding otherwise); attention sees them in their padded places. The memory's
        padding positions are zeros: the mask hides them from cross-attention."""
        if self.fused_encoder is not None:
            check_decode(torch.float32)  # (its attention may run the decode kernel)
            memory = self._encode_fused(src, src_mask)
            if memory is not None:
                return memory
        B, S = src.shape
        d, h, h_kv, d_k = self.d, self.h, self.h_kv, self.d_k
        x = self.encoder.embed(src).reshape(B * S, d)  # (B·S, d)
        real = _real_rows(src_mask, B, S)  # (n,) indices of the non-pad tokens, or None
        if real is not None:
            x = x.index_select(0, real)  # (n, d)
        kv_w = h_kv * d_k
        for L in self.enc_layers:
            y = L.qkv(self._sub_in(x, L.norms[0]))  # (n, (h + 2·h_kv)·d_k)
            qkv = _unpack(y, real, B * S).view(B, S, -1)  # (B, S, (h + 2·h_kv)·d_k)
            q = qkv[..., :d].view(B, S, h, d_k).transpose(1, 2)  # (B, h, S, d_k)
            k = qkv[..., d : d + kv_w].view(B, S, h_kv, d_k).transpose(1, 2)  # (B, h_kv, S, d_k)
            v = qkv[..., d + kv_w :].view(B, S, h_kv, d_k).transpose(1, 2)
            if L.rope is not None:
                q, k = L.rope(q, k)
            a = self._attend("enc", L.backend, q, k, v, src_mask, None)  # (B, h, S, d_k)
            a = a.transpose(1, 2).reshape(B * S, d)
            y = L.o(a if real is None else a.index_select(0, real))  # (n, d)
            x = self._sub_out(x, y, L.norms[0])
            y = self._sub_in(x, L.norms[1])
            y = L.w2(L.w1(y))
            x = self._sub_out(x, y, L.norms[1])
        if self.enc_norm is not None:
            x = torch.layer_norm(x, (d,), *self.enc_norm)
        return _unpack(x, real, B * S).view(B, S, d)

    def start(
        self,
        memory: Tensor,
        memory_mask: Tensor | None,
        *,
        beams: int = 1,
        max_steps: int,
        cache_dtype: torch.dtype | None = None,
    ) -> DecodeState:
        """State for ``B`` sentences × ``beams`` hypotheses, up to ``max_steps`` tokens.

        ``memory (B, S, d_model)`` is projected to every layer's cross-attention keys and
        values here, once.
        """
        B, S, _ = memory.shape
        cross = []
        if self.cross_kv is not None:  # projected for the real tokens only (see encode)
            real = _real_rows(memory_mask, B, S)
            x = memory.reshape(B * S, self.d)
            kv = self.cross_kv(x if real is None else x.index_select(0, real))
            kv = _unpack(kv, real, B * S)  # (B·S, L·2·h_kv·d_k)
            kv = kv.view(B, S, len(self.layers), 2, self.h_kv, self.d_k)
            kv = kv.permute(2, 3, 0, 4, 1, 5).contiguous()  # (L, 2, B, h_kv, S, d_k)
            cross = [(kv[i, 0], kv[i, 1]) for i in range(len(self.layers))]
        caches = [KVCache(capacity=max_steps, dtype=cache_dtype, pool=self.pool)
                  for _ in range(len(self.layers))]  # fmt: skip
        state = DecodeState(caches, cross, memory_mask, beams)
        backend = self.layers[0].backends[0] if self.layers else "auto"
        state.gather = (decode_ops() is not None and memory.device.type == "cpu"
                        and memory.dtype in (torch.float32, torch.bfloat16)
                        and backend in ("auto", "decode"))  # fmt: skip
        if self.fused is not None and state.gather and memory.dtype == torch.float32:
            # the compiled step writes into the caches' buffers: size them now (B·beams rows)
            empty = memory.new_empty(B * beams, self.h_kv, 0, self.d_k)
            for c in caches:
                c.update(empty, empty)
            state.fused = True
        if isinstance(self.position, SinusoidalPositionalEncoding):  # (max_steps, d), once
            state.positions = self.position.table(max_steps, device=memory.device,
                                                  dtype=memory.dtype)  # fmt: skip
        elif isinstance(self.position, LearnedPositionalEmbedding):
            if max_steps > self.position.max_len:
                raise ValueError(f"max_steps={max_steps} > max_len={self.position.max_len}")
            state.positions = self.position.embedding.weight.detach()[:max_steps]
        return state

    def step(self, state: DecodeState, tokens: Tensor) -> Tensor:
        """Feed one token per hypothesis ``tokens (N,)``; return next-token logits ``(N, V)``."""
        N, t, d = tokens.shape[0], state.t, self.d
        K = state.beams
        B = N // K
        if state.positions is not None and t >= state.positions.shape[0]:
            raise ValueError(f"target length {t + 1} > max_steps={state.positions.shape[0]}")
        if state.rows is not None and state.rows.shape[1] <= t:  # a cache grown past its size
            phys = state.phys if state.phys is not None else torch.arange(N)
            grown = phys[:, None].expand(N, 2 * (t + 1)).contiguous()  # later positions: phys
            grown[:, : state.rows.shape[1]] = state.rows
            state.rows = grown
        if state.fused and K <= MAX_TQ and self.fused is not None and tokens.dtype == torch.long:
            bufs = [c.extend(1) for c in state.caches]  # position t, written by the call
            ck, cv = state.cross_kv
            m5 = None
            if state.cross_mask is not None:
                m5 = self._mask5(state.cross_mask, state, (B, self.h, K, self.d_k), self.h_kv,
                                 ck[0].shape[2])  # fmt: skip
            for c in {ck[0].dtype, bufs[0][0].dtype}:  # the settings its attention reads
                check_decode(c)
            logits = self.fused.step(tokens if tokens.is_contiguous() else tokens.contiguous(),
                                     state.positions, t, K, [b[0] for b in bufs],
                                     [b[1] for b in bufs], ck, cv, m5, state.rows, state.phys,
                                     state.sent)  # fmt: skip
            state.t = t + 1
            return logits
        x = TF.embedding(tokens, self.embedding)  # (N, d), scaled by √d_model
        if state.positions is not None:
            x = x.add_(state.positions[t])
        for i, L in enumerate(self.layers):
            # causal self-attention over the cache
            h = self._sub_in(x, L.norms[0])
            qkv = L.qkv(h)  # (N, (h + 2·h_kv)·d_k)
            if self.h == self.h_kv:  # one view, three selects: (N, 3, h, 1, d_k)
                q, k, v = qkv.view(N, 3, self.h, 1, self.d_k).unbind(1)  # (N, h, 1, d_k) each
            else:
                q = qkv[:, :d].view(N, self.h, 1, self.d_k)  # (N, h, 1, d_k)
                kv_w = self.h_kv * self.d_k
                k = qkv[:, d : d + kv_w].view(N, self.h_kv, 1, self.d_k)  # (N, h_kv, 1, d_k)
                v = qkv[:, d + kv_w :].view(N, self.h_kv, 1, self.d_k)
            if L.rope is not None:
                q, k = L.rope.rotate(q, t), L.rope.rotate(k, t)
            # (N_cache, h_kv, t+1, d_k): with sentences gone, more rows than hypotheses
            k_all, v_all = state.caches[i].update(k, v, check=t == 0, rows=state.phys)
            a = self._attend("self", L.backends[0], q, k_all, v_all, None, state, state.rows,
                             state.phys if state.rows is None else None)  # fmt: skip
            y = L.o(a.reshape(N, d))  # (N, h, 1, d_k) → (N, d)
            x = self._sub_out(x, y, L.norms[0])
            # cross-attention: the K beams of a sentence are K query rows over its memory
            h = self._sub_in(x, L.norms[1])
            ck, cv = state.cross[i]  # (B, h_kv, S, d_k)
            if K == 1:
                q = L.cq(h).view(B, self.h, 1, self.d_k)  # (B, h, 1, d_k)
                a = self._attend("cross", L.backends[1], q, ck, cv, state.cross_mask, state,
                                 None, state.sent)  # fmt: skip
                y = L.co(a.reshape(N, d))
            else:
                q = L.cq(h).view(B, K, self.h, self.d_k).transpose(1, 2)  # (B, h, K, d_k)
                a = self._attend("cross", L.backends[1], q, ck, cv, state.cross_mask, state,
                                 None, state.sent)  # fmt: skip
                y = L.co(a.transpose(1, 2).reshape(N, d))  # (B, h, K, d_k) → (N, d)
            x = self._sub_out(x, y, L.norms[1])
            # feed-forward
            h = self._sub_in(x, L.norms[2])
            y = L.w2(L.w1(h))
            x = self._sub_out(x, y, L.norms[2])
        if self.final_norm is not None:
            x = torch.layer_norm(x, (d,), *self.final_norm)
        state.t = t + 1
        return self.out(x)  # (N, V)
