"""``CausalLM``: a decoder-only (GPT-style) language model from the same blocks.

Uses ``tgt_vocab_size`` and ``n_decoder_layers`` of the config; each block is an
:class:`~qkv.models.layers.EncoderLayer` run with ``causal=True``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qkv.cache import KVCache
from qkv.models.config import TransformerConfig
from qkv.models.layers import Embedder, EncoderLayer

__all__ = ["CausalLM"]


class CausalLM(nn.Module):
    """``ids (B, T)`` → next-token logits ``(B, T, vocab)``, optionally with KV caches.

    >>> cfg = TransformerConfig(src_vocab_size=1, tgt_vocab_size=40, d_model=32, n_heads=4)
    >>> lm = CausalLM(cfg)
    >>> lm(torch.tensor([[1, 7, 9]])).shape
    torch.Size([1, 3, 40])
    """

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedder(cfg, cfg.tgt_vocab_size, None)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_decoder_layers))
        self.norm = nn.LayerNorm(cfg.d_model) if cfg.norm_first else nn.Identity()
        self.out = nn.Linear(cfg.d_model, cfg.tgt_vocab_size, bias=False)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        if cfg.tie_embeddings:
            self.out.weight = self.embed.embedding.weight

    def new_cache(
        self, capacity: int | None = None, dtype: torch.dtype | None = None
    ) -> list[KVCache]:
        """One :class:`KVCache` per layer; ``capacity`` preallocates that many positions (the
        prompt plus the tokens to generate), ``dtype`` stores keys/values in another dtype."""
        return [KVCache(capacity=capacity, dtype=dtype) for _ in self.layers]

    def forward(self, ids: Tensor, *, cache: list[KVCache] | None = None) -> Tensor:
        """``ids (B, T)`` (only the new tokens when ``cache`` is given) → ``(B, T, vocab)``."""
        offset = 0 if cache is None else len(cache[0])
        x = self.embed(ids, offset)  # (B, T, d_model)
        for i, layer in enumerate(self.layers):
            x = layer(x, causal=True, cache=None if cache is None else cache[i])
        return self.out(self.norm(x))  # (B, T, vocab)
