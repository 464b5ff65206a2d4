"""Real pretrained weights through qkv: BERT / all-MiniLM-L6-v2, and PyTorch's own layers.

>>> from qkv import pretrained
>>> model = pretrained.load("all-MiniLM-L6-v2")          # doctest: +SKIP
>>> model.encode(["A man is playing a guitar."]).shape   # doctest: +SKIP
torch.Size([1, 384])
"""

from qkv.pretrained.bert import BertConfig, BertEmbeddings, BertModel, mask_from_hf
from qkv.pretrained.embeddings import cosine_similarity_matrix, encode, mean_pool
from qkv.pretrained.layer import Encoder, EncoderLayer, EncoderOutput
from qkv.pretrained.load import from_hf_state_dict, load, load_tokenizer, save, to_hf_state_dict
from qkv.pretrained.torch_layers import (
    encoder_from_torch,
    encoder_layer_from_torch,
    encoder_layer_to_torch,
    encoder_to_torch,
    state_dict_from_torch,
    state_dict_to_torch,
)

__all__ = [
    "BertConfig",
    "BertEmbeddings",
    "BertModel",
    "Encoder",
    "EncoderLayer",
    "EncoderOutput",
    "cosine_similarity_matrix",
    "encode",
    "encoder_from_torch",
    "encoder_layer_from_torch",
    "encoder_layer_to_torch",
    "encoder_to_torch",
    "from_hf_state_dict",
    "load",
    "load_tokenizer",
    "mask_from_hf",
    "mean_pool",
    "save",
    "state_dict_from_torch",
    "state_dict_to_torch",
    "to_hf_state_dict",
]
