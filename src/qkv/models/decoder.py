"""The decoder stack, with per-layer KV caches for incremental decoding.

Shapes: ``tgt ids (B, T)``, ``memory (B, S, d_model)`` → logits ``(B, T, tgt_vocab_size)``.
"""

from __future__ import annotations

from torch import Tensor, nn

from qkv.cache import KVCache
from qkv.models.config import TransformerConfig
from qkv.models.layers import DecoderLayer, Embedder

__all__ = ["Decoder", "DecoderCache"]


class DecoderCache:
    """Every decoder layer's self-attention cache and cross-attention (memory) cache.

    ``len(cache)`` is the number of target positions decoded so far (the position offset).
    ``reorder(index)`` follows surviving beams, or drops finished sentences.
    """

    def __init__(self, n_layers: int) -> None:
        self.self_attn = [KVCache() for _ in range(n_layers)]
        self.cross_attn = [KVCache() for _ in range(n_layers)]

    def __len__(self) -> int:
        return len(self.self_attn[0]) if self.self_attn else 0

    def reorder(self, index: Tensor) -> None:
        for cache in (*self.self_attn, *self.cross_attn):
            cache.reorder(index)


class Decoder(nn.Module):
    """Embedding + positions, ``n_decoder_layers`` blocks, final LN (pre-LN), output projection.

    >>> cfg = TransformerConfig(src_vocab_size=10, tgt_vocab_size=12, d_model=16, n_heads=2)
    >>> Decoder(cfg)(torch.tensor([[1, 5]]), torch.randn(1, 3, 16)).shape
    torch.Size([1, 2, 12])
    """

    def __init__(self, cfg: TransformerConfig, embedding: nn.Embedding | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedder(cfg, cfg.tgt_vocab_size, embedding)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_decoder_layers))
        self.norm = nn.LayerNorm(cfg.d_model) if cfg.norm_first else nn.Identity()
        self.out = nn.Linear(cfg.d_model, cfg.tgt_vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.out.weight = self.embed.embedding.weight

    def new_cache(self) -> DecoderCache:
        return DecoderCache(len(self.layers))

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        memory_mask: Tensor | None = None,
        *,
        cache: DecoderCache | None = None,
    ) -> Tensor:
        """Logits ``(B, T, tgt_vocab)`` for target ids ``tgt (B, T)``.

        ``memory_mask``: bool ``(B, 1, 1, S)``, True = may attend. With ``cache``, ``tgt``
        holds only the new tokens and positions start at ``len(cache)``; the memory's keys and
        values are projected on the first step only (``memory`` must still be passed).
        """
        offset = 0 if cache is None else len(cache)
        if offset + tgt.shape[1] > self.cfg.max_len and self.cfg.positional == "learned":
            raise ValueError(f"target length {offset + tgt.shape[1]} > max_len={self.cfg.max_len}")
        x = self.embed(tgt, offset)  # (B, T, d_model)
        for i, layer in enumerate(self.layers):
            x = layer(
                x, memory, memory_mask,
                self_cache=None if cache is None else cache.self_attn[i],
                cross_cache=None if cache is None else cache.cross_attn[i],
            )  # fmt: skip
        return self.out(self.norm(x))  # (B, T, tgt_vocab)
