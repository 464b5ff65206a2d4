"""Which digit each shipped translator writes back best in a name's place (qkv.translate's
``PLACEHOLDERS_INTO``): one name at a time replaced by each digit, greedy, counted when the
translation holds the digit exactly once.

    PYTHONPATH=src python bench/placeholder_digits.py

The sentences: ``bench/data/names_dev.tsv`` (hand-written) and Multi30k val's from sentence
300 on whose names (:func:`qkv.translate_notes.find_names`) the reference copies; never the
reported set (``bench/data/names_numbers.tsv``) nor a test split.
"""

from __future__ import annotations

import argparse
import re
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from _measure import machine_header  # noqa: E402
from qkv.data import multi30k  # noqa: E402
from qkv.translate import load  # noqa: E402
from qkv.translate_notes import find_names  # noqa: E402

HERE = Path(__file__).resolve().parent
DIGITS = "2345689"  # "1" would make a noun singular; " 0", " 7" are two tokens


def sentences(tr, data: str) -> list[str]:
    """Each sentence with one name replaced by ``{}`` (a sentence with two names gives two)."""
    out = []
    for line in (HERE / "data" / "names_dev.tsv").read_text(encoding="utf-8").splitlines():
        if line.startswith("#") or not line.strip():
            continue
        model, src, _ = line.split("\t")
        if model == tr.name:
            out += [src[:a] + "{}" + src[b:] for a, b in find_names(tr.tokenizer, src, tr.src)]
    for src, ref in multi30k("val", tr.src, tr.tgt, data)[300:]:
        out += [src[:a] + "{}" + src[b:] for a, b in find_names(tr.tokenizer, src, tr.src)
                if src[a:b] in ref]  # fmt: skip
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", default=str(HERE.parents[1] / "shared/data/multi30k"))
    args = p.parse_args()
    torch.set_num_threads(1)
    print(machine_header())
    for name in ("en-fr", "fr-en"):
        tr = load(name)
        tr.name_placeholders = tr.number_placeholders = False
        texts = sentences(tr, args.data)
        counts = {}
        for d in DIGITS:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                hyps = tr([t.replace("{}", d) for t in texts], beam=1)
            counts[d] = sum(len(re.findall(rf"(?<!\w){d}(?!\w)", h)) == 1 for h in hyps)
        ranked = ", ".join(f"{d}: {n}" for d, n in sorted(counts.items(), key=lambda x: -x[1]))
        print(f"{name} ({len(texts)} names, greedy): {ranked}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
