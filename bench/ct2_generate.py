"""Translator generation: qkv against CTranslate2 on the same weights, side by side.

    PYTHONPATH=src python bench/ct2_generate.py                 # shipped en-fr, 1 and 2 threads
    PYTHONPATH=src python bench/ct2_generate.py --random        # same architecture, random weights
    PYTHONPATH=src python bench/ct2_generate.py --threads 1 --rounds 5

The model is converted into CTranslate2's ``TransformerSpec`` in this process (bench/_ct2.py)
and the greedy tokens of both are compared *before* anything is timed: the run stops unless
100 % agree. Then every row runs with fixed output lengths on both sides (``</s>`` blocked
until the length is reached: ``min_new_tokens`` / ``min_decoding_length``), qkv fp32 against
CTranslate2 float32 and int8, and qkv int8 (``quantize_linears``: every linear in int8)
against CTranslate2 int8, each engine once per round in turn (interleaved), best round kept.
``speed`` is CTranslate2's time over qkv's in the same precision: above 1.0 qkv is faster.
The int8 engines quantize differently (CTranslate2 also its activations' scales per row, and
keeps some operations in float), so their tokens may differ: the run prints how many agree,
but times fixed lengths either way. Prints the CPU, torch's ISA path and the thread counts.
Without ctranslate2 it prints why and exits 0.

With a shipped model and Multi30k at hand (``--data``), two more rows translate the first 32
sentences of test_2016_flickr as a user would: each sentence stops at its own ``</s>`` (both
engines with the same length limit), so the time follows the real output lengths.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

import _ct2
from _measure import machine_header
from qkv.generate import beam_search, greedy_search
from qkv.kernels.int8 import int8_path, quantize_linears

# (name, sentences, source tokens incl. </s>, output tokens, beam)
ROWS = [
    ("1 sentence, 14 -> 16 tokens, greedy", 1, 14, 16, 1),
    ("1 sentence, beam 5", 1, 14, 16, 5),
    ("32 sentences, greedy", 32, 14, 16, 1),
    ("32 sentences, beam 5", 32, 14, 16, 5),
    ("1 sentence, 64 -> 64 tokens, greedy", 1, 64, 64, 1),
]


# (name, sentences, beam): real test sentences, natural stopping
NATURAL = [("32 test sentences, greedy, own lengths", 32, 1),
           ("32 test sentences, beam 5, own lengths", 32, 5)]


def random_model():
    from qkv.models import Seq2SeqTransformer, TransformerConfig

    torch.manual_seed(0)
    cfg = TransformerConfig(src_vocab_size=8000, tgt_vocab_size=8000, d_model=256, n_heads=4,
                            d_ff=1024, dropout=0.0, share_src_tgt_embeddings=True)  # fmt: skip
    return Seq2SeqTransformer(cfg).eval()


def sources(cfg, n: int, length: int, seed: int, ragged: bool = False) -> torch.Tensor:
    """``(n, length)`` random non-special ids ending in ``</s>`` (ragged: random lengths)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, cfg.src_vocab_size, (n, length), generator=g)
    lengths = torch.randint(3, length + 1, (n,), generator=g) if ragged else [length] * n
    for i, L in enumerate(lengths):
        src[i, int(L) - 1] = cfg.eos_id
        src[i, int(L) :] = cfg.pad_id
    return src


def rows_of(src: torch.Tensor, cfg) -> list[list[int]]:
    return [[t for t in r if t != cfg.pad_id] for r in src.tolist()]


def ct2_ids(results, vocab_index: dict[str, int]) -> list[list[int]]:
    return [[vocab_index[t] for t in r.hypotheses[0]] for r in results]


def check_agreement(model, translator, vocab, n: int = 64) -> tuple[int, int]:
    """Greedy tokens of qkv and CTranslate2 float32 over ``n`` ragged sentences, natural
    stopping (``</s>`` allowed) and up to 40 tokens; returns (agreeing, total) tokens."""
    cfg = model.cfg
    src = sources(cfg, n, 24, seed=1, ragged=True)
    ours = greedy_search(model, src, max_new_tokens=40)
    res = translator.translate_batch(
        [_ct2.tokens(r, vocab) for r in rows_of(src, cfg)], beam_size=1,
        max_decoding_length=40, return_end_token=True,
    )  # fmt: skip
    index = {t: i for i, t in enumerate(vocab)}
    theirs = ct2_ids(res, index)
    agree = total = 0
    for o, t in zip(ours.tolist(), theirs):
        o = o[: o.index(cfg.eos_id) + 1] if cfg.eos_id in o else [x for x in o if x != cfg.pad_id]
        total += max(len(o), len(t))
        agree += sum(a == b for a, b in zip(o, t)) if len(o) == len(t) else 0
    return agree, total


