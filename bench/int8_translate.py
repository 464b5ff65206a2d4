"""The shipped translator with int8 linear layers: BLEU and decoding time against fp32.

    PYTHONPATH=src python bench/int8_translate.py                  # en-fr, test_2016_flickr
    PYTHONPATH=src python bench/int8_translate.py --bleu-n 200 --skip-bleu

Variants, each quantized with :func:`qkv.kernels.int8.quantize_linears`:
  fp32            the model as shipped (generate's incremental decoder)
  fp32 plain      the same, decoded through ``model.decode`` with its cache (the path the
                  int8 models take until the incremental decoder runs int8 weights)
  int8            every nn.Linear in int8, the output projection included
  int8 skip-out   every nn.Linear but the (tied) output projection

BLEU (sacreBLEU) on the whole split, greedy and beam 5 with the model's length penalty;
the delta against fp32 must stay within 0.3. Then end-to-end time of 1 and 32 sentences,
greedy and beam 5, variants interleaved round by round (median of the rounds), 1 thread.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator

import torch

import qkv.generate
from _measure import cpu_name
from qkv.apps.train import bleu_chrf
from qkv.data import multi30k
from qkv.kernels.int8 import int8_path, quantize_linears
from qkv.translate import Translator, load


@contextlib.contextmanager
def plain_path(on: bool) -> Iterator[None]:
    """Decode through ``model.decode`` (no incremental decoder) while ``on``."""
    if not on:
        yield
        return
    cls = qkv.generate.IncrementalDecoder
    original = cls.for_model
    cls.for_model = classmethod(lambda c, model: None)
    try:
        yield
    finally:
        cls.for_model = original


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="en-fr")
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--data", default=None)
    p.add_argument("--bleu-n", type=int, default=0, help="sentences for BLEU (0 = all)")
    p.add_argument("--skip-bleu", action="store_true")
    p.add_argument("--skip-time", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tr = load(args.model)
    lp = tr.length_penalty
    pairs = multi30k(args.split, tr.src or "en", tr.tgt or "fr", args.data)
    timed = [s for s, _ in pairs[100:132]]  # the sentences timed
    if args.bleu_n:
        pairs = pairs[: args.bleu_n]
    src, refs = [s for s, _ in pairs], [t for _, t in pairs]
    print(f"{cpu_name()} | torch {torch.__version__} | int8 path {int8_path()} | "
          f"{args.threads} thread(s) | model {args.model}, length penalty {lp}")  # fmt: skip
    variants = {
        "fp32": (tr.model, False),
        "fp32 plain": (tr.model, True),
        "int8": (quantize_linears(tr.model), True),
        "int8 skip-out": (quantize_linears(tr.model, skip=["decoder.out"]), True),
    }

    def run(name: str, sentences: list[str], beam: int) -> list[str]:
        model, plain = variants[name]
        t = Translator(model, tr.tokenizer, src=tr.src, tgt=tr.tgt, beam=beam, length_penalty=lp)
        with plain_path(plain):
            return t(sentences, beam=beam)

    if not args.skip_bleu:
        print(f"\nBLEU on {args.split} ({len(src)} sentences)")
        print(f"{'variant':<15} {'beam':>4} {'BLEU':>6} {'chrF':>6} {'ΔBLEU':>6} {'seconds':>8}")
        base: dict[int, float] = {}
        for beam in (1, 5):
            for name in variants:
                if name == "fp32 plain":  # the same tokens as fp32 (tests/test_generate.py)
                    continue
                t0 = time.perf_counter()
                bleu, chrf = bleu_chrf(run(name, src, beam), refs)
                dt = time.perf_counter() - t0
                base.setdefault(beam, bleu)
                print(f"{name:<15} {beam:>4} {bleu:>6.2f} {chrf:>6.2f} {bleu - base[beam]:>+6.2f} "
                      f"{dt:>8.1f}", flush=True)  # fmt: skip
    if not args.skip_time:
        print(f"\nEnd-to-end time (median of {args.rounds} interleaved rounds), ms")
        cases = [(n, beam) for n in (1, 32) for beam in (1, 5)]
        times: dict[tuple[str, int, int], list[float]] = {}
        for name in variants:  # warm-up (kernel build, packing, first-call costs)
            run(name, timed[:4], 5)
        for _ in range(args.rounds):
            for n, beam in cases:
                for name in variants:
                    t0 = time.perf_counter()
                    run(name, timed[:n], beam)
                    times.setdefault((name, n, beam), []).append(time.perf_counter() - t0)
        print(f"{'sentences':>9} {'beam':>4} " + " ".join(f"{v:>14}" for v in variants)
              + "  int8/fp32-plain  int8/fp32")  # fmt: skip
        for n, beam in cases:
            med = {v: statistics.median(times[(v, n, beam)]) * 1e3 for v in variants}
            print(f"{n:>9} {beam:>4} " + " ".join(f"{med[v]:>14.1f}" for v in variants)
                  + f"  {med['fp32 plain'] / med['int8']:>14.2f}x"
                  + f"  {med['fp32'] / med['int8']:>8.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
