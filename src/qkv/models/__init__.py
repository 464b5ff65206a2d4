"""Transformer models built from qkv's attention: encoder–decoder and decoder-only."""

from qkv.models.causal_lm import CausalLM
from qkv.models.config import TransformerConfig
from qkv.models.decoder import Decoder, DecoderCache
from qkv.models.encoder import Encoder, padding_mask
from qkv.models.io import load_pretrained, save_pretrained
from qkv.models.layers import DecoderLayer, EncoderLayer, FeedForward
from qkv.models.seq2seq import Seq2SeqTransformer

__all__ = [
    "CausalLM",
    "Decoder",
    "DecoderCache",
    "DecoderLayer",
    "Encoder",
    "EncoderLayer",
    "FeedForward",
    "Seq2SeqTransformer",
    "TransformerConfig",
    "load_pretrained",
    "padding_mask",
    "save_pretrained",
]
