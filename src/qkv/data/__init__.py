"""Data for translation: parallel corpora, the BPE tokenizer, token-bucketed batches."""

from qkv.data.batching import Batch, collate, encode_pairs, epoch_order, make_batches
from qkv.data.corpus import SPLITS, default_data_dir, multi30k, read_lines, read_parallel
from qkv.data.tokenizer import Tokenizer

__all__ = [
    "SPLITS",
    "Batch",
    "Tokenizer",
    "collate",
    "default_data_dir",
    "encode_pairs",
    "epoch_order",
    "make_batches",
    "multi30k",
    "read_lines",
    "read_parallel",
]
