"""Translation with a trained model, by name or directory (the command line: :mod:`qkv.apps.translate`).

qkv ships two models trained on Multi30k with ``qkv train`` (``en-fr``, the default, and
``fr-en``); any ``qkv train`` run directory works too.

    qkv translate "The boy trains the puppy."
    echo "Un chien court." | qkv translate --model fr-en
    qkv evaluate --model en-fr --split test_2016_flickr --beam 5

>>> import qkv.translate
>>> tr = qkv.translate.load("en-fr")                          # doctest: +SKIP
>>> tr("The boy trains the puppy.")                          # doctest: +SKIP
'Le garçon entraîne le chiot.'
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from qkv.data import Tokenizer
from qkv.generate import translate as _decode
from qkv.limits import split_to_fit
from qkv.loading import read_json
from qkv.models import load_pretrained
from qkv.models.io import resolve_dir
from qkv.models.shipped import DEFAULT, shipped, shipped_dir

__all__ = ["Translator", "load", "load_translator"]

GENERATION_FILE = "generation.json"  # {"src", "tgt", "beam", "length_penalty"}: decoding defaults


def _model_dir(spec: str | Path) -> Path:
    """A shipped model's name, a model directory, or a run directory holding ``best/``."""
    if isinstance(spec, str) and spec in shipped():
        return shipped_dir(spec)
    path = Path(spec)
    if not path.exists():
        names = ", ".join(shipped()) or "none in this install"
        raise FileNotFoundError(f"--model {spec}: no such directory, and not a shipped model "
                                f"name ({names})")  # fmt: skip
    if not (resolve_dir(path) / "config.json").exists() and (path / "best").exists():
        path = path / "best"
    return resolve_dir(path)


def load_translator(path: str | Path) -> tuple[nn.Module, Tokenizer]:
    """``(model, tokenizer)`` from a shipped model's name or a (run) directory."""
    path = _model_dir(path)
    return load_pretrained(path).float(), Tokenizer.load(path / "tokenizer.json")


@dataclass
class Translator:
    """A translation model with its tokenizer and decoding defaults; call it on text.

    ``tr(text)`` → str, ``tr([texts])`` → list of str (empty lines stay empty). A text longer
    than the model's positions is translated sentence by sentence (or in pieces) and joined,
    with a :class:`UserWarning` saying so: never cut silently.
    """

    model: nn.Module
    tokenizer: Tokenizer
    name: str = ""
    path: Path | None = None
    src: str | None = None
    tgt: str | None = None
    beam: int = 1
    length_penalty: float = 1.0
    cache_dtype: torch.dtype | None = None  # the decoder's self-attention caches (qkv.cache)

    @property
    def max_source_tokens(self) -> int:
        """Source tokens one piece may have (``</s>`` excluded): half the positions, so the
        output (up to ``2·source + 10`` tokens) fits the decoder's positions too."""
        return self.model.cfg.max_len // 2 - 1

    @property
    def card(self) -> str:
        """The model card (``README.md`` of the model directory), or ``""``."""
        p = self.path / "README.md" if self.path else None
        return p.read_text(encoding="utf-8") if p is not None and p.is_file() else ""

    def pieces(self, line: str) -> list[str]:
        """``line`` itself if it fits the model, else its sentences (and word runs of a
        sentence too long alone), each within :attr:`max_source_tokens`."""
        n_tokens = lambda s: len(self.tokenizer.encode(s))  # noqa: E731
        if n_tokens(line) <= self.max_source_tokens:
            return [line]
        return split_to_fit(line, self.max_source_tokens, n_tokens)

    def __call__(
        self, text: str | list[str], *, beam: int | None = None,
        length_penalty: float | None = None, progress: bool = False,
    ) -> str | list[str]:  # fmt: skip
        single = isinstance(text, str)
        lines = [text] if single else list(text)
        if not all(isinstance(t, str) for t in lines):
            raise TypeError("text must be a str or a list of str")
        beam = self.beam if beam is None else beam
        lenpen = self.length_penalty if length_penalty is None else length_penalty
        if beam < 1:
            raise ValueError(f"beam must be >= 1, got {beam}")
        limit = self.max_source_tokens
        pieces, owner = [], []  # every non-empty piece, and the line it belongs to
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            parts = self.pieces(line.strip())
            if len(parts) > 1:
                warnings.warn(f"line {i + 1} is longer than the model's {limit} source "
                              f"tokens: translated in {len(parts)} pieces", stacklevel=2)  # fmt: skip
            pieces += parts
            owner += [i] * len(parts)
        out = _decode(self.model, self.tokenizer, pieces, beam_size=beam,
                      length_penalty=lenpen, progress=progress,
                      cache_dtype=self.cache_dtype) if pieces else []  # fmt: skip
        result = [""] * len(lines)
        for i, hyp in zip(owner, out):
            result[i] = f"{result[i]} {hyp}" if result[i] else hyp
        return result[0] if single else result


def load(spec: str | Path = DEFAULT, *, int8: bool = False) -> Translator:
    """A :class:`Translator` for a shipped model's name (``"en-fr"``, ``"fr-en"``) or a model
    (or ``qkv train`` run) directory. Nothing is downloaded: shipped models are in the package.

    ``int8=True``: every linear layer in int8 (:func:`qkv.kernels.int8.quantize_linears`:
    weights per output channel, inputs per row, exact int32 sums) — faster on CPUs, BLEU of
    the shipped models within 0.1 of float.
    """
    path = _model_dir(spec)
    model, tok = load_translator(path)
    if int8:
        from qkv.kernels.int8 import quantize_linears

        model = quantize_linears(model)
    gen = read_json(path / GENERATION_FILE) if (path / GENERATION_FILE).is_file() else {}
    name = spec if isinstance(spec, str) and spec in shipped() else str(path)
    return Translator(model, tok, name=name, path=path, src=gen.get("src"), tgt=gen.get("tgt"),
                      beam=int(gen.get("beam", 1)),
                      length_penalty=float(gen.get("length_penalty", 1.0)))  # fmt: skip
