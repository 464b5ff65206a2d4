"""``Seq2SeqTransformer``: the encoder–decoder of Vaswani et al. (2017).

``encode(src)`` reads the source once; ``decode(tgt, memory, ...)`` gives next-token logits,
incrementally with a :class:`~qkv.models.decoder.DecoderCache`.
"""

from __future__ import annotations

from torch import Tensor, nn

from qkv.models.config import TransformerConfig
from qkv.models.decoder import Decoder, DecoderCache
from qkv.models.encoder import Encoder, padding_mask

__all__ = ["Seq2SeqTransformer"]


class Seq2SeqTransformer(nn.Module):
    """Encoder–decoder transformer.

    >>> cfg = TransformerConfig(src_vocab_size=50, tgt_vocab_size=50, d_model=32, n_heads=4)
    >>> model = Seq2SeqTransformer(cfg)
    >>> src, tgt_in = torch.tensor([[5, 6, 7, 2]]), torch.tensor([[1, 8, 9]])
    >>> model(src, tgt_in).shape  # (B, T, tgt_vocab)
    torch.Size([1, 3, 50])
    """

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        shared = self.encoder.embed.embedding if cfg.share_src_tgt_embeddings else None
        self.decoder = Decoder(cfg, shared)
        tied = {id(self.decoder.embed.embedding.weight)}
        for m in self.modules():
            if isinstance(m, nn.Linear) and id(m.weight) not in tied:
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def src_mask(self, src: Tensor) -> Tensor:
        """bool ``(B, 1, 1, S)``, True = may attend (non-pad source tokens)."""
        return padding_mask(src, self.cfg.pad_id)

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """``src (B, S)`` → memory ``(B, S, d_model)``."""
        return self.encoder(src, src_mask)

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        memory_mask: Tensor | None,
        *,
        cache: DecoderCache | None = None,
    ) -> Tensor:
        """Logits ``(B, T, tgt_vocab)`` (see :meth:`Decoder.forward`)."""
        return self.decoder(tgt, memory, memory_mask, cache=cache)

    def new_cache(self) -> DecoderCache:
        return self.decoder.new_cache()

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        """Teacher forcing: ``src (B, S)``, decoder input ``tgt (B, T)`` → logits ``(B, T, V)``."""
        mask = self.src_mask(src)
        return self.decode(tgt, self.encode(src, mask), mask)
