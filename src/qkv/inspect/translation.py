"""``--model DIR`` for saved :mod:`qkv.models` directories (translation model, causal LM).

A directory written by :func:`qkv.models.save_pretrained` (``config.json`` with ``kind``
``seq2seq`` or ``causal_lm``, ``model.safetensors``, ``tokenizer.json``) opens as a
:class:`~qkv.inspect.loaders.Loaded`:

* ``encode(text)``: the saved tokenizer's pieces (+ ``</s>`` for the source of a translation
  model, ``<s>`` first for a causal LM); for a seq2seq model ``model`` is its **encoder**, so
  ``qkv view "sentence" --model DIR`` shows encoder self-attention (layer names as in the
  whole model: ``encoder.layers.0.self_attn``…).
* ``translate(text, beam=1)`` (seq2seq): decodes inside :func:`~qkv.inspect.recording` and
  returns one :class:`AttentionMaps` per decoding step (encoder self, decoder causal self,
  cross). Greedy is recorded as it runs (KV cache, one token per step). For beam search the
  chosen hypothesis is replayed token by token over a fresh KV cache at batch size 1 — the
  same computation the winning beam's row did (up to float rounding), without tracing rows
  through the cache reorders.

Row labels: decoder self-attention rows are the decoder *inputs* (``<s>``, y₁, …); in the
cross-attention layers a row is labelled with the token it *produces* (y₁, …, ``</s>``),
so an alignment reads "while writing *entraîne*, the decoder looked at …".

:func:`bleu_metric` turns greedy translation of a few sentences into a ``metric_fn`` for
:func:`qkv.inspect.ablate`.

>>> loaded = load_model_dir(Path("runs/enfr/best"))                  # doctest: +SKIP
>>> steps = loaded.translate("The boy trains the puppy.")             # doctest: +SKIP
>>> merge_steps(steps).filter(kind="cross").weights[-1].shape        # doctest: +SKIP
torch.Size([4, 9, 8])
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor, nn

from qkv.capture.maps import AttentionMaps
from qkv.capture.record import recording
from qkv.inspect.loaded import Loaded
from qkv.loading import read_json

__all__ = [
    "bleu_metric",
    "load_model_dir",
    "loaded_from_seq2seq",
    "piece_labels",
    "record_translation",
    "Recorded",
]


def piece_labels(tokenizer, ids: Sequence[int]) -> list[str]:
    """Readable labels of token ids, one per id (rows and columns stay one per piece).

    A word start shows as the word; a piece inside a word as ``##piece``, except punctuation,
    which shows bare (``puppy`` ``.``, not ``##.``); a lone space as ``␣``. A character the
    byte-level tokenizer split into several pieces shows on its first piece, its other pieces
    as ``(char)``, instead of a replacement character each.
    """
    specials = {0: "<pad>", 1: "<s>", 2: "</s>", 3: "<unk>"}
    ids = [int(i) for i in ids]

    def decode(part: list[int]) -> str:
        return tokenizer.hf.decode(part, skip_special_tokens=False)

    out: list[str] = []
    j = 0
    while j < len(ids):
        if ids[j] in specials:
            out.append(specials[ids[j]])
            j += 1
            continue
        text, end = decode(ids[j : j + 1]), j + 1
        # part of a character: the fewest following pieces (a character is ≤ 4 bytes) that
        # complete it
        while "\ufffd" in text and end < min(j + 4, len(ids)) and ids[end] not in specials:
            end += 1
            whole = decode(ids[j:end])
            if "\ufffd" not in whole:
                text = whole
                break
        else:
            end = j + 1
        out += [_piece(text)] + [f"({text.strip() or '␣'})"] * (end - j - 1)
        j = end
    return out


def _piece(text: str) -> str:
    """One piece's label: see :func:`piece_labels`."""
    if text.startswith(" "):
        return text[1:] or "␣"
    if text and all(unicodedata.category(c)[0] in "PS" for c in text):
        return text  # punctuation sticks to its word anyway; "##." reads as noise
    return "##" + text


def _replay(model, src: Tensor, hyp: list[int]) -> None:
    """Feed ``<s>, hyp[:-1]`` one token at a time over a KV cache (batch size 1)."""
    mask = model.src_mask(src)  # (1, 1, 1, S), True = may attend
    memory = model.encode(src, mask)  # (1, S, d_model)
    cache = model.new_cache()
    for tok in [model.cfg.bos_id, *hyp[:-1]]:
        model.decode(torch.tensor([[tok]], device=src.device), memory, mask, cache=cache)


class Recorded(NamedTuple):
    """What :func:`record_translation` returns."""

    hyp: list[int]  # output ids incl. </s>
    steps: list[AttentionMaps]  # one per decoding step
    beams: list[tuple[list[int], float]]  # beam search's final hypotheses, best first (ids, score)


def record_translation(
    model, tokenizer, text: str, *, beam: int = 1, length_penalty: float = 1.0,
    max_new_tokens: int | None = None, no_repeat_ngram: int = 0, repeat_guard: bool = False,
) -> Recorded:  # fmt: skip
    """Translate ``text``: the output ids (incl. ``</s>``), the maps of each decoding step and,
    for beam search, every hypothesis it kept with its score. ``no_repeat_ngram`` as
    :func:`~qkv.generate.greedy_search`'s (``qkv translate`` uses 4); ``repeat_guard=True``:
    the tokenizer's :class:`~qkv.generate.RepeatGuard` (``qkv translate``'s default)."""
    from qkv.generate import RepeatGuard, beam_search, greedy_search

    if not isinstance(text, str) or not text.strip():
        raise ValueError("text must contain at least one word, got an empty string")
    ids = tokenizer.encode(text)[: model.cfg.max_len // 2 - 1] + [tokenizer.eos_id]
    src = torch.tensor([ids])  # (1, S)
    model.eval()
    guard = RepeatGuard.for_tokenizer(tokenizer) if repeat_guard else None
    beams: list[tuple[list[int], float]] = []
    with torch.no_grad():
        if beam <= 1:
            with recording(model) as rec:
                out = greedy_search(model, src, max_new_tokens=max_new_tokens,
                                    no_repeat_ngram=no_repeat_ngram, repeat_guard=guard)[0]  # fmt: skip
        else:
            outs, scores = beam_search(model, src, beam_size=beam, length_penalty=length_penalty,
                                       max_new_tokens=max_new_tokens, n_best=beam,
                                       no_repeat_ngram=no_repeat_ngram,
                                       repeat_guard=guard)  # fmt: skip
            beams = [(_trim(model, tokenizer, o), float(sc)) for o, sc in zip(outs[0], scores[0])
                     if sc > float("-inf")]  # fmt: skip
            out = outs[0, 0]
        hyp = _trim(model, tokenizer, out)
        if beam > 1:
            with recording(model) as rec:
                _replay(model, src, hyp)
    src_tokens = piece_labels(tokenizer, ids)
    inputs = piece_labels(tokenizer, [model.cfg.bos_id, *hyp[:-1]])
    produced = piece_labels(tokenizer, hyp)
    steps = label_cross_queries(rec.steps(tokens=inputs, source_tokens=src_tokens), produced)
    return Recorded(hyp, steps, beams)


def _trim(model, tokenizer, out: Tensor) -> list[int]:
    """Ids up to and including ``</s>``, without padding."""
    hyp = [int(t) for t in out.tolist()]
    if tokenizer.eos_id in hyp:
        hyp = hyp[: hyp.index(tokenizer.eos_id) + 1]
    return [t for t in hyp if t != model.cfg.pad_id]


def label_cross_queries(steps: list[AttentionMaps], produced: list[str]) -> list[AttentionMaps]:
    """Label each cross-attention query with the token it produced (not the one it was fed),
    so an alignment row reads "garçon → boy"."""
    for m in steps:
        for i, kind in enumerate(m.kinds):
            if kind == "cross":
                off, n = m.q_offsets[i], m.weights[i].shape[1]
                m.q_tokens[i] = [produced[j] if j < len(produced) else str(j)
                                 for j in range(off, off + n)]  # fmt: skip
    return steps


class EncoderOnly(nn.Module):
    """The encoder of a seq2seq model under its own name (``encoder.layers.0.self_attn``…),
    so layer names match those recorded while translating. Shares the model's weights."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.encoder = model.encoder

    def forward(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor:
        return self.encoder(src, src_mask)  # (B, S, d_model)


def loaded_from_seq2seq(model, tok, name: str) -> Loaded:
    """Wrap a seq2seq model and its tokenizer as a :class:`Loaded` (encoder + ``translate``)."""

    def encode(text: str) -> tuple[list[str], tuple[Tensor, Tensor]]:
        if not text or not text.strip():
            raise ValueError("text must contain at least one word, got an empty string")
        ids = tok.encode(text)[: model.cfg.max_len - 1] + [tok.eos_id]
        src = torch.tensor([ids])  # (1, S)
        return piece_labels(tok, ids), (src, model.src_mask(src))

    def translate(text: str, beam: int = 1) -> list[AttentionMaps]:
        return record_translation(model, tok, text, beam=beam).steps

    return Loaded(EncoderOnly(model), encode, translate=translate, name=name, full_model=model,
                  tokenizer=tok)  # fmt: skip


def _causal_lm(model, tok, name: str) -> Loaded:
    def encode(text: str) -> tuple[list[str], tuple[Tensor]]:
        if not text or not text.strip():
            raise ValueError("text must contain at least one word, got an empty string")
        ids = [model.cfg.bos_id, *tok.encode(text)][: model.cfg.max_len]
        return piece_labels(tok, ids), (torch.tensor([ids]),)

    return Loaded(model, encode, name=name, full_model=model, tokenizer=tok)


def load_model_dir(path: Path) -> Loaded | None:
    """A :func:`qkv.models.save_pretrained` directory, else ``None`` (another loader's turn)."""
    from qkv.models.io import KINDS, resolve_dir

    path = Path(path)
    if not (resolve_dir(path) / "config.json").is_file() and (path / "best").is_dir():
        path = path / "best"  # a training run directory
    path = resolve_dir(path)
    config = path / "config.json"
    if not config.is_file():
        return None
    kind = read_json(config, what="model config").get("kind")
    if kind not in KINDS:
        return None
    from qkv.translate import load_translator

    model, tok = load_translator(path)
    return (loaded_from_seq2seq if kind == "seq2seq" else _causal_lm)(model, tok, str(path))


def bleu_metric(
    model_or_loaded, src_sentences: Sequence[str], ref_sentences: Sequence[str],
    tokenizer=None, *, beam: int = 1,
) -> Callable[[nn.Module], float]:  # fmt: skip
    """``metric_fn(model)``: sacreBLEU of the model's translations of ``src_sentences``.

    ``model_or_loaded``: a model directory, a seq2seq :class:`Loaded`, or a model (then give
    ``tokenizer``). The returned function ignores its argument's identity beyond using it as
    the model, so it works with :func:`~qkv.inspect.ablate` on the same model object.

    >>> m = bleu_metric("runs/enfr/best", ["A dog runs."], ["Un chien court."])  # doctest: +SKIP
    >>> ablate(model, {"decoder.layers.2.cross_attn": [0]}, m).delta  # doctest: +SKIP
    """
    import sacrebleu

    from qkv.generate import translate

    if len(src_sentences) != len(ref_sentences) or not src_sentences:
        raise ValueError(f"need as many references as sources (> 0), got {len(src_sentences)} "
                         f"and {len(ref_sentences)}")  # fmt: skip
    if isinstance(model_or_loaded, (str, Path)):
        from qkv.translate import load_translator

        model_or_loaded, tokenizer = load_translator(model_or_loaded)
    elif isinstance(model_or_loaded, Loaded):
        model_or_loaded, tokenizer = model_or_loaded.full_model, model_or_loaded.tokenizer
    if tokenizer is None:
        raise TypeError("bleu_metric needs a tokenizer with a bare model")
    tok, refs = tokenizer, list(ref_sentences)

    def metric(model: nn.Module) -> float:
        hyps = translate(model, tok, list(src_sentences), beam_size=beam)
        return float(sacrebleu.corpus_bleu(hyps, [refs]).score)

    metric.model = model_or_loaded  # type: ignore[attr-defined]
    return metric
