"""``--model DIR`` for any local transformers model directory (offline), through :mod:`qkv.hf`.

A directory with weights and a ``config.json`` naming a ``model_type`` or ``architectures``
(not a BERT directory, which qkv runs with its own BERT, nor a :mod:`qkv.models` one) opens
with :func:`qkv.hf.load_model` (``attn_implementation="qkv"``, ``local_files_only=True``)
and its own tokenizer. The maps are the model's exact per-head weights (equal to eager's
``output_attentions``), captured by :func:`qkv.hf.capture_attention`. By kind:

==================  ==========================================================================
kind                what the text shows
==================  ==========================================================================
encoder             bidirectional self-attention of every layer
decoder             causal self-attention over the text (no generation)
encoder-decoder     the encoder's self-attention over the text; ``translate(text)`` decodes
                    (greedy, or transformers' beam search: :func:`translate_hf`) and adds
                    the decoder's causal self- and cross-attention
==================  ==========================================================================

Decoder rows are labelled with the decoder *inputs* (start token, y₁, …); cross-attention
rows with the token each step *produced*, as for qkv's own translators
(:mod:`qkv.inspect.translation`). Heads are switched off by :func:`qkv.hf.heads_off`; the
step-by-step view replays one call with :mod:`qkv.hf.steps`.

>>> loaded = load_hf_dir(Path("checkpoints/opus-mt-en-fr"))     # doctest: +SKIP
>>> loaded.hf.kind                                              # doctest: +SKIP
'encoder-decoder'
>>> maps = loaded.translate("The boy trains the puppy.")[0]     # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.capture.maps import AttentionMaps
from qkv.inspect.loaded import Loaded
from qkv.loading import read_json

__all__ = ["head_counts", "is_hf_dir", "load_hf_dir", "translate_hf"]

MAX_NEW_TOKENS = 40  # the default length of a translation (the server passes its own limit)


def is_hf_dir(path: Path) -> bool:
    """Whether ``path`` holds transformers weights and a ``config.json`` naming a
    ``model_type`` or ``architectures`` (not a qkv directory)."""
    path = Path(path)
    config = path / "config.json"
    if not config.is_file():
        return False
    weights = ("pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")
    if not any((path / w).is_file() for w in weights) and not any(path.glob("*.safetensors")):
        return False
    meta = read_json(config, what="model config")
    if "kind" in meta and "model_type" not in meta:  # qkv.models.save_pretrained
        return False
    return isinstance(meta.get("model_type"), str) or isinstance(meta.get("architectures"), list)


def _encoder_layers(model: Any) -> list[str]:
    """Names of the encoder's attention modules of a seq2seq model (model order)."""
    from qkv.hf import attention_modules

    return [n for n, _ in attention_modules(model) if "encoder" in n.split(".")]


def head_counts(loaded: Loaded) -> dict[str, int]:
    """``{attention module name: query heads}``, read from one capture over two tokens."""
    cached = getattr(loaded, "_head_counts", None)
    if cached is None:
        hf = loaded.hf
        ids = torch.tensor([[_first_id(hf.tokenizer)] * 2])  # (1, 2)
        maps = hf.attention(ids)
        cached = {name: len(h) for name, h in zip(maps.layers, maps.heads, strict=True)}
        loaded._head_counts = cached  # type: ignore[attr-defined]
    return cached


