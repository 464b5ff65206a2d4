"""Training throughput: qkv's Seq2SeqTransformer vs an equal-size ``torch.nn.Transformer``.

Both get the same embeddings (tied, shared), pre-LN, widths and depths, and train on the same
random token batches with AdamW; steps alternate between the two models so that a busy
machine slows both alike. Prints target tokens/s and the ratio qkv / torch.

    PYTHONPATH=src python bench/train.py --steps 6 --threads 1
    PYTHONPATH=src python bench/train.py --bf16          # autocast, both models
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from _measure import machine_header
from qkv.models import Seq2SeqTransformer, TransformerConfig


class TorchSeq2Seq(nn.Module):
    """``nn.Transformer`` with the same embedding/positions/output layer as qkv's model."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.src_vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.transformer = nn.Transformer(
            cfg.d_model, cfg.n_heads, cfg.n_encoder_layers, cfg.n_decoder_layers, cfg.d_ff,
            cfg.dropout, batch_first=True, norm_first=True,
        )  # fmt: skip
        self.out = nn.Linear(cfg.d_model, cfg.tgt_vocab_size, bias=False)
        self.out.weight = self.embedding.weight

    def embed(self, ids):
        T = ids.shape[1]
        pos = torch.arange(T, dtype=torch.float32)[:, None]
        i = torch.arange(0, self.cfg.d_model, 2, dtype=torch.float32)
        angle = pos / 10000 ** (i / self.cfg.d_model)
        pe = torch.stack([angle.sin(), angle.cos()], -1).flatten(-2)
        return F.dropout(self.embedding(ids) * math.sqrt(self.cfg.d_model) + pe, self.cfg.dropout,
                         self.training)  # fmt: skip

    def forward(self, src, tgt):
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        h = self.transformer(
            self.embed(src), self.embed(tgt), tgt_mask=causal, tgt_is_causal=True,
            src_key_padding_mask=src == 0, memory_key_padding_mask=src == 0,
        )  # fmt: skip
        return self.out(h)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=128, help="sentences per batch")
    p.add_argument("--len", type=int, default=18, help="tokens per sentence")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TransformerConfig(
        src_vocab_size=args.vocab, tgt_vocab_size=args.vocab, d_model=args.d_model, n_heads=4,
        d_ff=4 * args.d_model, n_encoder_layers=args.layers, n_decoder_layers=args.layers,
        dropout=0.1, share_src_tgt_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    models = {"qkv": Seq2SeqTransformer(cfg), "torch.nn.Transformer": TorchSeq2Seq(cfg)}
    n_params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.steps + 1):
        src = torch.randint(4, args.vocab, (args.batch, args.len), generator=g)
        tgt = torch.randint(4, args.vocab, (args.batch, args.len + 1), generator=g)
        batches.append((src, tgt[:, :-1], tgt[:, 1:]))
    seconds = dict.fromkeys(models, 0.0)
    for i, (src, tgt_in, tgt_out) in enumerate(batches):
        for name, model in models.items():
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                logits = model(src, tgt_in)
            loss = F.cross_entropy(
                logits.float().flatten(0, 1), tgt_out.flatten(), label_smoothing=0.1
            )
            opts[name].zero_grad()
            loss.backward()
            opts[name].step()
            if i > 0:  # the first step is warm-up
                seconds[name] += time.perf_counter() - t0
    tokens = args.steps * args.batch * args.len
    print(machine_header())
    print(f"training, batch {args.batch}x{args.len} target tokens, d_model {args.d_model}, "
          f"{args.layers}+{args.layers} layers, vocab {args.vocab}, bf16={args.bf16}, "
          f"{torch.get_num_threads()} threads, {args.steps} steps each (interleaved)")  # fmt: skip
    for name in models:
        print(f"{name:>22}: {tokens / seconds[name]:8.0f} target tok/s   "
              f"({n_params[name] / 1e6:.2f}M parameters)")  # fmt: skip
    ratio = seconds["torch.nn.Transformer"] / seconds["qkv"]
    print(f"{'qkv / torch':>22}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
