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

Shapes: ``tokens (N,)`` with ``N = B·K`` (sentence-major, beams inner) → logits ``(N, V)``;
memory ``(B, S, d_model)``; the source mask bool ``(B, 1, 1, S)``, True = may attend.
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
from qkv.attention import MultiHeadAttention
from qkv.cache import BufferPool, KVCache, dequantize_rows
from qkv.kernels._native import decode_ops, native_module
from qkv.kernels.decode import MAX_TQ, _mask_arg, as_unpacked, decode_rejects
from qkv.kernels.int8 import Int8Linear, SmallBatchInt8Linear
from qkv.kernels.packed import SMALL_ROWS, panels
from qkv.positional import LearnedPositionalEmbedding, RotaryEmbedding, SinusoidalPositionalEncoding

__all__ = ["IncrementalDecoder", "DecodeState", "PreparedSteps", "SmallBatchLinear", "hypothesis_rows",
           "unsupported"]

# oneDNN packs a weight for a batch size (any other works, a little slower): one packing per
# power of two of the rows, the last few kept
_MAX_PACKINGS = 6


def _mkldnn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_LINEAR_POINTWISE = (
    torch.ops.mkldnn._linear_pointwise.default if _mkldnn_linear_available() else None
)


class SmallBatchLinear:
    """``act(x Wᵀ + b)`` for ``x (M, in)`` with few rows, in the layout fastest for ``M``.

    Measured on the CPU this was written on (1 thread, weights not in cache, one
    ``(8000, 256)`` projection: 1.0 ms as ``F.linear``, 0.36 ms transposed — the read
    bandwidth — and for ``M ≥ 5`` oneDNN's prepacked weights 1.3-3× faster than either):

    * ``M <= 12`` (fp32, with the compiled kernels): ``qkv_decode.small_linear`` on the
      weight packed once into panels of 64 output columns, each read as one sequential
      stream, up to 6 rows per load (1 thread, Zen 4: 1.4-2× faster than a GEMV at
      ``M = 1``, 1.2-2× faster than oneDNN at ``M = 2..12``);
    * otherwise ``M = 1``: a matrix-vector product; when ``out ≥ 2·in`` the weight is
      stored transposed ``(in, out)`` (a streaming read), else as given;
    * ``M > 1``: oneDNN's prepacked weight for ``M`` rounded up to a power of two
      (``torch.ops.mkldnn``; a sentence length change does not repack), the activation
      fused; ``F.linear`` where oneDNN is missing.

    Results equal ``F.linear`` up to float rounding (a different summation order).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, activation: str = "none") -> None:
        self.weight = weight.detach()  # (out, in)
        self.bias = None if bias is None else bias.detach()
        self.activation = activation  # "none" | "relu" | "gelu"
        out_f, in_f = self.weight.shape
        self.wt = self.weight.t().contiguous() if out_f >= 2 * in_f else None  # (in, out)
        self._packed: dict[int, Tensor] = {}
        self._mkldnn = (_mkldnn_linear_available() and self.weight.dtype == torch.float32
                        and self.weight.device.type == "cpu")  # fmt: skip
        self._attr = activation if activation in ("relu", "gelu") else "none"
        self._algo = "none" if activation == "gelu" else ""
        self.out_features = out_f
        self.panels = None  # (ceil(out/64), in, 64): the compiled kernel's layout, M <= 12
        if self.weight.dtype == torch.float32 and self.weight.device.type == "cpu":
            ops = decode_ops()
            if ops is not None:
                self._small = ops.small_linear
                self.panels = panels(self.weight)
                self.wt = None  # the panels serve M = 1 too (faster than a GEMV, measured)

    def __call__(self, x: Tensor) -> Tensor:
        M = x.shape[0]
        if M <= SMALL_ROWS and self.panels is not None:
            if x.stride(-1) != 1:
                x = x.contiguous()
            y = self._small(x, self.panels, self.bias, self.out_features, self.activation == "relu")
            return TF.gelu(y) if self.activation == "gelu" else y
        if M == 1 or not self._mkldnn:
            if M == 1 and self.wt is not None:
                y = x @ self.wt if self.bias is None else torch.addmm(self.bias, x, self.wt)
            else:
                y = TF.linear(x, self.weight, self.bias)
            if self.activation == "relu":
                return y.relu_()
            return TF.gelu(y) if self.activation == "gelu" else y
        hint = 1 << (M - 1).bit_length()  # M rounded up to a power of two: few packings
        packed = self._packed.get(hint)
        if packed is None:
            if len(self._packed) >= _MAX_PACKINGS:
                self._packed.pop(next(iter(self._packed)))
            packed = self._packed[hint] = torch.ops.mkldnn._reorder_linear_weight(self.weight, hint)
        return _LINEAR_POINTWISE(x, packed, self.bias, self._attr, [], self._algo)


def _gather(x: Tensor, rows: Tensor) -> Tensor:
    """``out[b, :, p] = x[rows[b, p], :, p]`` for ``x (N, h, T, d)``: the keys or values of
    beams reordered through a table, as one tensor (paths other than the decode kernel)."""
    T = x.shape[2]
    pos = torch.arange(T, device=x.device)
    return x.transpose(1, 2)[rows[:, :T], pos].transpose(1, 2)  # (N, h, T, d)


def hypothesis_rows(sentences: Tensor, beams: int) -> Tensor:
    """Batch rows of the ``beams`` hypotheses of each of ``sentences (B',)``: ``(B'·beams,)``
    (sentence-major, beams inner)."""
    return (sentences[:, None] * beams + torch.arange(beams, device=sentences.device)).view(-1)


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


_ACTIVATIONS = {"none": 0, "relu": 1, "gelu": 2}  # step_cpu.cpp's codes


def _compiled_specs(linears: list, norms: list) -> list | None:
    """Prepared linears as the compiled encoder/decoder step takes them (weight, bias, out
    and in features, activation code, int8 scales and column sums), or ``None`` where one is
    in neither form the step runs (fp32 panels on the CPU, the compiled int8 kernel) or a
    norm has no weight or bias; an empty list (no layers) is ``None`` too."""
    if not linears or any(m.activation not in _ACTIVATIONS for m in linears):
        return None
    if any(w is None or b is None for w, b, _ in norms):
        return None
    specs = []
    for m in linears:
        act = _ACTIVATIONS[m.activation]
        if isinstance(m, SmallBatchLinear) and m.panels is not None:
            specs.append((m.panels, m.bias, m.out_features, m.panels.shape[1], act, None, None))
        elif isinstance(m, SmallBatchInt8Linear) and m.compiled:
            w = m.weight
            specs.append((w.packed, m.bias, w.out_features, w.in_features, act, w.scale_padded,
                          w.wsum))  # fmt: skip
        else:
            return None
    return specs


def _fuse(*linears: nn.Linear) -> tuple[Tensor, Tensor | None]:
    w = torch.cat([lin.weight for lin in linears])
    b = None if linears[0].bias is None else torch.cat([lin.bias for lin in linears])
    return w, b


def _prepared(*linears: nn.Module, activation: str = "none"):
    """The prepared form of one linear, or of several reading the same input (outputs side
    by side): the int8 kernel for :class:`~qkv.kernels.int8.Int8Linear` layers (a model from
    ``quantize_linears``), :class:`SmallBatchLinear` for float ones."""
    if all(isinstance(m, Int8Linear) for m in linears):
        return SmallBatchInt8Linear.fuse(*linears, activation=activation)
    return SmallBatchLinear(*_fuse(*linears), activation)


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
    each attention's backend."""
    weights = tuple(
        (id(p), p.data_ptr(), p._version) for m in (model, *children)
        for p in (*m._parameters.values(), *m._buffers.values()) if p is not None
    )  # fmt: skip
    return weights, tuple(m.backend for m in attention)