def _first_id(tokenizer: Any) -> int:
    for attr in ("bos_token_id", "cls_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        v = getattr(tokenizer, attr, None)
        if isinstance(v, int):
            return v
    return 0


def translate_hf(
    loaded: Loaded, text: str, *, max_new_tokens: int = MAX_NEW_TOKENS, beam: int = 1
) -> dict[str, Any]:
    """Translate ``text`` with a seq2seq model's own ``generate``, with the attention maps of
    the output.

    ``beam == 1``: greedy decoding, every step's attention captured as it runs. ``beam > 1``:
    transformers' beam search (``num_beams=beam``, ``num_return_sequences=beam``, the
    model's generation config otherwise); the maps are those of the best hypothesis, replayed
    with teacher forcing (one forward over it: the rows decoding wrote, since beam search
    reorders its batch rows at every step).

    Returns ``{"maps": AttentionMaps (steps merged), "source_tokens", "inputs" (decoder
    inputs), "produced" (tokens written), "text", "input_ids" (the decoder inputs' ids),
    "beams": [(ids, score), ...] (the hypotheses beam search returned, best first, each
    from the start token to its end; empty for greedy), "length_penalty"}``: a hypothesis's
    score is transformers' ``sequences_scores``, its log-probability ÷ length^length_penalty.
    """
    from qkv.hf import capture_attention

    hf = loaded.hf
    if hf.kind != "encoder-decoder":
        raise ValueError(f"translation needs an encoder-decoder model, this one is {hf.kind!r}")
    if not isinstance(beam, int) or beam < 1:
        raise ValueError(f"beam must be an int >= 1, got {beam!r}")
    source_tokens, (ids, mask) = loaded.encode(text)
    tok = hf.tokenizer
    eos = getattr(tok, "eos_token_id", None)
    beams: list[tuple[list[int], float]] = []
    if beam == 1:
        with torch.no_grad(), capture_attention(hf.model) as cap:
            seq = hf.model.generate(input_ids=ids, attention_mask=mask,
                                    max_new_tokens=max_new_tokens, do_sample=False,
                                    num_beams=1)  # fmt: skip
        out = _cut_at_eos([int(t) for t in seq[0].tolist()], eos)  # start, y1, ..., (eos)
    else:
        with torch.no_grad():
            gen = hf.model.generate(input_ids=ids, attention_mask=mask,
                                    max_new_tokens=max_new_tokens, do_sample=False,
                                    num_beams=beam, num_return_sequences=beam,
                                    output_scores=True, return_dict_in_generate=True)  # fmt: skip
        beams = list(zip(_hypotheses(gen, eos), gen.sequences_scores.tolist(), strict=True))
        out = beams[0][0]
        with torch.no_grad(), capture_attention(hf.model) as cap:  # teacher-forced replay
            hf.model(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.tensor([out[:-1]]))
    labels = tok.convert_ids_to_tokens(out)
    inputs, produced = labels[:-1], labels[1:]
    maps = cap.maps(tokens=inputs, source_tokens=source_tokens)
    for i, kind in enumerate(maps.kinds):
        if kind == "cross":  # a cross-attention row is labelled with what it produced
            off, n = maps.q_offsets[i], maps.weights[i].shape[1]
            maps.q_tokens[i] = [produced[j] if j < len(produced) else str(j)
                                for j in range(off, off + n)]  # fmt: skip
    text_out = tok.decode(out[1:], skip_special_tokens=True)
    penalty = getattr(hf.model.generation_config, "length_penalty", None)
    return {"maps": maps, "source_tokens": source_tokens, "inputs": inputs,
            "produced": produced, "text": text_out, "input_ids": out[:-1], "beams": beams,
            "length_penalty": 1.0 if penalty is None else float(penalty)}  # fmt: skip


def _cut_at_eos(ids: list[int], eos: int | None) -> list[int]:
    """``ids`` up to and with the first end token after the start token."""
    return ids[: ids.index(eos, 1) + 1] if eos in ids[1:] else ids


def _hypotheses(gen: Any, eos: int | None) -> list[list[int]]:
    """Each returned hypothesis of a beam-search ``generate`` without its padding: the
    decoder prompt and the tokens it generated (``beam_indices``: -1 past its end)."""
    seq = gen.sequences.tolist()
    bi = getattr(gen, "beam_indices", None)
    if bi is None:
        return [_cut_at_eos(s, eos) for s in seq]
    prompt = gen.sequences.shape[1] - bi.shape[1]
    lengths = (bi >= 0).sum(dim=1).tolist()
    return [s[: prompt + n] for s, n in zip(seq, lengths, strict=True)]


def load_hf_dir(path: Path) -> Loaded | None:
    """A transformers model directory (see the module docstring), else ``None``."""
    path = Path(path)
    if not is_hf_dir(path):
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    from qkv.hf import load_model

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Loading weights" bars in the commands' output
    try:
        hf = load_model(path)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if hf.tokenizer is None:
        raise ValueError(f"--model {str(path)!r}: the directory has no tokenizer (tokenizer.json "
                         f"or tokenizer_config.json); qkv needs one to read text")  # fmt: skip
    tok = hf.tokenizer
    max_len = getattr(tok, "model_max_length", None)
    max_len = max_len if isinstance(max_len, int) and 0 < max_len < 1_000_000 else None
    seq2seq = hf.kind == "encoder-decoder"
    enc_layers = _encoder_layers(hf.model) if seq2seq else None

    def encode(text: str) -> tuple[list[str], tuple[Tensor, Tensor]]:
        if not text or not text.strip():
            raise ValueError("text must contain at least one word, got an empty string")
        b = tok(text, return_tensors="pt", truncation=max_len is not None, max_length=max_len)
        ids = b["input_ids"]  # (1, T)
        if ids.shape[1] == 0:
            raise ValueError(f"the tokenizer turned {text!r} into no tokens")
        mask = b.get("attention_mask", torch.ones_like(ids))  # (1, T)
        return tok.convert_ids_to_tokens(ids[0].tolist()), (ids, mask)

    def attention(
        ids: Tensor, mask: Tensor | None = None, *, tokens: Sequence[str] | None = None
    ) -> AttentionMaps:
        if seq2seq:  # the text is the source: the encoder's layers
            return hf.attention(ids, attention_mask=mask, layers=enc_layers, tokens=tokens,
                                source_tokens=tokens)  # fmt: skip
        return hf.attention(ids, attention_mask=mask, tokens=tokens)

    def hidden(ids: Tensor, mask: Tensor | None = None) -> Tensor:
        with torch.no_grad():
            if seq2seq:
                return hf.model.get_encoder()(input_ids=ids, attention_mask=mask)[0]  # (1, T, d)
            out = hf.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
            return out.hidden_states[-1]  # (1, T, d)

    loaded = Loaded(hf.model, encode, hidden=hidden, name=str(path), full_model=hf.model,
                    tokenizer=tok, attention=attention, hf=hf)  # fmt: skip
    if seq2seq:
        loaded.translate = lambda text: [translate_hf(loaded, text)["maps"]]
    return loaded
