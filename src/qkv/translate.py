"""``qkv translate`` and ``qkv evaluate``: use a trained translation model directory.

qkv translate --model runs/enfr/best "The boy trains the puppy."
echo "A dog runs." | qkv translate --model runs/enfr/best --beam 5
qkv evaluate --model runs/enfr/best --split test_2016_flickr --beam 5
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from qkv.atomic import atomic_write_text
from qkv.cli_args import (
    float_range,
    int_range,
    output_file,
    positive_int,
    read_stdin_lines,
    text,
    threads,
)
from qkv.data import Tokenizer, multi30k
from qkv.data.corpus import read_lines, read_parallel
from qkv.generate import translate
from qkv.models import load_pretrained
from qkv.models.io import resolve_dir

__all__ = ["load_translator", "add_parser"]


def load_translator(path: str | Path):
    """``(model, tokenizer)`` from a model directory, or a run directory holding ``best/``."""
    path = Path(path)
    if not (resolve_dir(path) / "config.json").exists() and (path / "best").exists():
        path = path / "best"
    path = resolve_dir(path)
    return load_pretrained(path), Tokenizer.load(path / "tokenizer.json")


def _translate(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    if args.file:
        sentences = read_lines(args.file)
    elif args.text:
        sentences = list(args.text)
    else:
        sentences = read_stdin_lines()
    model, tok = load_translator(args.model)
    for line in translate(model, tok, sentences, beam_size=args.beam, length_penalty=args.lenpen):
        print(line)
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from qkv.train import bleu_chrf

    torch.set_num_threads(args.threads or torch.get_num_threads())
    if args.files:
        pairs = read_parallel(*args.files)
    else:
        pairs = multi30k(args.split, args.src, args.tgt, args.data)
    if args.limit:
        pairs = pairs[: args.limit]
    model, tok = load_translator(args.model)
    t0 = time.monotonic()
    hyps = translate(model, tok, [s for s, _ in pairs], beam_size=args.beam,
                     length_penalty=args.lenpen, progress=True)  # fmt: skip
    seconds = time.monotonic() - t0
    bleu, chrf = bleu_chrf(hyps, [t for _, t in pairs])
    name = "files" if args.files else args.split
    result = {"split": name, "sentences": len(pairs), "beam": args.beam, "bleu": round(bleu, 2),
              "chrf": round(chrf, 2), "seconds": round(seconds, 1)}  # fmt: skip
    print(f"{name} {args.src}->{args.tgt} beam={args.beam}: BLEU {bleu:.2f}  chrF {chrf:.2f}  "
          f"({len(pairs)} sentences, {seconds:.1f}s)")  # fmt: skip
    if args.json:
        print(json.dumps(result))
    if args.output:
        atomic_write_text(args.output, "\n".join(hyps) + "\n")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model directory (or a run dir with best/)")
    p.add_argument("--beam", type=int_range(1, 64), default=1, help="beam size (1 = greedy)")
    p.add_argument("--lenpen", type=float_range(0.0, 10.0), default=1.0,
                   help="length penalty exponent")  # fmt: skip
    p.add_argument("--threads", type=threads, default=None, help="torch threads (default: all)")


def add_parser(sub) -> None:
    p = sub.add_parser("translate", help="translate sentences with a trained model")
    _common(p)
    p.add_argument("text", nargs="*", type=text,
                   help="sentences (default: one per line from stdin)")  # fmt: skip
    p.add_argument("--file", help="translate every line of this file")
    p.set_defaults(func=_translate)
    e = sub.add_parser("evaluate", help="sacreBLEU and chrF of a model on a Multi30k split")
    _common(e)
    e.add_argument("--split", default="test_2016_flickr")
    e.add_argument("--data", help="Multi30k directory (default ../shared/data/multi30k)")
    e.add_argument("--src", default="en")
    e.add_argument("--tgt", default="fr")
    e.add_argument("--files", nargs=2, metavar=("SRC", "REF"), help="plain parallel text instead")
    e.add_argument("--limit", type=positive_int, help="first N sentences only")
    e.add_argument("--output", type=output_file(), help="write the hypotheses here")
    e.add_argument("--json", action="store_true", help="also print a JSON line")
    e.set_defaults(func=_evaluate)
