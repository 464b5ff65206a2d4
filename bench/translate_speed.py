"""Decoding speed of a shipped translator: output tokens/s, greedy and beam, 1 and 2 threads.

    PYTHONPATH=src python bench/translate_speed.py                     # en-fr, 200 sentences
    PYTHONPATH=src python bench/translate_speed.py --model fr-en --n 100 --beams 1 5

Sentences come from Multi30k test_2016_flickr (``--data``, default ../shared/data/multi30k).
Each setting runs once after a warm-up; the machine, its ISA and the thread count are printed.
"""

from __future__ import annotations

import argparse
import time

import torch

from _measure import machine_header
from qkv.data import multi30k
from qkv.translate import load


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="en-fr")
    p.add_argument("--n", type=int, default=200, help="sentences")
    p.add_argument("--beams", type=int, nargs="+", default=[1, 5])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--data", default=None)
    args = p.parse_args()
    tr = load(args.model)
    src = (tr.src or "en", tr.tgt or "fr")
    sentences = [s for s, _ in multi30k("test_2016_flickr", *src, args.data)[: args.n]]
    print(
        f"{machine_header()}\nmodel {args.model} ({sum(p.numel() for p in tr.model.parameters()) / 1e6:.1f}M)"
    )
    print(f"{'threads':>7} {'beam':>4} {'sentences/s':>12} {'out tokens/s':>13} {'seconds':>8}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for beam in args.beams:
            tr(sentences[:8], beam=beam)  # warm-up
            t0 = time.perf_counter()
            out = tr(sentences, beam=beam)
            dt = time.perf_counter() - t0
            n_tok = sum(len(tr.tokenizer.encode(o)) + 1 for o in out)  # + </s>
            print(
                f"{threads:>7} {beam:>4} {len(sentences) / dt:>12.1f} {n_tok / dt:>13.0f} "
                f"{dt:>8.2f}"
            )


if __name__ == "__main__":
    main()