class DecodeState:
    """Per-call state: the self-attention caches, the memory's keys/values, the position."""

    def __init__(self, caches: list[KVCache], cross: list[tuple[Tensor, Tensor]],
                 cross_mask: Tensor | None, beams: int) -> None:  # fmt: skip
        self.caches = caches
        self.cross = cross  # per layer (B, h_kv, S, d_k) keys and values
        self.cross_mask = cross_mask  # (B, 1, 1, S) bool, or None
        self.beams = beams
        self.t = 0  # positions decoded so far
        self.t0 = 0  # the position of the first step (a prefilled cache's length)
        self.bias: Tensor | None = None  # the mask as an additive float bias (torch path)
        self.positions: Tensor | None = None  # (max_steps, d) added to the embeddings
        self.choices: dict[tuple[str, int], str] = {}  # attention path per (kind, Tk range)
        self.masks5: dict[tuple[int, int, int], Tensor] = {}  # the decode kernel's mask views
        # beam search with the decode kernel: the self-attention caches are never reordered;
        # rows[b, p] is the batch row holding hypothesis b's key/value at position p (N, cap)
        self.gather = False
        self.rows: Tensor | None = None
        # sentences that finished, with the decode kernel: nothing is compacted; phys[i] is
        # the cache batch row of hypothesis i (where its new keys/values go), sent[j] the
        # cross-attention batch row of running sentence j (None: all still run)
        self.phys: Tensor | None = None
        self.sent: Tensor | None = None
        self.fused = False  # steps run IncrementalDecoder's compiled step (its caches sized)

    @property
    def cross_kv(self) -> tuple[list[Tensor], list[Tensor]]:
        """The cross-attention keys and the values, one list each (layer order)."""
        return [k for k, _ in self.cross], [v for _, v in self.cross]

    def reorder(self, rows: Tensor) -> None:
        """Follow the surviving beams: hypothesis ``i`` continues row ``rows[i]`` ``(N,)``."""
        if self.rows is not None:  # nothing copied: the table says where each key lives
            t = self.t
            self.rows[:, :t] = self.rows.index_select(0, rows)[:, :t]
            return
        for c in self.caches:
            c.reorder(rows)

    def keep(self, index: Tensor) -> None:
        """Keep only the sentences ``index`` ``(B',)``, with all their beams (finished
        sentences leave the batch, so later steps compute only the rows still running)."""
        K = self.beams
        hyps = hypothesis_rows(index, K)  # (B'·K,)
        if self.gather:  # nothing copied: the kernel reads the rows still running in place
            B = self.sent.shape[0] if self.sent is not None else self._sentences()
            phys = self.phys if self.phys is not None else torch.arange(B * K)
            sent = self.sent if self.sent is not None else torch.arange(B)
            self.phys, self.sent = phys[hyps], sent[index]
            if self.rows is not None:  # its later positions already hold phys (see step)
                self.rows = self.rows.index_select(0, hyps)
        else:  # other paths: the caches compacted to the rows still running
            for c in self.caches:
                c.reorder(hyps)
            self.cross = [(k.index_select(0, index), v.index_select(0, index))
                          for k, v in self.cross]  # fmt: skip
        if self.cross_mask is not None:
            self.cross_mask = self.cross_mask.index_select(0, index)
        self.bias = None  # rebuilt from the mask on the next step
        self.choices.clear()  # the attention shapes changed
        self.masks5.clear()

    def release(self) -> None:
        """The generation is over: the caches' buffers go back to their pool (if any)."""
        for c in self.caches:
            c.reset()

    def _sentences(self) -> int:
        """How many sentences the caches hold (before any left)."""
        if self.cross:
            return self.cross[0][0].shape[0]
        return (self.caches[0].batch_size or 0) // self.beams if self.caches else 0

    def expand(self, beams: int) -> None:
        """From one row per sentence to ``beams`` identical rows each (after a first step
        that all beams share)."""
        if self.beams != 1 or self.phys is not None:
            raise ValueError(f"expand() needs one row per sentence, the state has {self.beams}")
        B = self._sentences()
        self.reorder(torch.arange(B).repeat_interleave(beams))
        self.beams = beams
        if self.gather:  # from now on beams are reordered through the table, not copied
            N, cap = B * beams, self.caches[0].capacity if self.caches else 0
            self.rows = torch.arange(N)[:, None].expand(N, cap).contiguous()
        self.choices.clear()  # the attention shapes changed
        self.masks5.clear()


