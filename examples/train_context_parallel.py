"""Train a tiny character-level causal LM with each sequence split over the processes.

    PYTHONPATH=src torchrun --nproc_per_node 2 examples/train_context_parallel.py

Every rank sees the same batch of ``(B, T)`` token ids but keeps only its zigzag shard
``(B, T/P)`` of the sequence: embeddings, MLPs and the loss run on the local tokens; the
attention layers are swapped by :func:`qkv.distributed.make_context_parallel` for ring attention
over the whole sequence (RoPE uses global positions). The parameters are replicated, so
their gradients are summed over the ranks before each optimizer step.

Without torchrun (one process) the same script trains the same model unsharded.
"""

from __future__ import annotations

import argparse
import gzip
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from qkv import MultiHeadAttention, RotaryEmbedding
from qkv.distributed import make_context_parallel, shard

DATA = Path("/work/shared/data/multi30k/train.en.gz")


class Block(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = MultiHeadAttention(
            d, heads, n_kv_heads=kv_heads, position=RotaryEmbedding(d // heads)
        )
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):  # (B, T, d)
        x = x + self.attn(self.norm1(x), causal=True)
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int = 64, heads: int = 4, kv_heads: int = 2, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, kv_heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):  # (B, T) -> (B, T, vocab)
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def load_text(path: Path, n_chars: int) -> str:
    if path.exists():
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return f.read(n_chars)
    return "the quick brown fox jumps over the lazy dog.\n" * (n_chars // 45 + 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--layout", choices=["zigzag", "contiguous"], default="zigzag")
    p.add_argument("--data", type=Path, default=DATA)
    args = p.parse_args()

    distributed = "WORLD_SIZE" in os.environ
    if distributed:  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    text = load_text(args.data, 400_000)
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(c) for c in text])

    def batch():  # (B, T) ids and next-token targets; same on every rank (same seed)
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch,))
        window = torch.stack([data[s : s + args.seq_len + 1] for s in starts])  # (B, T + 1)
        return window[:, :-1], window[:, 1:]

    torch.manual_seed(0)  # same initial weights and same batches on every rank
    model = TinyLM(len(vocab))
    if distributed:
        with torch.no_grad():  # the first batch's loss on one process, unsharded, to compare
            state = torch.get_rng_state()
            ids, targets = batch()
            logits = model(ids)  # (B, T, vocab)
            one_process_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
            torch.set_rng_state(state)
        model = make_context_parallel(model, layout=args.layout, timeout=120)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    n_tokens = args.batch * args.seq_len

    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids, targets = batch()
        if distributed:  # keep this rank's part of the sequence
            ids = shard(ids, rank, world, layout=args.layout, dim=1)  # (B, T_local)
            targets = shard(targets, rank, world, layout=args.layout, dim=1)
        logits = model(ids)  # (B, T_local, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / n_tokens
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if distributed:  # replicated parameters: sum the partial gradients; sum the loss
            for param in model.parameters():
                dist.all_reduce(param.grad)
            loss = loss.detach()
            dist.all_reduce(loss)
        opt.step()
        if rank == 0 and (step == 1 or step % 25 == 0):
            rate = step * n_tokens / (time.perf_counter() - t0)
            print(f"step {step:4d}  loss {loss.item():.4f}  ({rate:,.0f} tokens/s, {world} proc)")
            if step == 1 and distributed:
                print(f"           same batch on one process, unsharded: {one_process_loss:.4f}")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
