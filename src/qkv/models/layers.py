"""Transformer blocks built on :class:`qkv.MultiHeadAttention`.

Shapes: ``x (B, T, d_model)``; source keys ``memory (B, S, d_model)``; masks are bool,
**True = may attend**, ``(B, 1, 1, S)`` for padding (broadcast over heads and queries).

* :class:`EncoderLayer`: self-attention → FFN (also the decoder-only LM block, ``causal=True``).
* :class:`DecoderLayer`: causal self-attention → cross-attention to the memory → FFN.

``norm_first=True`` is pre-LN ``x + f(LN(x))``; ``False`` is the paper's post-LN ``LN(x + f(x))``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from qkv.attention import MultiHeadAttention
from qkv.cache import KVCache
from qkv.models.config import TransformerConfig
from qkv.positional import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
)

__all__ = ["FeedForward", "EncoderLayer", "DecoderLayer", "Embedder"]


class FeedForward(nn.Module):
    """Position-wise ``W_2 · act(W_1 x + b_1) + b_2``: ``(B, T, d_model) → (B, T, d_model)``."""

    def __init__(self, d_model: int, d_ff: int, *, dropout: float = 0.0, activation: str = "relu"):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.act = nn.GELU() if activation == "gelu" else nn.ReLU()
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(self.dropout(self.act(self.w_1(x))))  # (B, T, d_model)


def _attention(cfg: TransformerConfig, *, rope: bool) -> MultiHeadAttention:
    position = RotaryEmbedding(cfg.d_k) if rope else None
    return MultiHeadAttention(
        cfg.d_model, cfg.n_heads, n_kv_heads=cfg.kv_heads, dropout=cfg.dropout, position=position
    )


class _Residual(nn.Module):
    """One sub-layer's residual connection with its LayerNorm (pre- or post-LN)."""

    def __init__(self, d_model: int, dropout: float, norm_first: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x: Tensor, sublayer) -> Tensor:
        if self.norm_first:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderLayer(nn.Module):
    """Self-attention then FFN. ``causal=True`` makes it a decoder-only (GPT) block.

    >>> cfg = TransformerConfig(src_vocab_size=10, tgt_vocab_size=10, d_model=16, n_heads=2)
    >>> EncoderLayer(cfg)(torch.randn(2, 5, 16)).shape
    torch.Size([2, 5, 16])
    """

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.self_attn = _attention(cfg, rope=cfg.positional == "rope")
        self.ffn = FeedForward(
            cfg.d_model, cfg.d_ff, dropout=cfg.dropout, activation=cfg.activation
        )
        self.res_attn = _Residual(cfg.d_model, cfg.dropout, cfg.norm_first)
        self.res_ffn = _Residual(cfg.d_model, cfg.dropout, cfg.norm_first)

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        *,
        causal: bool = False,
        cache: KVCache | None = None,
    ) -> Tensor:
        """``x (B, T, d_model)``; ``mask`` bool, True = may attend, ``(B, 1, 1|T, T)``."""
        x = self.res_attn(x, lambda h: self.self_attn(h, mask=mask, causal=causal, cache=cache))
        return self.res_ffn(x, self.ffn)  # (B, T, d_model)


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the encoder memory, then FFN.

    With caches, ``self_cache`` grows by the new tokens each step and ``cross_cache`` holds the
    memory's keys/values, projected once on the first step.
    """

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.self_attn = _attention(cfg, rope=cfg.positional == "rope")
        self.cross_attn = _attention(cfg, rope=False)
        self.ffn = FeedForward(
            cfg.d_model, cfg.d_ff, dropout=cfg.dropout, activation=cfg.activation
        )
        self.res_self = _Residual(cfg.d_model, cfg.dropout, cfg.norm_first)
        self.res_cross = _Residual(cfg.d_model, cfg.dropout, cfg.norm_first)
        self.res_ffn = _Residual(cfg.d_model, cfg.dropout, cfg.norm_first)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        memory_mask: Tensor | None = None,
        *,
        self_cache: KVCache | None = None,
        cross_cache: KVCache | None = None,
    ) -> Tensor:
        """``x (B, T, d_model)`` attends causally to itself and to ``memory (B, S, d_model)``.

        ``memory_mask``: bool, True = may attend, ``(B, 1, 1, S)``. Once ``cross_cache`` is
        filled its keys/values are reused and ``memory`` is not projected again.
        """
        x = self.res_self(x, lambda h: self.self_attn(h, causal=True, cache=self_cache))
        x = self.res_cross(
            x, lambda h: self.cross_attn(h, memory, mask=memory_mask, cache=cross_cache)
        )
        return self.res_ffn(x, self.ffn)  # (B, T, d_model)


class Embedder(nn.Module):
    """Token ids ``(B, T)`` → ``(B, T, d_model)``: ``√d_model``-scaled embedding + positions.

    With ``positional="rope"`` positions live inside attention, so only dropout is applied.
    """

    def __init__(self, cfg: TransformerConfig, vocab_size: int, embedding: nn.Embedding | None):
        super().__init__()
        self.d_model = cfg.d_model
        if embedding is None:
            embedding = nn.Embedding(vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
            nn.init.normal_(embedding.weight, std=cfg.d_model**-0.5)
            with torch.no_grad():
                embedding.weight[cfg.pad_id].zero_()
        self.embedding = embedding
        if cfg.positional == "sinusoidal":
            self.position = SinusoidalPositionalEncoding(cfg.d_model, dropout=cfg.dropout)
        elif cfg.positional == "learned":
            self.position = LearnedPositionalEmbedding(
                cfg.max_len, cfg.d_model, dropout=cfg.dropout
            )
        else:
            self.position = None
            self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, ids: Tensor, offset: int = 0) -> Tensor:
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(
                f"ids must be an integer tensor (B, T), got {ids.dtype} {tuple(ids.shape)}"
            )
        n = self.embedding.num_embeddings
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
            raise ValueError(
                f"ids must lie in [0, {n}), got min {int(ids.min())}, max {int(ids.max())}"
            )
        x = self.embedding(ids) * math.sqrt(self.d_model)  # (B, T, d_model)
        return self.dropout(x) if self.position is None else self.position(x, offset)
