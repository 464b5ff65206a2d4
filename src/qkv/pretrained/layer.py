"""A Transformer encoder layer and stack built from qkv's :class:`~qkv.MultiHeadAttention`.

Shapes: ``x (B, T, d_model)`` (batch first, always); ``mask (B|1, 1, 1|T, T)`` bool,
**True = may attend** (a key-padding mask from :func:`qkv.masks.padding` or
:func:`qkv.masks.from_key_padding_mask` is ``(B, 1, 1, T)``).

One layer serves both arrangements, by a constructor argument, as
``nn.TransformerEncoderLayer`` does::

    post-LN (BERT, norm_first=False)          pre-LN (norm_first=True)
    x = attn_norm(x + attn(x))                x = x + attn(attn_norm(x))
    x = ff_norm(x + ff(x))                    x = x + ff(ff_norm(x))

with ``ff(x) = ff_out(act(ff_in(x)))``. Checkpoint names (BERT's ``attention.self.query``,
PyTorch's ``self_attn.in_proj_weight``) are mapped by the loaders, never here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

from qkv.attention import MultiHeadAttention

__all__ = ["ACTIVATIONS", "Encoder", "EncoderLayer", "EncoderOutput"]

# name -> function; "gelu" is the exact erf form (BERT's and PyTorch's default)
ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@dataclass
class EncoderOutput:
    """What an encoder returns, named as HuggingFace's ``BaseModelOutput`` names it.

    Attributes:
        last_hidden_state: ``(B, T, d_model)``.
        hidden_states: ``None`` unless asked; else a tuple of ``n_layers + 1`` tensors
            ``(B, T, d_model)``: the embeddings (the encoder's input) first, then each layer's
            output (the last one after the final norm, when there is one).
        attentions: ``None`` unless asked; else one ``(B, h, T, T)`` tensor per layer, the
            softmax weights of every head (never averaged).
        pooler_output: ``(B, d_model)`` for models with a pooler (BERT's tanh on ``[CLS]``).
    """

    last_hidden_state: Tensor
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None
    pooler_output: Tensor | None = None

    def to_tuple(self) -> tuple:
        """The fields that are set, in HuggingFace's order (``out[0]`` is the last state)."""
        order = ("last_hidden_state", "pooler_output", "hidden_states", "attentions")
        return tuple(getattr(self, k) for k in order if getattr(self, k) is not None)

    def __getitem__(self, key: int | str):
        """``out[0]`` or ``out["last_hidden_state"]``, as code written for HF's outputs does."""
        return getattr(self, key) if isinstance(key, str) else self.to_tuple()[key]


class EncoderLayer(nn.Module):
    """Self-attention then a feed-forward block, each with a residual and a LayerNorm.

    Args:
        d_model: model width.
        n_heads: attention heads (``d_model % n_heads == 0``).
        d_ff: feed-forward width.
        dropout: dropout on each block's output before the residual add.
        attn_dropout: dropout on the attention weights (default ``dropout``).
        ff_dropout: dropout after the activation inside the feed-forward (default ``dropout``;
            BERT uses 0).
        activation: ``"relu"``, ``"gelu"`` (exact erf) or ``"gelu_tanh"``.
        norm_first: pre-LN when True, post-LN (BERT, the 2017 paper) when False.
        layer_norm_eps: epsilon of both LayerNorms.
        bias: biases in every Linear and LayerNorm.

    >>> layer = EncoderLayer(384, 12, 1536)
    >>> layer(torch.randn(2, 7, 384)).shape
    torch.Size([2, 7, 384])
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        *,
        dropout: float = 0.0,
        attn_dropout: float | None = None,
        ff_dropout: float | None = None,
        activation: str = "gelu",
        norm_first: bool = False,
        layer_norm_eps: float = 1e-5,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        for name, p in (("dropout", dropout), ("attn_dropout", attn_dropout),
                        ("ff_dropout", ff_dropout)):  # fmt: skip
            if p is not None and not 0.0 <= p < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {p!r}")
        self.activation, self.norm_first = activation, norm_first
        self.dropout = dropout
        self.ff_dropout = dropout if ff_dropout is None else ff_dropout
        attn_dropout = dropout if attn_dropout is None else attn_dropout
        self.self_attn = MultiHeadAttention(d_model, n_heads, bias=bias, dropout=attn_dropout)
        self.attn_norm = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.ff_in = nn.Linear(d_model, d_ff, bias=bias)
        self.ff_out = nn.Linear(d_ff, d_model, bias=bias)
        self.ff_norm = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)

    def _drop(self, x: Tensor, p: float) -> Tensor:
        return F.dropout(x, p, training=True) if self.training and p > 0 else x

    def _attend(self, x: Tensor, mask: Tensor | None, need_weights: bool):
        if need_weights:
            y, w = self.self_attn(x, mask=mask, need_weights=True)  # (B, T, d), (B, h, T, T)
            return self._drop(y, self.dropout), w
        return self._drop(self.self_attn(x, mask=mask), self.dropout), None

    def _ff(self, x: Tensor) -> Tensor:
        h = ACTIVATIONS[self.activation](self.ff_in(x))  # (B, T, d_ff)
        return self._drop(self.ff_out(self._drop(h, self.ff_dropout)), self.dropout)

    def forward(
        self, x: Tensor, mask: Tensor | None = None, *, need_weights: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``x (B, T, d_model)`` → ``(B, T, d_model)``; with ``need_weights`` also ``(B, h, T, T)``.

        ``mask``: bool, **True = may attend**, ``(B|1, 1, 1|T, T)`` or ``(T, T)``.
        """
        if self.norm_first:
            a, w = self._attend(self.attn_norm(x), mask, need_weights)
            x = x + a
            x = x + self._ff(self.ff_norm(x))
        else:
            a, w = self._attend(x, mask, need_weights)
            x = self.attn_norm(x + a)
            x = self.ff_norm(x + self._ff(x))
        return (x, w) if need_weights else x

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, norm_first={self.norm_first}"


class Encoder(nn.Module):
    """A stack of :class:`EncoderLayer` with an optional final LayerNorm (pre-LN stacks).

    >>> enc = Encoder([EncoderLayer(64, 4, 128) for _ in range(2)])
    >>> enc(torch.randn(2, 5, 64)).last_hidden_state.shape
    torch.Size([2, 5, 64])
    """

    def __init__(self, layers: list[EncoderLayer], norm: nn.LayerNorm | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        *,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
    ) -> EncoderOutput:
        """Run every layer on ``x (B, T, d_model)``; mask: bool, **True = may attend**.

        Attention weights are computed only when ``output_attentions`` is set.
        """
        hidden: list[Tensor] = [x] if output_hidden_states else []
        attentions: list[Tensor] = []
        for layer in self.layers:
            if output_attentions:
                x, w = layer(x, mask, need_weights=True)  # w: (B, h, T, T)
                attentions.append(w)
            else:
                x = layer(x, mask)  # (B, T, d_model)
            if output_hidden_states:
                hidden.append(x)
        if self.norm is not None:
            x = self.norm(x)
            if output_hidden_states:
                hidden[-1] = x
        return EncoderOutput(
            last_hidden_state=x,
            hidden_states=tuple(hidden) if output_hidden_states else None,
            attentions=tuple(attentions) if output_attentions else None,
        )
