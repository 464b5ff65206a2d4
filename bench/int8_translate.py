"""The shipped translator with int8 linear layers: BLEU and decoding time against fp32.

    PYTHONPATH=src python bench/int8_translate.py                  # en-fr, test_2016_flickr
    PYTHONPATH=src python bench/int8_translate.py --bleu-n 200 --skip-time

Variants (int8 ones made with :func:`qkv.kernels.int8.quantize_linears`):
  fp32              the model as shipped, through generate's incremental decoder
  fp32 plain        the same through ``model.decode`` with its cache (the general path)
  int8 plain        every nn.Linear in int8, the output projection included, general path
  int8 skip-out     every nn.Linear but the (tied) output projection, general path
  int8 incremental  int8 plain's weights in the incremental decoder (its compiled step where
                    the extension is built: the path ``load(..., int8=True)`` takes)
  fp32 kv-int8      fp32, the decoder's self-attention caches in int8 rows (qkv.cache)
  int8 kv-int8      int8 incremental with those caches
  ct2 float32/int8  CTranslate2 on the same weights (bench/_ct2.py), when installed

BLEU (sacreBLEU) on the whole split, greedy and beam 5 with the model's length penalty (for
CTranslate2 its own length penalty of the same value); the int8 delta against fp32 must stay
within 0.3. Then end-to-end time (text in, text out) of 1 and 32 sentences, greedy and
beam 5, every variant once per round in turn (interleaved), median of the rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator

import torch

import _ct2
import qkv.generate
import qkv.models.incremental as incremental
from _measure import machine_header
from qkv.apps.train import bleu_chrf
from qkv.data import multi30k
from qkv.kernels.int8 import int8_path, quantize_linears
from qkv.translate import Translator, load


@contextlib.contextmanager
def plain_path() -> Iterator[None]:
    """Decode through ``model.decode`` (no incremental decoder) inside the block."""
    cls = qkv.generate.IncrementalDecoder
    original = cls.for_model
    cls.for_model = classmethod(lambda c, model: None)
    try:
        yield
    finally:
        cls.for_model = original


def ct2_engines(model, threads: int) -> dict | str:
    """CTranslate2 translators (float32, int8) of ``model``, or why there are none."""
    why = _ct2.available()
    if why is not None:
        return why
    import ctranslate2

    with tempfile.TemporaryDirectory() as tmp:
        _ct2.convert(model, tmp)
        return {
            kind: ctranslate2.Translator(
                tmp, device="cpu", compute_type=kind, intra_threads=threads, inter_threads=1
            )
            for kind in ("float32", "int8")
        }


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
    model, tok, lp = tr.model.eval(), tr.tokenizer, tr.length_penalty
    pairs = multi30k(args.split, tr.src or "en", tr.tgt or "fr", args.data)
    timed = [s for s, _ in pairs[100:132]]  # the sentences timed
    if args.bleu_n:
        pairs = pairs[: args.bleu_n]
    src, refs = [s for s, _ in pairs], [t for _, t in pairs]
    print(machine_header())
    print(f"int8 linears {int8_path()} | {args.threads} thread(s) | model {args.model}, length penalty {lp}")  # fmt: skip
    q_all = quantize_linears(model)
    q_skip = quantize_linears(model, skip=["decoder.out"])
    Context = Callable[[], contextlib.AbstractContextManager]
    contexts: dict[str, tuple[torch.nn.Module, Context, torch.dtype | None]]
    nothing = contextlib.nullcontext
    contexts = {
        "fp32": (model, nothing, None),
        "fp32 plain": (model, plain_path, None),
        "int8 plain": (q_all, plain_path, None),
        "int8 skip-out": (q_skip, plain_path, None),
        "int8 incremental": (q_all, nothing, None),
        "fp32 kv-int8": (model, nothing, torch.int8),
        "int8 kv-int8": (q_all, nothing, torch.int8),
    }
    dec = incremental.IncrementalDecoder.for_model(q_all)
    print("int8 incremental: " + ("compiled step" if dec is not None and dec.fused is not None
                                  else "Python step"))  # fmt: skip
    runs: dict[str, Callable[[list[str], int], list[str]]] = {}
    for name, (m, ctx, kv) in contexts.items():

        def run(sentences, beam, m=m, ctx=ctx, kv=kv):
            t = Translator(m, tok, src=tr.src, tgt=tr.tgt, beam=beam, length_penalty=lp,
                           cache_dtype=kv)  # fmt: skip
            with ctx():
                return t(sentences, beam=beam)

        runs[name] = run
    engines = ct2_engines(model, args.threads)
    if isinstance(engines, str):
        print(f"CTranslate2 skipped: {engines}")
    else:
        vocab = _ct2.vocabulary(model.cfg)
        index = {t: i for i, t in enumerate(vocab)}
        limit = model.cfg.max_len // 2 - 1
        for kind, engine in engines.items():

            def run(sentences, beam, engine=engine):
                ids = [s[:limit] + [tok.eos_id] for s in tok.encode_batch(sentences)]
                res = engine.translate_batch(
                    [_ct2.tokens(s, vocab) for s in ids], beam_size=beam, length_penalty=lp,
                    max_decoding_length=model.cfg.max_len - 1, max_batch_size=0,
                )  # fmt: skip
                return [tok.decode([index[t] for t in r.hypotheses[0]]) for r in res]

            runs[f"ct2 {kind}"] = run

    if not args.skip_bleu:
        print(f"\nBLEU on {args.split} ({len(src)} sentences)")
        print(f"{'variant':<17} {'beam':>4} {'BLEU':>6} {'chrF':>6} {'ΔBLEU':>6} {'seconds':>8}")
        for beam in (1, 5):
            base = None
            for name, run in runs.items():
                if name == "fp32 plain":  # the same tokens as fp32 (tests/generate/test_generate.py)
                    continue
                t0 = time.perf_counter()
                bleu, chrf = bleu_chrf(run(src, beam), refs)
                dt = time.perf_counter() - t0
                base = bleu if base is None else base
                print(f"{name:<17} {beam:>4} {bleu:>6.2f} {chrf:>6.2f} {bleu - base:>+6.2f} "
                      f"{dt:>8.1f}", flush=True)  # fmt: skip
    if not args.skip_time:
        print(f"\nEnd-to-end time, ms (median of {args.rounds} interleaved rounds)")
        cases = [(n, beam) for n in (1, 32) for beam in (1, 5)]
        times: dict[tuple[str, int, int], list[float]] = {}
        for run in runs.values():  # warm-up (kernel build, packing, first-call costs)
            run(timed[:4], 5)
        for _ in range(args.rounds):
            for n, beam in cases:
                for name, run in runs.items():
                    t0 = time.perf_counter()
                    run(timed[:n], beam)
                    times.setdefault((name, n, beam), []).append(time.perf_counter() - t0)
        print(f"{'variant':<17} " + " ".join(f"{f'{n} sent. beam {b}':>16}" for n, b in cases))
        for name in runs:
            med = [statistics.median(times[(name, n, b)]) * 1e3 for n, b in cases]
            print(f"{name:<17} " + " ".join(f"{t:>16.1f}" for t in med))
        print("ratios (time of the first over the second; > 1: the second is faster)")
        pairs_ = [("fp32 plain", "int8 plain"), ("fp32", "int8 incremental"),
                  ("ct2 float32", "int8 incremental"), ("ct2 int8", "int8 incremental")]  # fmt: skip
        for a, b in pairs_:
            if (a, 1, 1) not in times or (b, 1, 1) not in times:
                continue
            r = [statistics.median(times[(a, n, k)]) / statistics.median(times[(b, n, k)])
                 for n, k in cases]  # fmt: skip
            print(f"{a + ' / ' + b:<36} " + " ".join(f"{x:>8.2f}x" for x in r))


if __name__ == "__main__":
    main()