def test_sources(model, tokenizer, data: str | None, name: str) -> torch.Tensor | None:
    """The first 32 sentences of test_2016_flickr in the model's source language, ``(32, S)``
    padded ids ending in ``</s>``; ``None`` without a tokenizer (random weights) or data."""
    from qkv.data.corpus import default_data_dir, read_lines

    folder = data or default_data_dir()
    src_lang = str(name).split("-")[0] if str(name) in ("en-fr", "fr-en") else None
    if tokenizer is None or folder is None or src_lang is None:
        return None
    from pathlib import Path

    path = Path(folder) / f"test_2016_flickr.{src_lang}.gz"
    if not path.exists():
        return None
    ids = [tokenizer.encode(s) + [tokenizer.eos_id] for s in read_lines(path)[:32]]
    src = torch.full((len(ids), max(map(len, ids))), model.cfg.pad_id, dtype=torch.long)
    for i, x in enumerate(ids):
        src[i, : len(x)] = torch.tensor(x)
    return src


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="en-fr", help="shipped model name or directory")
    p.add_argument("--random", action="store_true", help="random weights, same architecture")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (best kept)")
    p.add_argument("--rows", type=int, nargs="+", default=None, help="row numbers (1-7)")
    p.add_argument("--data", default=None, help="Multi30k directory (natural-length rows)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall time, or the process's CPU time (all its threads; steadier on a "
                        "machine shared with other work, meaningful with 1 thread)")  # fmt: skip
    args = p.parse_args()
    why = _ct2.available()
    if why is not None:
        print(f"skipped: {why}")
        return 0
    import ctranslate2

    tokenizer = None
    if args.random:
        model, name = random_model(), "random weights"
    else:
        from qkv.translate import load_translator

        model, tokenizer = load_translator(args.model)
        model, name = model.eval(), args.model
    cfg = model.cfg
    n_params = sum(p.numel() for p in model.parameters()) / 1e6
    print(machine_header())
    print(f"ctranslate2 {ctranslate2.__version__} | model {name} ({n_params:.1f}M, d_model "
          f"{cfg.d_model}, {cfg.n_heads} heads, d_ff {cfg.d_ff}, {cfg.n_encoder_layers}+"
          f"{cfg.n_decoder_layers} layers, vocab {cfg.tgt_vocab_size})")  # fmt: skip
    vocab = _ct2.vocabulary(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        _ct2.convert(model, tmp)
        engines = {
            (kind, n): ctranslate2.Translator(
                tmp, device="cpu", compute_type=kind, intra_threads=n, inter_threads=1
            )  # fmt: skip
            for kind in ("float32", "int8")
            for n in args.threads
        }
    torch.set_num_threads(1)
    agree, total = check_agreement(model, engines[("float32", args.threads[0])], vocab)
    print(f"greedy tokens agreeing with CTranslate2 float32: {agree}/{total} "
          f"({100 * agree / total:.1f} %)")  # fmt: skip
    if agree != total:
        print("conversion is not exact: nothing timed")
        return 1
    model8 = quantize_linears(model)
    agree8, total8 = check_agreement(model8, engines[("int8", args.threads[0])], vocab)
    print(f"qkv int8 ({int8_path()}) greedy tokens agreeing with CTranslate2 int8: "
          f"{agree8}/{total8} ({100 * agree8 / total8:.1f} %)")  # fmt: skip
    table = [(label, n, S, T, beam, None) for label, n, S, T, beam in ROWS]
    natural = test_sources(model, tokenizer, args.data, args.model)
    if natural is not None:
        table += [(label, n, natural.shape[1], None, beam, natural[:n]) for label, n, beam
                  in NATURAL]  # fmt: skip
    else:
        print("natural-length rows skipped: they need a shipped model and Multi30k (--data)")
    rows = [table[i - 1] for i in args.rows if i <= len(table)] if args.rows else table
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    print(f"clock: {args.clock} time, best of {args.rounds} interleaved rounds")
    print(f"\n{'':38} {'thr':>3} {'qkv fp32':>9} {'ct2 fp32':>9} {'speed':>6} "
          f"{'qkv int8':>9} {'ct2 int8':>9} {'speed':>6}")  # fmt: skip
    for threads in args.threads:
        for r, (label, n, S, T, beam, real) in enumerate(rows):
            src = sources(cfg, n, S, seed=100 + r) if real is None else real
            toks = [_ct2.tokens(x, vocab) for x in rows_of(src, cfg)]
            # fixed rows: exactly T tokens; natural rows: up to 2·S + 10, </s> ends a sentence
            T_max, T_min = (T, T) if real is None else (2 * S + 10, 0)

            def ours(model, src=src, T=T_max, m=T_min, beam=beam):
                if beam == 1:
                    return greedy_search(model, src, max_new_tokens=T, min_new_tokens=m)
                return beam_search(model, src, beam_size=beam, max_new_tokens=T, min_new_tokens=m)

            def theirs(tr, toks=toks, T=T_max, m=T_min, beam=beam):
                return tr.translate_batch(toks, beam_size=beam, max_decoding_length=T,
                                          min_decoding_length=m, max_batch_size=0)  # fmt: skip

            calls = {
                "qkv": lambda f=ours: f(model),
                "qkv8": lambda f=ours: f(model8),
                "fp32": lambda tr=engines[("float32", threads)], f=theirs: f(tr),
                "int8": lambda tr=engines[("int8", threads)], f=theirs: f(tr),
            }
            torch.set_num_threads(threads)
            best = {k: float("inf") for k in calls}
            for f in calls.values():  # warm-up
                f()
            for _ in range(args.rounds):
                for k, f in calls.items():
                    t0 = clock()
                    f()
                    best[k] = min(best[k], clock() - t0)
            ms = {k: 1e3 * v for k, v in best.items()}
            print(f"{label:38} {threads:>3} {ms['qkv']:>7.1f}ms {ms['fp32']:>7.1f}ms "
                  f"{ms['fp32'] / ms['qkv']:>5.2f}x {ms['qkv8']:>7.1f}ms {ms['int8']:>7.1f}ms "
                  f"{ms['int8'] / ms['qkv8']:>5.2f}x", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
