"""qkv inside Hugging Face transformers: ``attn_implementation="qkv"`` and exact weights.

>>> import qkv.hf                                    # registers "qkv" (or: qkv.hf.register())
>>> from transformers import AutoModelForCausalLM    # doctest: +SKIP
>>> model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="qkv")  # doctest: +SKIP
>>> with qkv.hf.capture_attention(model, layers=[3], heads=[5]) as cap:  # doctest: +SKIP
...     model(ids)
>>> cap.records[0].weights.shape  # (B, 1, T, T): eager's output_attentions  # doctest: +SKIP

Modules: :mod:`qkv.hf.attention` (the adapter and what falls back), :mod:`qkv.hf.masks` (the
boolean mask function), :mod:`qkv.hf.capture` (per-head weights), :mod:`qkv.hf.ablate`
(switching heads off), :mod:`qkv.hf.load` (a local model directory, offline),
:mod:`qkv.hf.steps` (one call, step by step), :mod:`qkv.hf.registry` (registering the name,
:func:`running_qkv`). The maps they build are :class:`qkv.capture.AttentionMaps`. Guide:
``docs/hf.md``.
"""

from qkv.hf.ablate import head_count, heads_off
from qkv.hf.attention import qkv_attention_forward
from qkv.hf.capture import HFCapture, HFRecord, attention_modules, capture_attention
from qkv.hf.load import LoadedModel, load_model
from qkv.hf.masks import qkv_mask
from qkv.hf.registry import NAME, register, running_qkv

__all__ = [
    "NAME",
    "HFCapture",
    "HFRecord",
    "LoadedModel",
    "attention_modules",
    "capture_attention",
    "head_count",
    "heads_off",
    "load_model",
    "qkv_attention_forward",
    "qkv_mask",
    "register",
    "running_qkv",
]

register()  # import qkv.hf registers "qkv" with transformers
