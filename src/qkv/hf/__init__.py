"""qkv inside Hugging Face transformers: ``attn_implementation="qkv"`` and exact weights.

>>> import qkv.hf                                    # registers "qkv" (or: qkv.hf.register())
>>> from transformers import AutoModelForCausalLM    # doctest: +SKIP
>>> model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="qkv")  # doctest: +SKIP
>>> with qkv.hf.capture_attention(model, layers=[3], heads=[5]) as cap:  # doctest: +SKIP
...     model(ids)
>>> cap.records[0].weights.shape  # (B, 1, T, T): eager's output_attentions  # doctest: +SKIP

Modules: :mod:`qkv.hf.attention` (the adapter and what falls back), :mod:`qkv.hf.masks` (the
boolean mask function), :mod:`qkv.hf.capture` (per-head weights), :mod:`qkv.hf.ablate`
(switching heads off), :mod:`qkv.hf.load` (a local model directory, offline). Guide:
``docs/hf.md``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from qkv.hf.ablate import heads_off
from qkv.hf.attention import qkv_attention_forward
from qkv.hf.capture import HFCapture, HFRecord, attention_modules, capture_attention
from qkv.hf.load import LoadedModel, load_model
from qkv.hf.masks import qkv_mask

__all__ = [
    "NAME",
    "HFCapture",
    "HFRecord",
    "LoadedModel",
    "attention_modules",
    "capture_attention",
    "heads_off",
    "load_model",
    "qkv_attention_forward",
    "qkv_mask",
    "register",
    "running_qkv",
]

NAME = "qkv"


def register(name: str = NAME) -> None:
    """Register qkv's attention and mask functions with transformers under ``name``.

    Afterwards ``from_pretrained(..., attn_implementation=name)``, ``from_config(...)`` and
    ``model.set_attn_implementation(name)`` use qkv. Idempotent; done on ``import qkv.hf``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, qkv_attention_forward)
    AttentionMaskInterface.register(name, qkv_mask)


register()


@contextmanager
def running_qkv(model) -> Iterator[None]:
    """Within the block, ``model`` runs with ``attn_implementation="qkv"`` (switched and
    restored when it was loaded with another one); what capture, switching heads off and
    the step replay need, since only qkv's adapter sees their context."""
    register()
    previous = getattr(getattr(model, "config", None), "_attn_implementation", None)
    switch = previous is not None and previous != NAME
    if switch:
        model.set_attn_implementation(NAME)
    try:
        yield
    finally:
        if switch:
            model.set_attn_implementation(previous)
