"""qkv's name in transformers: registering the attention and mask functions, and running a
model with them for the length of a block.

Its own module so that the package's modules (capture, switching heads off, the step
replay, loading) take :func:`running_qkv` and :func:`register` from here, and
:mod:`qkv.hf` only re-exports them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["NAME", "register", "running_qkv"]

NAME = "qkv"


def register(name: str = NAME) -> None:
    """Register qkv's attention and mask functions with transformers under ``name``.

    Afterwards ``from_pretrained(..., attn_implementation=name)``, ``from_config(...)`` and
    ``model.set_attn_implementation(name)`` use qkv. Idempotent; done on ``import qkv.hf``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from qkv.hf.attention import qkv_attention_forward  # imports the modules that import this one
    from qkv.hf.masks import qkv_mask

    AttentionInterface.register(name, qkv_attention_forward)
    AttentionMaskInterface.register(name, qkv_mask)


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
