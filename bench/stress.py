"""How a translator holds up away from clean captions: BLEU on stress sets built from val.

    PYTHONPATH=src python bench/stress.py                        # the shipped en-fr
    PYTHONPATH=src python bench/stress.py --model RUN_DIR --model en-fr   # side by side

The sets come from Multi30k's val split (never a test set: they are for choosing between
models), one per kind of :func:`qkv.data.noise.stress_sets`: two captions joined into one
line, the line in capitals (the reference too, as ``qkv.translate`` writes a line given in
capitals), one typo per line, the line in lower case; plus val itself. Each model
translates every set through :func:`qkv.translate.load` as a user would (greedy, its own
repetition guard and length limit); sacreBLEU 13a, cased. Warnings for lines far from the
training data are counted, not printed.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import sacrebleu  # noqa: E402
import torch  # noqa: E402

from _measure import machine_header  # noqa: E402
from qkv.data import multi30k  # noqa: E402
from qkv.data.noise import STRESS_KINDS, stress_sets  # noqa: E402
from qkv.translate import load  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", action="append", help="shipped name or model/run directory "
                   "(repeatable; default: en-fr)")  # fmt: skip
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/multi30k"))
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="fr")
    p.add_argument("--limit", type=int, default=None, help="first N val pairs (default: all)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    pairs = multi30k("val", args.src, args.tgt, args.data)[: args.limit]
    sets = {"val": pairs, **stress_sets(pairs, seed=args.seed)}
    models = args.model or ["en-fr"]
    print(machine_header())
    print(f"val {len(pairs)} pairs, "
          f"seed {args.seed}; greedy; sacreBLEU 13a, cased")  # fmt: skip
    print("| model | " + " | ".join(["val", *STRESS_KINDS]) + " | warned lines | seconds |")
    print("|---|" + "---|" * (len(sets) + 2))
    for name in models:
        tr = load(name)
        scores, warned, t0 = [], 0, time.perf_counter()
        for items in sets.values():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                hyps = tr([s for s, _ in items], beam=1)
            warned += len(caught)
            bleu = sacrebleu.corpus_bleu(hyps, [[t for _, t in items]]).score
            scores.append(f"{bleu:.2f}")
        secs = time.perf_counter() - t0
        print(f"| {name} | " + " | ".join(scores) + f" | {warned} | {secs:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
