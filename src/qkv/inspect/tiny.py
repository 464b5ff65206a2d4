"""Tiny random-weight models built from :class:`~qkv.MultiHeadAttention`, for ``--model random``.

They exist so that every inspection tool (capture, statistics, ablation, plots, the viewer)
works end to end before a trained model is wired in, and so tests have small models whose
attention can be checked by hand. Weights are random (seeded): the maps show mechanics, not
linguistics.

Shapes: ids ``(B, T)`` → hidden ``(B, T, d_model)``; the seq2seq decoder's logits
``(B, T_tgt, vocab)``.

>>> enc = TinyEncoder()
>>> toks, ids = enc.tokenize("The boy trains the puppy.")
>>> enc(ids).shape
torch.Size([1, 8, 32])
"""

from __future__ import annotations

import re
import zlib

import torch
from torch import Tensor, nn

from qkv.attention import MultiHeadAttention
from qkv.cache import KVCache
from qkv.positional import SinusoidalPositionalEncoding, TokenEmbedding

__all__ = ["TinyEncoder", "TinySeq2Seq", "simple_tokenize"]

SPECIALS = ["[PAD]", "[CLS]", "[SEP]", "<s>", "</s>"]


def simple_tokenize(text: str) -> list[str]:
    """Words and single punctuation marks: ``"it's tired."`` → ``["it", "'", "s", "tired", "."]``."""
    return re.findall(r"\w+|[^\w\s]", text)


def token_id(token: str, vocab_size: int) -> int:
    """A stable id for any token (hashing), so a random model accepts any sentence."""
    if token in SPECIALS:
        return SPECIALS.index(token)
    return len(SPECIALS) + zlib.crc32(token.lower().encode()) % (vocab_size - len(SPECIALS))


class Block(nn.Module):
    """Post-norm transformer layer: self-attention (+ optional cross-attention) and a FFN."""

    def __init__(self, d_model: int, n_heads: int, *, cross: bool = False) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads)
        self.cross_attn = MultiHeadAttention(d_model, n_heads) if cross else None
        self.ff = nn.Sequential(
            nn.Linear(d_model, 2 * d_model), nn.GELU(), nn.Linear(2 * d_model, d_model)
        )
        n_norms = 3 if cross else 2
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(n_norms))

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        *,
        causal: bool = False,
        caches: tuple[KVCache, KVCache] | None = None,
    ) -> Tensor:
        self_cache, cross_cache = caches if caches is not None else (None, None)
        x = self.norms[0](x + self.self_attn(x, causal=causal, cache=self_cache))
        if self.cross_attn is not None:
            x = self.norms[2](x + self.cross_attn(x, context=memory, cache=cross_cache))
        return self.norms[1](x + self.ff(x))  # (B, T, d_model)


class Stack(nn.Module):
    """Blocks under ``.layers``, so that module names read ``encoder.layers.0.self_attn`` and
    ``decoder.layers.0.cross_attn``, as in :mod:`qkv.models` and the pretrained encoders."""

    def __init__(self, blocks: list[Block]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x  # (B, T, d_model)


class TinyEncoder(nn.Module):
    """A random BERT-like encoder: ``[CLS] tokens [SEP]`` → hidden states ``(B, T, d_model)``."""

    def __init__(
        self,
        vocab_size: int = 1000,
        d_model: int = 32,
        n_heads: int = 4,
        n_layers: int = 2,
        *,
        seed: int = 0,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.vocab_size = vocab_size
        self.embed = TokenEmbedding(vocab_size, d_model)
        self.pos = SinusoidalPositionalEncoding(d_model)
        self.encoder = Stack([Block(d_model, n_heads) for _ in range(n_layers)])
        self.eval()

    def tokenize(self, text: str) -> tuple[list[str], Tensor]:
        """``text`` → (tokens with ``[CLS]``/``[SEP]``, ids ``(1, T)``)."""
        tokens = ["[CLS]", *simple_tokenize(text), "[SEP]"]
        return tokens, torch.tensor([[token_id(t, self.vocab_size) for t in tokens]])

    def forward(self, ids: Tensor) -> Tensor:
        return self.encoder(self.pos(self.embed(ids)))  # (B, T, d_model)


class TinySeq2Seq(nn.Module):
    """A random encoder–decoder: encoder self, decoder causal self and cross-attention."""

    def __init__(
        self,
        vocab_size: int = 1000,
        d_model: int = 32,
        n_heads: int = 4,
        n_layers: int = 2,
        *,
        seed: int = 0,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.vocab_size = vocab_size
        self.embed = TokenEmbedding(vocab_size, d_model)  # shared by source and target
        self.pos = SinusoidalPositionalEncoding(d_model)
        self.encoder = Stack([Block(d_model, n_heads) for _ in range(n_layers)])
        self.decoder = Stack([Block(d_model, n_heads, cross=True) for _ in range(n_layers)])
        self.lm_head = nn.Linear(d_model, vocab_size)
        self.eval()

    def encode(self, src: Tensor) -> Tensor:
        """Source ids ``(B, T_src)`` → memory ``(B, T_src, d_model)``."""
        return self.encoder(self.pos(self.embed(src)))

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        *,
        caches: list[tuple[KVCache, KVCache]] | None = None,
        offset: int = 0,
    ) -> Tensor:
        """Target ids ``(B, T_new)`` → logits ``(B, T_new, vocab)``; ``offset`` = cached length."""
        y = self.pos(self.embed(tgt), offset)  # (B, T_new, d_model)
        for i, layer in enumerate(self.decoder.layers):
            y = layer(y, memory, causal=True, caches=None if caches is None else caches[i])
        return self.lm_head(y)

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        """Teacher-forced logits ``(B, T_tgt, vocab)``."""
        return self.decode(tgt, self.encode(src))

    @torch.no_grad()
    def greedy(self, src: Tensor, max_len: int = 8, *, bos: int = 3, eos: int = 4) -> Tensor:
        """Greedy decoding over a KV cache, one token per step; returns ``(B, ≤ 1 + max_len)``."""
        memory = self.encode(src)  # (B, T_src, d_model)
        caches = [(KVCache(), KVCache()) for _ in self.decoder.layers]
        out = torch.full((src.shape[0], 1), bos, dtype=torch.long)
        for step in range(max_len):
            logits = self.decode(out[:, -1:], memory, caches=caches, offset=step)
            nxt = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            out = torch.cat([out, nxt], dim=1)
            if bool((nxt == eos).all()):
                break
        return out
