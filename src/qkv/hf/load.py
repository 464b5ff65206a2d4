"""Load a local transformers model directory (offline) with qkv attention, and say its kind.

:func:`load_model` reads ``DIR/config.json`` and picks the model class by what the model is:

==================  =============================================  ==========================
kind                recognised by                                   loaded with
==================  =============================================  ==========================
``encoder-decoder`` ``config.is_encoder_decoder``                  ``AutoModelForSeq2SeqLM``
``decoder``         an architecture ``*ForCausalLM``/``*LMHeadModel`` ``AutoModelForCausalLM``
                    (or ``config.is_decoder``)
``encoder``         anything else (BERT-like)                       ``AutoModel``
==================  =============================================  ==========================

Nothing is downloaded (``local_files_only=True``). The tokenizer is loaded when the directory
has one. :meth:`LoadedModel.attention` runs the model once and returns its per-layer, per-head
attention maps (:class:`~qkv.capture.AttentionMaps`), through :mod:`qkv.hf.capture`;
:meth:`LoadedModel.generate` generates (greedy) and returns the maps of every step, merged.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qkv.capture.maps import AttentionMaps
from qkv.hf.capture import capture_attention

__all__ = ["KINDS", "LoadedModel", "load_model", "model_kind"]

KINDS = ("encoder", "decoder", "encoder-decoder")
_DECODER_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def model_kind(config: Any) -> str:
    """``"encoder"``, ``"decoder"`` or ``"encoder-decoder"`` of a transformers config."""
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder"
    archs = getattr(config, "architectures", None) or []
    if any(a.endswith(_DECODER_SUFFIXES) for a in archs) or getattr(config, "is_decoder", False):
        return "decoder"
    return "encoder"


@dataclass
class LoadedModel:
    """A transformers model loaded by :func:`load_model`."""

    model: nn.Module  # in eval mode, attn_implementation="qkv"
    kind: str  # one of KINDS
    tokenizer: Any | None  # the directory's tokenizer, or None
    path: Path

    def attention(
        self,
        input_ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        decoder_input_ids: Tensor | None = None,
        layers: Sequence[int | str] | None = None,
        heads: Sequence[int] | None = None,
        tokens: Sequence[str] | None = None,
        source_tokens: Sequence[str] | None = None,
        batch_index: int = 0,
    ) -> AttentionMaps:
        """Run the model once on ``input_ids (B, T)``; per-layer, per-head attention maps.

        ``attention_mask (B, T)``: 1 for tokens, 0 for padding (default: no padding).
        For an encoder-decoder, ``input_ids`` is the source and ``decoder_input_ids`` the
        target prefix (default: the decoder start token); the maps hold the encoder's
        self-attention, the decoder's causal self-attention and its cross-attention.
        ``layers``/``heads``: see :func:`qkv.hf.capture_attention` (only the chosen heads
        are computed). ``tokens`` label the (decoder) queries, ``source_tokens`` the source.
        """
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
            got = getattr(input_ids, "shape", type(input_ids).__name__)
            raise ValueError(f"input_ids must be a (B, T) tensor of token ids, got {got}")
        kwargs: dict[str, Tensor] = {}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if self.kind == "encoder-decoder":
            if decoder_input_ids is None:
                start = self.model.config.decoder_start_token_id
                if start is None:
                    raise ValueError("decoder_input_ids is required: the config has no "
                                     "decoder_start_token_id")  # fmt: skip
                decoder_input_ids = torch.full((input_ids.shape[0], 1), int(start))
            kwargs["decoder_input_ids"] = decoder_input_ids
        elif decoder_input_ids is not None:
            raise ValueError(f"decoder_input_ids is only for encoder-decoder models, this one "
                             f"is {self.kind!r}")  # fmt: skip
        with torch.no_grad(), capture_attention(self.model, layers, heads) as cap:
            self.model(input_ids=input_ids, **kwargs)
        src = source_tokens if self.kind == "encoder-decoder" else None
        return cap.maps(tokens=tokens, source_tokens=src, batch_index=batch_index)

    def generate(
        self,
        input_ids: Tensor,
        *,
        max_new_tokens: int = 20,
        layers: Sequence[int | str] | None = None,
        heads: Sequence[int] | None = None,
        tokens: Sequence[str] | None = None,
        source_tokens: Sequence[str] | None = None,
        batch_index: int = 0,
    ) -> tuple[Tensor, AttentionMaps]:
        """Greedy ``generate`` from ``input_ids (B, T)``, capturing attention at every step.

        Returns ``(sequences, maps)``: the model's output ids and the whole-sequence maps of
        batch row ``batch_index`` (steps merged; an encoder-decoder adds the encoder's maps
        and the cross-attention of every generated token to the source). ``tokens`` label
        the decoder side, ``source_tokens`` the source.
        """
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
            got = getattr(input_ids, "shape", type(input_ids).__name__)
            raise ValueError(f"input_ids must be a (B, T) tensor of token ids, got {got}")
        if self.kind == "encoder":
            raise ValueError("generate needs a decoder; this model is an encoder")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        with torch.no_grad(), capture_attention(self.model, layers, heads) as cap:
            seq = self.model.generate(input_ids=input_ids, max_new_tokens=max_new_tokens,
                                      do_sample=False, num_beams=1)  # fmt: skip
        src = source_tokens if self.kind == "encoder-decoder" else None
        return seq, cap.maps(tokens=tokens, source_tokens=src, batch_index=batch_index)


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load the transformers model in directory ``path`` (offline) with qkv attention.

    Raises ``FileNotFoundError`` when ``path`` is not a directory holding ``config.json``.

    >>> m = load_model("checkpoints/my-llama")        # doctest: +SKIP
    >>> m.kind, m.attention(ids, heads=[0]).layers[:2]  # doctest: +SKIP
    """
    import transformers as tf

    from qkv.hf.registry import register

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"path must be a transformers model directory with config.json, "
                                f"got {str(path)!r}")  # fmt: skip
    try:
        json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path / 'config.json'} is not valid JSON: {e}") from None
    register()
    config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
    kind = model_kind(config)
    auto = {"encoder-decoder": tf.AutoModelForSeq2SeqLM, "decoder": tf.AutoModelForCausalLM,
            "encoder": tf.AutoModel}[kind]  # fmt: skip
    model = auto.from_pretrained(path, local_files_only=True, attn_implementation="qkv",
                                 dtype=dtype).eval()  # fmt: skip
    tokenizer = None
    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                                          "spiece.model", "source.spm")):  # fmt: skip
        try:
            tokenizer = tf.AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # a broken or unsupported tokenizer: say which, once
            raise ValueError(f"the tokenizer in {str(path)!r} could not be loaded: {e}") from e
    return LoadedModel(model, kind, tokenizer, path)