class _Layer:
    """One decoder layer's weights, prepared."""

    def __init__(self, layer: nn.Module, activation: str) -> None:
        sa, ca = layer.self_attn, layer.cross_attn
        self.qkv = _prepared(sa.w_q, sa.w_k, sa.w_v)
        self.o = _prepared(sa.w_o)
        self.cq = _prepared(ca.w_q)
        self.co = _prepared(ca.w_o)
        self.w1 = _prepared(layer.ffn.w_1, activation=activation)
        self.w2 = _prepared(layer.ffn.w_2)
        self.norms = [
            (r.norm.weight.detach(), r.norm.bias.detach(), r.norm.eps)
            for r in (layer.res_self, layer.res_cross, layer.res_ffn)
        ]
        self.rope = sa.position if isinstance(sa.position, RotaryEmbedding) else None
        self.backends = (sa.backend, ca.backend)


class _EncoderLayer:
    """One encoder layer's weights, prepared (``W_q, W_k, W_v`` fused)."""

    def __init__(self, layer: nn.Module, activation: str) -> None:
        sa = layer.self_attn
        self.qkv = _prepared(sa.w_q, sa.w_k, sa.w_v)
        self.o = _prepared(sa.w_o)
        self.w1 = _prepared(layer.ffn.w_1, activation=activation)
        self.w2 = _prepared(layer.ffn.w_2)
        self.norms = [
            (r.norm.weight.detach(), r.norm.bias.detach(), r.norm.eps)
            for r in (layer.res_attn, layer.res_ffn)
        ]
        self.rope = sa.position if isinstance(sa.position, RotaryEmbedding) else None
        self.backend = sa.backend


class PreparedSteps:
    """What the prepared decoders (this module's, :class:`~qkv.models.lm_decoder.LMDecoder`)
    share: the cached preparation per model, the embedding and output ends, residual
    sub-layers, and attention resolved once per kind of call. A subclass defines
    :meth:`unsupported` and prepares its layers after :meth:`_prepare_ends`."""

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
            # described as the call they make in q's dtype (only metadata is read)
            like = [q.new_zeros(()).expand(as_unpacked(t, q)[:n].shape) for t in (k, v)]
            case = dispatch.describe(q, *like, mask=mask, causal=kind == "self")
            choice = choices[key] = dispatch.choose(case, backend).backend
            if (k.dtype == torch.int8 and backend in ("auto", "decode")
                    and decode_rejects(q.device, q.dtype) is None):  # fmt: skip
                choice = choices[key] = "decode"  # an int8 cache: only the kernel reads it
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
