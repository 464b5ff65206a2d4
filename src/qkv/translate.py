"""Translation with a trained model, by name or directory: ``qkv translate``, ``qkv evaluate``.

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

import argparse
import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from qkv.atomic import atomic_write_text
from qkv.cli_args import (
    float_range,
    int_range,
    note,
    output_file,
    positive_int,
    read_stdin_lines,
    threads,
)
from qkv.cli_args import text as text_arg
from qkv.data import Tokenizer, multi30k
from qkv.data.corpus import read_lines, read_parallel
from qkv.generate import translate as _decode
from qkv.limits import split_to_fit
from qkv.loading import read_json
from qkv.models import load_pretrained
from qkv.models.io import resolve_dir
from qkv.models.shipped import DEFAULT, shipped, shipped_dir

__all__ = ["Translator", "load", "load_translator", "add_parser"]

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
                      length_penalty=lenpen, progress=progress) if pieces else []  # fmt: skip
        result = [""] * len(lines)
        for i, hyp in zip(owner, out):
            result[i] = f"{result[i]} {hyp}" if result[i] else hyp
        return result[0] if single else result


def load(spec: str | Path = DEFAULT) -> Translator:
    """A :class:`Translator` for a shipped model's name (``"en-fr"``, ``"fr-en"``) or a model
    (or ``qkv train`` run) directory. Nothing is downloaded: shipped models are in the package.
    """
    path = _model_dir(spec)
    model, tok = load_translator(path)
    gen = read_json(path / GENERATION_FILE) if (path / GENERATION_FILE).is_file() else {}
    name = spec if isinstance(spec, str) and spec in shipped() else str(path)
    return Translator(model, tok, name=name, path=path, src=gen.get("src"), tgt=gen.get("tgt"),
                      beam=int(gen.get("beam", 1)),
                      length_penalty=float(gen.get("length_penalty", 1.0)))  # fmt: skip


def _read_input(args: argparse.Namespace) -> list[str]:
    if args.file:
        return read_lines(args.file)
    if args.text:
        return list(args.text)
    return read_stdin_lines()


def _translate(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    lines = _read_input(args)
    tr = load(args.model)
    with warnings.catch_warnings(record=True) as caught:  # printed below, once, as notes
        warnings.simplefilter("always")
        out = tr(lines, beam=args.beam, length_penalty=args.lenpen, progress=len(lines) > 50)
    for w in caught:
        note(str(w.message), "translate")
    for line in out:
        print(line)
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from qkv.train import bleu_chrf

    torch.set_num_threads(args.threads or torch.get_num_threads())
    tr = load(args.model)
    src, tgt = args.src or tr.src or "en", args.tgt or tr.tgt or "fr"
    if args.files:
        pairs = read_parallel(*args.files)
    else:
        pairs = multi30k(args.split, src, tgt, args.data)
    if args.limit:
        pairs = pairs[: args.limit]
    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hyps = tr([s for s, _ in pairs], beam=args.beam, length_penalty=args.lenpen,
                  progress=True)  # fmt: skip
    seconds = time.monotonic() - t0
    bleu, chrf = bleu_chrf(hyps, [t for _, t in pairs])
    name = "files" if args.files else args.split
    beam = args.beam or tr.beam
    result = {"split": name, "src": src, "tgt": tgt, "sentences": len(pairs), "beam": beam,
              "bleu": round(bleu, 2), "chrf": round(chrf, 2), "seconds": round(seconds, 1)}  # fmt: skip
    print(f"{name} {src}->{tgt} beam={beam}: BLEU {bleu:.2f}  chrF {chrf:.2f}  "
          f"({len(pairs)} sentences, {seconds:.1f}s)")  # fmt: skip
    if args.json:
        print(json.dumps(result))
    if args.output:
        atomic_write_text(args.output, "\n".join(hyps) + "\n")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    names = "|".join(shipped()) or "en-fr|fr-en"
    p.add_argument("--model", default=DEFAULT,
                   help=f"a shipped model ({names}) or a model/run directory")  # fmt: skip
    p.add_argument("--beam", type=int_range(1, 64), default=None,
                   help="beam size, 1 = greedy (default: the model's, 1 if it has none)")  # fmt: skip
    p.add_argument("--lenpen", type=float_range(0.0, 10.0), default=None,
                   help="length penalty exponent (default: the model's tuned value, else 1)")  # fmt: skip
    p.add_argument("--threads", type=threads, default=None, help="torch threads (default: all)")


def add_parser(sub) -> None:
    p = sub.add_parser("translate", help="translate sentences (default model: en-fr, shipped)")
    _common(p)
    p.add_argument("text", nargs="*", type=text_arg,
                   help="sentences (default: one per line from stdin)")  # fmt: skip
    p.add_argument("--file", help="translate every line of this file (empty lines stay empty)")
    p.set_defaults(func=_translate)
    e = sub.add_parser("evaluate", help="sacreBLEU and chrF of a model on a Multi30k split")
    _common(e)
    e.add_argument("--split", default="test_2016_flickr",
                   help="any split present in --data (val, test_2016_flickr, test_2018_flickr...)")  # fmt: skip
    e.add_argument("--data", help="Multi30k directory (default ../shared/data/multi30k)")
    e.add_argument("--src", default=None, help="source language (default: the model's)")
    e.add_argument("--tgt", default=None, help="target language (default: the model's)")
    e.add_argument("--files", nargs=2, metavar=("SRC", "REF"), help="plain parallel text instead")
    e.add_argument("--limit", type=positive_int, help="first N sentences only")
    e.add_argument("--output", type=output_file(), help="write the hypotheses here")
    e.add_argument("--json", action="store_true", help="also print a JSON line")
    e.set_defaults(func=_evaluate)
