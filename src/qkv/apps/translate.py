"""``qkv translate`` and ``qkv evaluate``: the command line over :mod:`qkv.translate`."""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

import torch

from qkv.apps.cli_args import (
    CliError,
    float_range,
    int_range,
    note,
    output_file,
    positive_int,
    read_stdin_lines,
    threads,
)
from qkv.apps.cli_args import text as text_arg
from qkv.atomic import atomic_write_text
from qkv.data import multi30k
from qkv.data.corpus import read_lines, read_parallel
from qkv.models.shipped import DEFAULT, shipped
from qkv.translate import load

__all__ = ["add_parser"]


NO_INPUT = ("no text to translate: give sentences as arguments (qkv translate \"The boy trains "
            "the puppy.\"), a file of lines with --file FILE, or lines on standard input (echo "
            "\"Un chien court.\" | qkv translate --model fr-en); see qkv translate --help")


def _stdin_is_terminal() -> bool:
    try:
        return sys.stdin is None or sys.stdin.isatty()
    except ValueError:  # closed
        return True


def _read_input(args: argparse.Namespace) -> list[str]:
    if args.file:
        return read_lines(args.file)
    if args.text:
        return list(args.text)
    if _stdin_is_terminal():  # nobody is piping text in: waiting would look like a hang
        raise CliError(NO_INPUT)
    return read_stdin_lines()


def _translate(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    lines = _read_input(args)
    tr = _loaded(args)
    with warnings.catch_warnings(record=True) as caught:  # printed below, once, as notes
        warnings.simplefilter("always")
        out = tr(lines, beam=args.beam, length_penalty=args.lenpen, progress=len(lines) > 50)
    for w in caught:
        note(str(w.message), "translate")
    for line in out:
        print(line)
    return 0


def _loaded(args: argparse.Namespace):
    """The translator of ``--model``, ``--int8`` and ``--no-repeat-guard``."""
    tr = load(args.model, int8=args.int8)
    if args.no_repeat_guard:
        tr.repeat_guard = False
    return tr


def _evaluate(args: argparse.Namespace) -> int:
    from qkv.apps.train import bleu_chrf

    torch.set_num_threads(args.threads or torch.get_num_threads())
    tr = _loaded(args)
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
    p.add_argument("--int8", action="store_true",
                   help="int8 linear layers: BLEU within ~0.1 of float, faster with AVX2 or VNNI")  # fmt: skip
    p.add_argument("--no-repeat-guard", action="store_true",
                   help="let the model write a pattern three times in a row ('gigigi'), "
                        "as it was trained (the guard is on by default)")  # fmt: skip


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
    e.add_argument("--data", help="Multi30k directory (default: $QKV_DATA, else "
                   "../shared/data/multi30k, else ~/.cache/qkv/multi30k from `qkv data fetch`)")  # fmt: skip
    e.add_argument("--src", default=None, help="source language (default: the model's)")
    e.add_argument("--tgt", default=None, help="target language (default: the model's)")
    e.add_argument("--files", nargs=2, metavar=("SRC", "REF"), help="plain parallel text instead")
    e.add_argument("--limit", type=positive_int, help="first N sentences only")
    e.add_argument("--output", type=output_file(), help="write the hypotheses here")
    e.add_argument("--json", action="store_true", help="also print a JSON line")
    e.set_defaults(func=_evaluate)
