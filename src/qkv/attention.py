"""Multi-head attention: project, split into heads, attend, concatenate, project.

Shapes: ``x (B, Tq, d_model)`` → q ``(B, h, Tq, d_k)``, k/v ``(B, h_kv, Tk, d_k)`` →
attention ``(B, h, Tq, d_k)`` → concat ``(B, Tq, d_model)`` → ``W_O`` → ``(B, Tq, d_model)``.

One class serves every kind, by how it is called: self-attention ``mha(x)``, causal
self-attention ``mha(x, causal=True)``, cross-attention ``mha(x, context=memory)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from qkv import functional as F
from qkv import masks
from qkv.cache import KVCache
from qkv.positional import ALiBi, RotaryEmbedding

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nn.Module):
    """Batch-first multi-head attention with grouped-query heads and a KV cache.

    Args:
        d_model: model width; ``d_k = d_model // n_heads``.
        n_heads: query heads ``h``.
        n_kv_heads: key/value heads ``h_kv`` (default ``n_heads``; 1 = multi-query).
        bias: whether the projections have biases.
        dropout: dropout on the attention weights (training only).
        kdim, vdim: widths of the context for keys/values (default ``d_model``).
        position: :class:`~qkv.positional.RotaryEmbedding` or :class:`~qkv.positional.ALiBi`
            applied inside attention, or ``None``.

    >>> mha = MultiHeadAttention(d_model=512, n_heads=8)
    >>> mha(torch.randn(32, 20, 512), causal=True).shape
    torch.Size([32, 20, 512])
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        n_kv_heads: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        kdim: int | None = None,
        vdim: int | None = None,
        position: RotaryEmbedding | ALiBi | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if n_heads < 1 or d_model % n_heads != 0:
            raise ValueError(
                f"d_model must be divisible by n_heads: d_model={d_model}, n_heads={n_heads}"
            )
        if n_kv_heads < 1 or n_heads % n_kv_heads != 0:
            raise ValueError(
                f"n_heads must be a multiple of n_kv_heads: n_heads={n_heads}, "
                f"n_kv_heads={n_kv_heads}"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.d_k = d_model // n_heads
        self.kdim = d_model if kdim is None else kdim
        self.vdim = d_model if vdim is None else vdim
        self.dropout = dropout
        self.position = position
        self.backend = backend  # attention path: "auto", "math", "torch", "flash" (qkv.dispatch)
        # One Linear per role holds every head's projection; heads are split by reshaping.
        self.w_q = nn.Linear(d_model, n_heads * self.d_k, bias=bias)
        self.w_k = nn.Linear(self.kdim, n_kv_heads * self.d_k, bias=bias)
        self.w_v = nn.Linear(self.vdim, n_kv_heads * self.d_k, bias=bias)
        self.w_o = nn.Linear(n_heads * self.d_k, d_model, bias=bias)
        # Inspection hooks (used by qkv.inspect; both None = no effect, no cost):
        # recorder(weights (B, h, Tq, Tk), kind "self"|"causal"|"cross") is called on every
        # forward with the per-head weights, without changing what forward returns;
        # head_mask (h,) multiplies each head's output before W_O (0 = head switched off).
        self.recorder: Callable[[Tensor, str], None] | None = None
        self.head_mask: Tensor | None = None

    def split_heads(self, x: Tensor, n: int) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, n, self.d_k).transpose(1, 2)  # (B, n, T, d_k)

    @staticmethod
    def merge_heads(x: Tensor) -> Tensor:
        B, h, T, d_k = x.shape
        return x.transpose(1, 2).reshape(B, T, h * d_k)  # (B, T, h·d_k)

    def _check_input(self, name: str, t: Tensor, width: int) -> None:
        if t.dim() != 3 or t.shape[-1] != width:
            raise ValueError(f"{name} must be (B, T, {width}), got shape {tuple(t.shape)}")
        # an int8 projection (qkv.kernels.int8.Int8Linear) names the dtype it computes in
        dtype = getattr(self.w_q, "input_dtype", None) or self.w_q.weight.dtype
        if t.dtype != dtype:
            raise TypeError(f"{name} must be {dtype} like the weights, got {t.dtype}")

    def project_kv(self, context: Tensor, value: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Keys and values ``(B, h_kv, Tk, d_k)`` of a context (cross-attention memory)."""
        value = context if value is None else value
        k = self.split_heads(self.w_k(context), self.n_kv_heads)  # (B, h_kv, Tk, d_k)
        v = self.split_heads(self.w_v(value), self.n_kv_heads)  # (B, h_kv, Tk, d_k)
        return k, v

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        value: Tensor | None = None,
        mask: Tensor | None = None,
        attn_bias: Tensor | None = None,
        causal: bool = False,
        window: int | None = None,
        cache: KVCache | None = None,
        need_weights: bool = False,
        weights_heads: list[int] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``x (B, Tq, d_model)`` to itself, or to ``context (B, Tk, kdim)``.

        Args:
            x: queries' input.
            context: keys' input for cross-attention (``None`` = self-attention).
            value: values' input when it differs from ``context``.
            mask: bool, **True = may attend**; ``(Tq, Tk)`` or ``(B|1, h|1, Tq|1, Tk)``, or a
                :class:`qkv.masks.BlockMask` (document/prefix-LM/sliding-window structure,
                empty blocks skipped). With a cache, ``Tk`` counts every cached position.
            attn_bias: float bias added to the scaled scores, same shapes as ``mask``.
            causal: causal self-attention (bottom-right aligned, so it works with a cache).
            window: sliding-window attention (see ``qkv.functional``).
            cache: a :class:`KVCache`; self-attention appends to it, cross-attention fills it
                on the first call and reuses it afterwards. The first layer to use a cache
                owns it: passing it to another layer is a ``ValueError`` (one cache per layer;
                ``cache.reset()`` releases it).
            need_weights: also return per-head weights ``(B, h, Tq, Tk)`` (never averaged).
            weights_heads: with ``need_weights``, only these heads ``(B, len, Tq, Tk)``,
                recomputed from the fast path's log-sum-exp.

        Inspection (``qkv.inspect``): if ``self.recorder`` is set, it receives the per-head
        weights and the kind (``"cross"`` when ``context`` is given, else ``"causal"`` or
        ``"self"`` from ``causal``) on every call; if ``self.head_mask`` ``(h,)`` is set, each
        head's output is multiplied by it before ``W_O``.
        """
        self._check_input("x", x, self.d_model)
        if weights_heads is not None and not need_weights:
            raise ValueError(
                "weights_heads selects heads of the returned weights: pass need_weights=True"
            )
        if cache is not None:  # one layer per cache: another layer's would be interleaved
            cache.claim(self)
        B, Tq, _ = x.shape
        q = self.split_heads(self.w_q(x), self.n_heads)  # (B, h, Tq, d_k)
        offset = 0
        if context is None:  # self-attention: new keys come from x
            if value is not None:
                raise ValueError("value= is only for cross-attention (pass context= too)")
            k, v = self.project_kv(x)  # (B, h_kv, Tq, d_k)
            if cache is not None:
                if cache.batch_size not in (None, B):
                    raise ValueError(f"cache holds batch size {cache.batch_size}, x has {B}")
                offset = len(cache)
            if isinstance(self.position, RotaryEmbedding):
                q, k = self.position(q, k, offset, offset)
            if cache is not None:
                k, v = cache.update(k, v)  # (B, h_kv, offset + Tq, d_k)
        elif cache is not None and not cache.is_empty:  # cross-attention, memory cached
            if cache.batch_size != B:
                raise ValueError(f"cache holds batch size {cache.batch_size}, x has {B}")
            k, v = cache.keys, cache.values
        else:
            self._check_input("context", context, self.kdim)
            if context.shape[0] != B:
                raise ValueError(f"context must have batch size {B} like x, got {context.shape[0]}")
            if value is not None:
                self._check_input("value", value, self.vdim)
            k, v = self.project_kv(context, value)  # (B, h_kv, Tk, d_k)
            if cache is not None:
                k, v = cache.set(k, v)
        slopes = None
        if isinstance(self.position, ALiBi):  # per-head slopes: no (Tq, Tk) bias on flash
            slopes = masks.alibi_slopes(self.n_heads).to(x.device)  # (h,)
        want_weights = need_weights or self.recorder is not None
        # an int8 cache's packed rows go to the dispatcher as they are: the decode kernel
        # reads them as stored, any other path gets them widened (qkv.dispatch)
        if k.dtype not in (q.dtype, torch.int8):  # a cache in another dtype (bf16, fp32 model)
            k, v = k.to(q.dtype), v.to(q.dtype)
        out = F.scaled_dot_product_attention(
            q, k, v, mask=mask, bias=attn_bias, causal=causal, window=window,
            dropout_p=self.dropout if self.training else 0.0, return_weights=want_weights,
            weights_heads=None if self.recorder is not None else weights_heads,
            backend=self.backend, alibi_slopes=slopes,
        )  # fmt: skip
        out, weights = out if want_weights else (out, None)
        if self.recorder is not None:
            kind = "cross" if context is not None else "causal" if causal else "self"
            self.recorder(weights.detach(), kind)
            if need_weights and weights_heads is not None:  # the recorder took every head
                weights = weights[:, list(weights_heads)]  # (B, len(weights_heads), Tq, Tk)
        return self._finish(out, weights, need_weights)

    def _finish(self, out: Tensor, weights: Tensor | None, need_weights: bool):
        """Heads ``out (B, h, Tq, d_k)`` → ``W_O`` of their concatenation (and the weights)."""
        if self.head_mask is not None:
            out = out * self._head_scale(out)  # (B, h, Tq, d_k), masked heads give zeros
        y = self.w_o(self.merge_heads(out))  # (B, Tq, d_model)
        return (y, weights) if need_weights else y

    def _head_scale(self, out: Tensor) -> Tensor:
        hm = self.head_mask
        if hm.shape != (self.n_heads,):
            raise ValueError(f"head_mask must have shape ({self.n_heads},), got {tuple(hm.shape)}")
        return hm.to(device=out.device, dtype=out.dtype).view(1, -1, 1, 1)  # (1, h, 1, 1)

    # --- PyTorch interop ------------------------------------------------------------------

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention) -> MultiHeadAttention:
        """Copy an ``nn.MultiheadAttention``'s weights exactly (either ``batch_first``)."""
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError("add_bias_kv and add_zero_attn have no qkv equivalent")
        E = mha.embed_dim
        has_bias = mha.in_proj_bias is not None
        ours = cls(
            E, mha.num_heads, bias=has_bias, dropout=mha.dropout, kdim=mha.kdim, vdim=mha.vdim
        )
        ours = ours.to(device=mha.out_proj.weight.device, dtype=mha.out_proj.weight.dtype)
        with torch.no_grad():
            if mha._qkv_same_embed_dim:
                wq, wk, wv = mha.in_proj_weight.chunk(3, dim=0)
            else:
                wq, wk, wv = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
            for lin, w in ((ours.w_q, wq), (ours.w_k, wk), (ours.w_v, wv)):
                lin.weight.copy_(w)
            if has_bias:
                for lin, b in zip((ours.w_q, ours.w_k, ours.w_v), mha.in_proj_bias.chunk(3)):
                    lin.bias.copy_(b)
                ours.w_o.bias.copy_(mha.out_proj.bias)
            ours.w_o.weight.copy_(mha.out_proj.weight)
        return ours

    def to_torch(self) -> nn.MultiheadAttention:
        """An equal ``nn.MultiheadAttention(batch_first=True)``; plain heads only."""
        if self.n_kv_heads != self.n_heads or self.position is not None:
            raise ValueError("to_torch() needs n_kv_heads == n_heads and no rotary/ALiBi position")
        has_bias = self.w_q.bias is not None
        w = self.w_q.weight
        theirs = nn.MultiheadAttention(
            self.d_model, self.n_heads, dropout=self.dropout, bias=has_bias,
            kdim=self.kdim, vdim=self.vdim, batch_first=True, device=w.device, dtype=w.dtype,
        )  # fmt: skip
        with torch.no_grad():
            if theirs._qkv_same_embed_dim:
                theirs.in_proj_weight.copy_(
                    torch.cat([self.w_q.weight, self.w_k.weight, self.w_v.weight])
                )
            else:
                theirs.q_proj_weight.copy_(self.w_q.weight)
                theirs.k_proj_weight.copy_(self.w_k.weight)
                theirs.v_proj_weight.copy_(self.w_v.weight)
            if has_bias:
                theirs.in_proj_bias.copy_(torch.cat([self.w_q.bias, self.w_k.bias, self.w_v.bias]))
                theirs.out_proj.bias.copy_(self.w_o.bias)
            theirs.out_proj.weight.copy_(self.w_o.weight)
        return theirs

    def mask_from_torch(
        self, attn_mask: Tensor | None = None, key_padding_mask: Tensor | None = None
    ) -> tuple[Tensor | None, Tensor | None]:
        """``nn.MultiheadAttention``'s ``attn_mask``/``key_padding_mask`` → qkv ``(mask, bias)``.

        ``attn_mask`` is ``(Tq, Tk)`` or ``(B·h, Tq, Tk)`` (True = blocked, or additive float);
        ``key_padding_mask`` is ``(B, Tk)`` (True = padding). The result is True = may attend.
        """
        mask = bias = None
        if attn_mask is not None:
            if attn_mask.dim() == 3:  # (B·h, Tq, Tk) → (B, h, Tq, Tk)
                attn_mask = attn_mask.view(-1, self.n_heads, *attn_mask.shape[1:])
            mask, bias = masks.from_torch_attn_mask(attn_mask)
        if key_padding_mask is not None:
            kpm = key_padding_mask
            if kpm.dtype.is_floating_point:  # additive float padding mask
                bias = kpm[:, None, None, :] if bias is None else bias + kpm[:, None, None, :]
            else:
                mask = masks.combine(mask, masks.from_key_padding_mask(kpm))
        return mask, bias

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
            f"d_k={self.d_k}, dropout={self.dropout}, backend={self.backend!r}"
        )
