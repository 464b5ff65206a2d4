"""The encoder stack: ``src ids (B, S)`` → memory ``(B, S, d_model)``."""

from __future__ import annotations

from torch import Tensor, nn

from qkv.models.config import TransformerConfig
from qkv.models.layers import Embedder, EncoderLayer

__all__ = ["Encoder", "padding_mask"]


def padding_mask(ids: Tensor, pad_id: int) -> Tensor:
    """``ids (B, S)`` → bool ``(B, 1, 1, S)``, **True = may attend** (a real token, not pad)."""
    return (ids != pad_id)[:, None, None, :]


class Encoder(nn.Module):
    """Embedding + positions, ``n_encoder_layers`` self-attention blocks, final LN (pre-LN).

    >>> cfg = TransformerConfig(src_vocab_size=10, tgt_vocab_size=10, d_model=16, n_heads=2)
    >>> Encoder(cfg)(torch.tensor([[3, 4, 0]])).shape
    torch.Size([1, 3, 16])
    """

    def __init__(self, cfg: TransformerConfig, embedding: nn.Embedding | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedder(cfg, cfg.src_vocab_size, embedding)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))
        self.norm = nn.LayerNorm(cfg.d_model) if cfg.norm_first else nn.Identity()

    def forward(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """``src (B, S)`` ids; ``src_mask`` bool ``(B, 1, 1, S)``, True = may attend
        (default: every non-pad token)."""
        if src_mask is None:
            src_mask = padding_mask(src, self.cfg.pad_id)
        x = self.embed(src)  # (B, S, d_model)
        for layer in self.layers:
            x = layer(x, src_mask)
        return self.norm(x)  # (B, S, d_model)
