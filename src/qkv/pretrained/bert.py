"""A BERT encoder built from qkv's modules, called the way HuggingFace's ``BertModel`` is.

    input_ids (B, T) ─ token + token_type + position embeddings ─ LayerNorm ─ (B, T, d)
                    ─ n_layers × post-LN EncoderLayer (qkv MultiHeadAttention, exact GELU)
                    ─ last_hidden_state (B, T, d) ─ pooler: tanh(W · h[CLS]) (B, d)

HuggingFace's ``attention_mask`` is ``(B, T)`` with **1 = real token, 0 = padding**; it is
converted once, in :func:`mask_from_hf`, to qkv's bool ``(B, 1, 1, T)``, **True = may
attend**. Load real weights with :func:`qkv.pretrained.load`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qkv import masks
from qkv.positional import LearnedPositionalEmbedding
from qkv.pretrained.layer import Encoder, EncoderLayer, EncoderOutput

__all__ = ["BertConfig", "BertEmbeddings", "BertModel", "mask_from_hf"]

# HuggingFace's hidden_act names -> qkv.pretrained.layer.ACTIVATIONS
_HF_ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh",
                   "gelu_pytorch_tanh": "gelu_tanh"}  # fmt: skip


@dataclass(frozen=True)
class BertConfig:
    """Sizes of a BERT encoder; :meth:`from_hf` reads a HuggingFace ``config.json`` dict.

    Defaults are all-MiniLM-L6-v2's.
    """

    vocab_size: int = 30522
    d_model: int = 384
    n_layers: int = 6
    n_heads: int = 12
    d_ff: int = 1536
    activation: str = "gelu"
    max_len: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    dropout: float = 0.1
    attn_dropout: float = 0.1
    pad_token_id: int = 0
    pooler: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model must be divisible by n_heads: d_model={self.d_model}, "
                f"n_heads={self.n_heads}"
            )
        if self.activation not in ("relu", "gelu", "gelu_tanh"):
            raise ValueError(f"activation must be relu, gelu or gelu_tanh, got {self.activation!r}")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], *, pooler: bool = True) -> BertConfig:
        """From a HuggingFace BERT ``config.json`` (``hidden_size``, ``num_attention_heads``...)."""
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                "only position_embedding_type='absolute' is supported, got "
                f"{cfg['position_embedding_type']!r}"
            )
        act = cfg.get("hidden_act", "gelu")
        if act not in _HF_ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {sorted(_HF_ACTIVATIONS)}, got {act!r}")
        return cls(
            vocab_size=cfg["vocab_size"], d_model=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"], n_heads=cfg["num_attention_heads"],
            d_ff=cfg["intermediate_size"], activation=_HF_ACTIVATIONS[act],
            max_len=cfg.get("max_position_embeddings", 512),
            type_vocab_size=cfg.get("type_vocab_size", 2),
            layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
            dropout=cfg.get("hidden_dropout_prob", 0.1),
            attn_dropout=cfg.get("attention_probs_dropout_prob", 0.1),
            pad_token_id=cfg.get("pad_token_id", 0) or 0, pooler=pooler,
        )  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def mask_from_hf(attention_mask: Tensor | None, T: int) -> Tensor | None:
    """HuggingFace ``attention_mask (B, T)`` (1 = real token) → qkv ``(B, 1, 1, T)``, True = may attend.

    Returns ``None`` (no masking, the fast path) when every token is real.
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[1] != T:
        raise ValueError(
            f"attention_mask must be (B, T={T}) with 1 = real token, got shape "
            f"{tuple(attention_mask.shape)}"
        )
    if attention_mask.dtype.is_floating_point:
        raise TypeError(
            f"attention_mask must be integer or bool (1 = real token), got {attention_mask.dtype}"
        )
    padding = attention_mask == 0  # (B, T) True = padding: PyTorch's key_padding_mask
    if not bool(padding.any()):
        return None
    return masks.from_key_padding_mask(padding)  # (B, 1, 1, T) True = may attend


