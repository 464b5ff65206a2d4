"""Names and numbers copied by the shipped translators, and greedy BLEU kept on val.

    PYTHONPATH=src python bench/names_numbers.py                 # both models, both parts
    PYTHONPATH=src python bench/names_numbers.py --no-bleu       # the hand-written set only
    PYTHONPATH=src python bench/names_numbers.py --split test_2016_flickr --limit 0 --no-copy

Part one: ``bench/data/names_numbers.tsv`` (40 hand-written sentences, 20 per direction,
never from a Multi30k split): each name or number that must come out verbatim counts as
copied when the translation holds it as a whole word. Part two: greedy BLEU on the first
``--limit`` sentences of ``--split`` (default: the first 300 of val; ``--beam``, default
greedy), sacreBLEU 13a, cased.
Each is run with qkv.translate's placeholders on (as shipped) and off (``--off`` names which
fields of :class:`qkv.translate.Translator` are switched off for the "without" column).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import sacrebleu  # noqa: E402
import torch  # noqa: E402

from _measure import machine_header  # noqa: E402
from qkv.data import multi30k  # noqa: E402
from qkv.translate import load  # noqa: E402

HERE = Path(__file__).resolve().parent
SET = HERE / "data" / "names_numbers.tsv"
FIELDS = ("name_placeholders", "number_placeholders")


def read_set(path: Path = SET) -> list[tuple[str, str, list[str]]]:
    """``[(model, source, [what must come out verbatim, ...]), ...]``."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            model, src, items = line.split("\t")
            out.append((model, src, items.split("|")))
    return out


def copied(hyp: str, item: str) -> bool:
    """``item`` appears in ``hyp`` as a whole word (or number)."""
    return re.search(rf"(?<!\w){re.escape(item)}(?!\w)", hyp) is not None


def translate(tr, texts: list[str], beam: int, off: tuple[str, ...]) -> list[str]:
    """``tr(texts)`` with the fields ``off`` switched off (restored after)."""
    saved = {f: getattr(tr, f) for f in off if hasattr(tr, f)}
    try:
        for f in saved:
            setattr(tr, f, False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return tr(texts, beam=beam)
    finally:
        for f, v in saved.items():
            setattr(tr, f, v)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", action="append", help="en-fr, fr-en (repeatable; default both)")
    p.add_argument("--data", default=str(HERE.parents[1] / "shared/data/multi30k"))
    p.add_argument("--split", default="val")
    p.add_argument("--limit", type=int, default=300, help="first N pairs of --split (0: all)")
    p.add_argument("--beam", type=int, default=1, help="beam of the BLEU part (1: greedy)")
    p.add_argument("--off", default=",".join(FIELDS), help="fields switched off for 'without'")
    p.add_argument("--no-bleu", action="store_true")
    p.add_argument("--no-copy", action="store_true")
    p.add_argument("--show", action="store_true", help="print every translation of the set")
    args = p.parse_args()
    torch.set_num_threads(1)
    off = tuple(f for f in args.off.split(",") if f)
    print(machine_header())
    rows = read_set()
    for name in args.model or ["en-fr", "fr-en"]:
        tr = load(name)
        if not args.no_copy:
            mine = [(s, items) for m, s, items in rows if m == name]
            for beam in (1, tr.beam):
                counts = []
                for label, fields in (("without", off), ("with", ())):
                    hyps = translate(tr, [s for s, _ in mine], beam, fields)
                    ok = sum(copied(h, it) for h, (_, items) in zip(hyps, mine) for it in items)
                    counts.append(ok)
                    if args.show:
                        for h, (_, items) in zip(hyps, mine):
                            miss = [it for it in items if not copied(h, it)]
                            print(f"  {label} beam {beam}: {h}" + (f"   MISSING {miss}" if miss else ""))
                total = sum(len(items) for _, items in mine)
                print(f"{name} beam {beam}: copied {counts[0]} -> {counts[1]} of {total} "
                      f"({len(mine)} sentences)", flush=True)  # fmt: skip
        if not args.no_bleu:
            pairs = multi30k(args.split, tr.src, tr.tgt, args.data)
            pairs = pairs[: args.limit] if args.limit else pairs
            src, ref = [s for s, _ in pairs], [t for _, t in pairs]
            t0 = time.perf_counter()
            plain = translate(tr, src, args.beam, off)
            hyps = translate(tr, src, args.beam, ())
            b0 = sacrebleu.corpus_bleu(plain, [ref]).score
            b1 = sacrebleu.corpus_bleu(hyps, [ref]).score
            changed = sum(a != b for a, b in zip(plain, hyps))
            if args.show:
                for s, a, b in zip(src, plain, hyps):
                    if a != b:
                        print(f"  {s}\n    without: {a}\n    with:    {b}")
            how = "greedy" if args.beam == 1 else f"beam {args.beam}"
            print(f"{name} {args.split}[:{len(pairs)}] {how} BLEU {b0:.2f} -> {b1:.2f} "
                  f"({changed} outputs changed; {time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
