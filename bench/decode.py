"""KV-cached decoding vs recomputing the whole prefix at every step (greedy, seq2seq).

    PYTHONPATH=src python bench/decode.py            # 64 and 256 output tokens
    PYTHONPATH=src python bench/decode.py --lengths 64 --batch 4 --threads 1

Prints generated tokens/s for both paths and their ratio; the outputs are checked equal.
"""

from __future__ import annotations

import argparse
import time

import torch

from _measure import machine_header
from qkv.generate import greedy_search
from qkv.models import Seq2SeqTransformer, TransformerConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 256])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--src-len", type=int, default=20)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = TransformerConfig(
        src_vocab_size=args.vocab, tgt_vocab_size=args.vocab, d_model=args.d_model,
        n_heads=4, d_ff=4 * args.d_model, n_encoder_layers=args.layers,
        n_decoder_layers=args.layers, dropout=0.0, max_len=max(args.lengths) + 1,
    )  # fmt: skip
    model = Seq2SeqTransformer(cfg).eval()
    src = torch.randint(4, args.vocab, (args.batch, args.src_len))
    print(machine_header())
    print(f"greedy decoding, batch {args.batch}, source {args.src_len} tokens, d_model "
          f"{args.d_model}, {args.layers}+{args.layers} layers, {torch.get_num_threads()} threads")  # fmt: skip
    print(f"{'new tokens':>10} {'cached tok/s':>13} {'recompute tok/s':>16} {'speed-up':>9}")
    for n in args.lengths:
        greedy_search(model, src, max_new_tokens=4, ignore_eos=True)  # warm-up
        t0 = time.perf_counter()
        fast = greedy_search(model, src, max_new_tokens=n, ignore_eos=True)
        t_fast = time.perf_counter() - t0
        t0 = time.perf_counter()
        slow = greedy_search(model, src, max_new_tokens=n, ignore_eos=True, use_cache=False)
        t_slow = time.perf_counter() - t0
        assert torch.equal(fast, slow), "cached and recomputed decoding disagree"
        tokens = args.batch * n
        print(f"{n:>10} {tokens / t_fast:>13.0f} {tokens / t_slow:>16.0f} {t_slow / t_fast:>8.1f}x",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
