"""The :class:`Loaded` record every model loader of :mod:`qkv.inspect.loaders` returns.

Its own module so that loaders (``qkv.inspect.minilm``, ``qkv.inspect.translation``) and the
registry (:mod:`qkv.inspect.loaders`) can both import it without importing each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from qkv.capture.maps import AttentionMaps

__all__ = ["Loaded"]


@dataclass
class Loaded:
    """An inspectable model.

    ``encode(text) -> (tokens, inputs)``: ``model(*inputs)`` runs it on the text.
    ``hidden(*inputs) -> (B, T, d)``: final token representations (default: the model's output).
    ``translate(text) -> list[AttentionMaps]``: greedy decoding, maps per step (seq2seq only;
    saved ``qkv.models`` directories also take ``beam=N``; transformers models give one
    merged map).
    ``attention(*inputs, tokens=) -> AttentionMaps``: the maps of one forward pass, for models
    that are not made of qkv attention modules (default: :func:`qkv.inspect.capture`).
    """

    model: nn.Module
    encode: Callable[[str], tuple[list[str], tuple]]
    hidden: Callable[..., Tensor] | None = None
    translate: Callable[[str], list[AttentionMaps]] | None = None
    name: str = ""
    full_model: nn.Module | None = None  # the whole seq2seq model when ``model`` is its encoder
    tokenizer: object = None  # its tokenizer (BLEU ablation, ``qkv.inspect.translation``)
    attention: Callable[..., AttentionMaps] | None = None
    hf: object = None  # the qkv.hf.LoadedModel of a transformers model directory
    # the qkv.translate.Translator a translator was loaded as: how `qkv translate` decodes it
    translator: object = None

    def maps(self, *inputs, tokens: list[str] | None = None) -> AttentionMaps:
        """Per-head maps of ``model(*inputs)``, every layer (the model's own capture)."""
        if self.attention is not None:
            return self.attention(*inputs, tokens=tokens)
        from qkv.capture.record import capture

        return capture(self.model, *inputs, tokens=tokens)

    def __post_init__(self) -> None:
        if self.hidden is None:
            self.hidden = self.model