class BertEmbeddings(nn.Module):
    """``token(ids) + token_type(tt) + position`` → LayerNorm → dropout; ``(B, T)`` → ``(B, T, d)``."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.token = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_token_id)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.d_model)
        self.position = LearnedPositionalEmbedding(cfg.max_len, cfg.d_model)
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        if token_type_ids is None:
            x = self.token(input_ids) + self.token_type.weight[0]  # (B, T, d)
        else:
            x = self.token(input_ids) + self.token_type(token_type_ids)  # (B, T, d)
        return self.dropout(self.norm(self.position(x)))  # (B, T, d)


class BertModel(nn.Module):
    """BERT encoder with HuggingFace ``BertModel``'s calling convention.

    ``model(input_ids, attention_mask=None, token_type_ids=None, output_attentions=False,
    output_hidden_states=False)`` returns an :class:`~qkv.pretrained.layer.EncoderOutput`
    with ``last_hidden_state (B, T, d)``, ``pooler_output (B, d)``, ``hidden_states``
    (embeddings first, then every layer) and ``attentions`` (one ``(B, h, T, T)`` per layer).

    Attributes set by :func:`qkv.pretrained.load`: ``source_dir`` (the checkpoint directory)
    and ``tokenizer`` (its HuggingFace tokenizer, loaded offline on first use).

    >>> model = BertModel(BertConfig(n_layers=2)).eval()
    >>> model(torch.tensor([[101, 7592, 102]])).last_hidden_state.shape
    torch.Size([1, 3, 384])
    """

    def __init__(self, cfg: BertConfig, *, source_dir: str | Path | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.source_dir = None if source_dir is None else Path(source_dir)
        self._tokenizer = None
        self.max_seq_length: int | None = None  # encode()'s truncation (sentence-transformers')
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = Encoder([
            EncoderLayer(
                cfg.d_model, cfg.n_heads, cfg.d_ff, dropout=cfg.dropout,
                attn_dropout=cfg.attn_dropout, ff_dropout=0.0, activation=cfg.activation,
                norm_first=False, layer_norm_eps=cfg.layer_norm_eps,
            )
            for _ in range(cfg.n_layers)
        ])  # fmt: skip
        self.pooler = nn.Linear(cfg.d_model, cfg.d_model) if cfg.pooler else None

    @property
    def tokenizer(self):
        """The checkpoint's HuggingFace tokenizer, read offline from :attr:`source_dir`."""
        if self._tokenizer is None:
            if self.source_dir is None:
                raise AttributeError("this model was not loaded from a directory: no tokenizer")
            from qkv.loading import read_hf_tokenizer

            self._tokenizer = read_hf_tokenizer(self.source_dir)
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value) -> None:
        self._tokenizer = value

    def _check_ids(self, name: str, ids: Tensor, shape: tuple[int, ...] | None = None) -> None:
        if not isinstance(ids, Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise TypeError(
                f"{name} must be an integer tensor (B, T), got {getattr(ids, 'dtype', type(ids))}"
            )
        if ids.dim() != 2 or (shape is not None and tuple(ids.shape) != shape):
            want = "(B, T)" if shape is None else str(shape)
            raise ValueError(f"{name} must have shape {want}, got {tuple(ids.shape)}")

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
    ) -> EncoderOutput:
        """Encode ``input_ids (B, T)``.

        Args:
            input_ids: token ids ``(B, T)``, ``T <= config.max_len``.
            attention_mask: HuggingFace's ``(B, T)``, **1 = real token, 0 = padding**
                (converted to qkv's True = may attend by :func:`mask_from_hf`).
            token_type_ids: segment ids ``(B, T)``; default all 0.
            output_attentions: also return each layer's weights ``(B, h, T, T)``; otherwise
                they are never computed.
            output_hidden_states: also return the embeddings and every layer's output.
        """
        self._check_ids("input_ids", input_ids)
        if token_type_ids is not None:
            self._check_ids("token_type_ids", token_type_ids, tuple(input_ids.shape))
        x = self.embeddings(input_ids, token_type_ids)  # (B, T, d)
        mask = mask_from_hf(attention_mask, input_ids.shape[1])  # (B, 1, 1, T) or None
        out = self.encoder(
            x, mask, output_attentions=output_attentions, output_hidden_states=output_hidden_states
        )
        if self.pooler is not None:
            out.pooler_output = torch.tanh(self.pooler(out.last_hidden_state[:, 0]))  # (B, d)
        return out

    def encode(
        self,
        sentences: str | list[str],
        *,
        batch_size: int = 32,
        max_length: int | None = None,
        normalize: bool = True,
        progress: bool = False,
    ) -> Tensor:
        """Sentence embeddings ``(N, d_model)``: mean pooling over real tokens, L2-normalised.

        See :func:`qkv.pretrained.embeddings.encode`.

        >>> model.encode(["A man is playing a guitar."]).shape  # doctest: +SKIP
        torch.Size([1, 384])
        """
        from qkv.pretrained.embeddings import encode

        return encode(
            self, self.tokenizer, sentences, batch_size=batch_size, max_length=max_length,
            normalize=normalize, progress=progress,
        )  # fmt: skip
