"""``TransformerConfig``: every size and choice of an encoder–decoder or decoder-only model.

A frozen dataclass, validated once in ``__post_init__`` (gpt-fast ``ModelArgs`` style), and
stored as JSON next to the weights (:mod:`qkv.models.io`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

__all__ = ["TransformerConfig"]

POSITIONAL_KINDS = ("sinusoidal", "learned", "rope")
ACTIVATIONS = ("relu", "gelu")


@dataclass(frozen=True)
class TransformerConfig:
    """Sizes and choices of a transformer (Vaswani et al. 2017 defaults, smaller).

    Args:
        src_vocab_size, tgt_vocab_size: vocabulary sizes (equal for a joint vocabulary;
            a :class:`~qkv.models.CausalLM` uses ``tgt_vocab_size`` only).
        d_model: width; ``d_k = d_model // n_heads``.
        n_heads, n_kv_heads: query heads and key/value heads (``None`` = ``n_heads``).
        d_ff: hidden width of the position-wise feed-forward network.
        n_encoder_layers, n_decoder_layers: depth of each stack.
        dropout: residual, embedding and attention-weight dropout.
        norm_first: pre-LN (``True``, stabler) or post-LN as in the paper (``False``).
        positional: ``"sinusoidal"``, ``"learned"`` (up to ``max_len``) or ``"rope"``.
        max_len: longest sequence (learned positions, generation limit).
        tie_embeddings: decoder input embedding = output projection.
        share_src_tgt_embeddings: encoder and decoder share one embedding (joint vocab).
        activation: ``"relu"`` or ``"gelu"`` in the feed-forward network.
        pad_id, bos_id, eos_id: special token ids.

    >>> TransformerConfig(src_vocab_size=100, tgt_vocab_size=100, d_model=64, n_heads=4).d_k
    16
    """

    src_vocab_size: int
    tgt_vocab_size: int
    d_model: int = 256
    n_heads: int = 4
    n_kv_heads: int | None = None
    d_ff: int = 1024
    n_encoder_layers: int = 3
    n_decoder_layers: int = 3
    dropout: float = 0.1
    norm_first: bool = True
    positional: str = "sinusoidal"
    max_len: int = 256
    tie_embeddings: bool = True
    share_src_tgt_embeddings: bool = False
    activation: str = "relu"
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    def __post_init__(self) -> None:
        for name in ("src_vocab_size", "tgt_vocab_size", "d_model", "n_heads", "d_ff", "max_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("n_encoder_layers", "n_decoder_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model must be divisible by n_heads: d_model={self.d_model}, "
                f"n_heads={self.n_heads}"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_heads must be a multiple of n_kv_heads: n_heads={self.n_heads}, "
                f"n_kv_heads={self.n_kv_heads}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.positional not in POSITIONAL_KINDS:
            raise ValueError(
                f"positional must be one of {POSITIONAL_KINDS}, got {self.positional!r}"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.positional == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        if self.positional == "rope" and self.d_k % 2:
            raise ValueError(f"rope needs an even d_k = d_model // n_heads, got {self.d_k}")
        if self.share_src_tgt_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(
                "share_src_tgt_embeddings needs src_vocab_size == tgt_vocab_size, got "
                f"{self.src_vocab_size} and {self.tgt_vocab_size}"
            )
        for name in ("pad_id", "bos_id", "eos_id"):
            value = getattr(self, name)
            if not 0 <= value < min(self.src_vocab_size, self.tgt_vocab_size):
                raise ValueError(f"{name}={value} lies outside the vocabulary")

    @property
    def d_k(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TransformerConfig:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("config JSON must be an object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown TransformerConfig fields in JSON: {unknown}")
        return cls(**data)
