"""qkv: attention for PyTorch, in full, fast, and open to inspection.

Mask convention everywhere: ``True`` means "may attend".
"""

from qkv import functional, masks
from qkv.attention import MultiHeadAttention
from qkv.cache import KVCache
from qkv.functional import AttentionSteps, attention_steps, scaled_dot_product_attention
from qkv.positional import (
    ALiBi,
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    TokenEmbedding,
)

__version__ = "0.1.0"

__all__ = [
    "ALiBi",
    "AttentionSteps",
    "KVCache",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
    "TokenEmbedding",
    "attention_steps",
    "functional",
    "masks",
    "scaled_dot_product_attention",
]
