"""Token embedding and positional information.

Two families:

* added to the token embeddings ``(B, T, d_model)``: :class:`SinusoidalPositionalEncoding`
  (Vaswani et al. 2017) and :class:`LearnedPositionalEmbedding`;
* applied inside attention, handed to ``MultiHeadAttention(position=...)``:
  :class:`RotaryEmbedding` (RoPE, rotates q and k) and :class:`ALiBi` (a bias on the scores).

Every module takes an ``offset``: the position of the first token, which is the KV cache's
length during incremental decoding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from qkv import masks

__all__ = [
    "TokenEmbedding",
    "SinusoidalPositionalEncoding",
    "LearnedPositionalEmbedding",
    "RotaryEmbedding",
    "ALiBi",
]


def _check_bTd(x: Tensor, d_model: int, name: str = "x") -> None:
    if x.dim() != 3 or x.shape[-1] != d_model:
        raise ValueError(f"{name} must be (B, T, d_model={d_model}), got {tuple(x.shape)}")


class TokenEmbedding(nn.Module):
    """Token ids ``(B, T)`` → vectors ``(B, T, d_model)``, scaled by ``√d_model`` as in the paper.

    >>> TokenEmbedding(100, 16)(torch.tensor([[1, 2, 3]])).shape
    torch.Size([1, 3, 16])
    """

    def __init__(self, vocab_size: int, d_model: int, *, padding_idx: int | None = None) -> None:
        super().__init__()
        self.d_model = d_model
        self.embedding = nn.Embedding(vocab_size, d_model, padding_idx=padding_idx)

    @property
    def weight(self) -> Tensor:
        return self.embedding.weight

    def forward(self, ids: Tensor) -> Tensor:
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"ids must be an integer tensor (B, T), got dtype {ids.dtype}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.embedding.num_embeddings):
            raise ValueError(
                f"ids must lie in [0, {self.embedding.num_embeddings}), "
                f"got min {int(ids.min())}, max {int(ids.max())}"
            )
        return self.embedding(ids) * math.sqrt(self.d_model)  # (B, T, d_model)


class SinusoidalPositionalEncoding(nn.Module):
    """Adds ``PE[pos, 2i] = sin(pos / 10000^(2i/d))``, ``PE[pos, 2i+1] = cos(...)``.

    Any length works: the table is computed on demand (in float64, kept per device and dtype,
    grown by doubling; :meth:`table` returns read-only views of it). ``dropout`` follows the
    paper.

    >>> pe = SinusoidalPositionalEncoding(8)
    >>> pe(torch.zeros(1, 3, 8))[0, 0]  # position 0: sin 0 = 0, cos 0 = 1
    tensor([0., 1., 0., 1., 0., 1., 0., 1.])
    """

    def __init__(self, d_model: int, *, dropout: float = 0.0, base: float = 10000.0) -> None:
        super().__init__()
        if d_model % 2:
            raise ValueError(f"d_model must be even for sinusoidal encoding, got {d_model}")
        self.d_model, self.base = d_model, base
        self.dropout = nn.Dropout(dropout)
        self._tables: dict[tuple[torch.device, torch.dtype], Tensor] = {}

    def table(self, T: int, offset: int = 0, *, device=None, dtype=torch.float32) -> Tensor:
        """The encodings ``(T, d_model)`` of positions ``offset .. offset + T - 1`` (a view of
        the kept table: not to be written)."""
        device = torch.device("cpu") if device is None else torch.device(device)
        table = self._tables.get((device, dtype))
        if table is None or table.shape[0] < offset + T:
            n = max(64, 1 << (offset + T - 1).bit_length())  # grown by doubling
            # a plain tensor even when first needed under inference_mode (see RotaryEmbedding)
            with torch.inference_mode(False), torch.no_grad():
                pos = torch.arange(n, device=device, dtype=torch.float64)[:, None]
                i = torch.arange(0, self.d_model, 2, device=device, dtype=torch.float64)
                angle = pos / self.base ** (i / self.d_model)  # (n, d_model/2)
                pe = torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(-2)  # (n, d_model)
                table = self._tables[(device, dtype)] = pe.to(dtype)
        return table[offset : offset + T]

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        _check_bTd(x, self.d_model)
        return self.dropout(x + self.table(x.shape[1], offset, device=x.device, dtype=x.dtype))


class LearnedPositionalEmbedding(nn.Module):
    """Adds a learned vector per position (BERT, GPT-2); at most ``max_len`` positions."""

    def __init__(self, max_len: int, d_model: int, *, dropout: float = 0.0) -> None:
        super().__init__()
        self.max_len, self.d_model = max_len, d_model
        self.embedding = nn.Embedding(max_len, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        _check_bTd(x, self.d_model)
        T = x.shape[1]
        if offset + T > self.max_len:
            raise ValueError(
                f"positions {offset}..{offset + T - 1} exceed max_len={self.max_len} "
                "of the learned positional embedding"
            )
        pos = torch.arange(offset, offset + T, device=x.device)
        return self.dropout(x + self.embedding(pos))  # (B, T, d_model)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al. 2021) on q and k ``(B, h, T, d_k)``.

    Pairs dims ``(i, i + d_k/2)`` and rotates them by ``pos · base^(-2i/d_k)`` (the
    "rotate half" layout of GPT-NeoX and Llama). Scores then depend only on relative
    position.
    """

    def __init__(self, d_k: int, *, base: float = 10000.0) -> None:
        super().__init__()
        if d_k % 2:
            raise ValueError(f"d_k must be even for rotary embedding, got {d_k}")
        self.d_k = d_k
        inv_freq = base ** (-torch.arange(0, d_k, 2, dtype=torch.float64) / d_k)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        # cos and sin of every position so far, (n, d_k) each, per device: a decode step
        # slices one row instead of computing arange, products, cos, sin and cats again
        self._tables: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def _cos_sin(self, offset: int, T: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos and sin ``(T, d_k)`` (fp32) of positions ``offset .. offset + T - 1``."""
        table = self._tables.get(device)
        if table is None or table[0].shape[0] < offset + T:
            n = max(64, 1 << (offset + T - 1).bit_length())  # grown by doubling
            # plain tensors even when first needed under inference_mode: a later training
            # step saves them for backward, which inference tensors do not allow
            with torch.inference_mode(False), torch.no_grad():
                pos = torch.arange(n, device=device, dtype=torch.float32)
                angle = pos[:, None] * self.inv_freq.to(device)[None, :]  # (n, d_k/2)
                cos, sin = angle.cos(), angle.sin()
                table = (torch.cat([cos, cos], -1), torch.cat([sin, sin], -1))
            self._tables[device] = table
        return table[0][offset : offset + T], table[1][offset : offset + T]

    def _apply(self, fn, recurse: bool = True):
        self._tables = {}  # rebuilt from inv_freq where it now lives
        return super()._apply(fn, recurse)

    def rotate(self, x: Tensor, offset: int = 0) -> Tensor:
        """Rotate ``x (..., T, d_k)`` whose first row sits at position ``offset``."""
        if x.shape[-1] != self.d_k:
            raise ValueError(f"x must end in d_k={self.d_k}, got shape {tuple(x.shape)}")
        cos, sin = self._cos_sin(offset, x.shape[-2], x.device)  # (T, d_k)
        if x.dtype != torch.float32:
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        rotated_half = torch.cat([-x2, x1], dim=-1)
        return x * cos + rotated_half * sin

    def forward(self, q: Tensor, k: Tensor, q_offset: int = 0, k_offset: int = 0):
        return self.rotate(q, q_offset), self.rotate(k, k_offset)


class ALiBi(nn.Module):
    """Attention with linear biases (Press et al. 2022): a per-head distance penalty.

    ``bias(Tq, Tk)`` returns ``(1, n_heads, Tq, Tk)`` to add to the scaled scores.
    """

    def __init__(self, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads

    def bias(self, Tq: int, Tk: int, *, device=None, dtype=torch.float32) -> Tensor:
        return masks.alibi_bias(self.n_heads, Tq, Tk, device=device, dtype=dtype)
