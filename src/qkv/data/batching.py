"""Token-bucketed batches: sentences of similar length together, about ``max_tokens`` each.

A batch's cost is ``n_sentences × longest`` (source or target, whichever is longer), so
grouping by length wastes little on padding. The batch order of epoch ``e`` depends only on
``(seed, e)``: a resumed run replays the same batches from the saved position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Batch", "encode_pairs", "make_batches", "collate", "epoch_order"]


@dataclass
class Batch:
    """``src (B, S)``, decoder input ``tgt_in (B, T)`` = ``<s> y``, labels ``tgt_out`` = ``y </s>``."""

    src: Tensor
    tgt_in: Tensor
    tgt_out: Tensor

    def to(self, device) -> Batch:
        return Batch(self.src.to(device), self.tgt_in.to(device), self.tgt_out.to(device))

    @property
    def n_tokens(self) -> int:
        """Target tokens that count in the loss (non-pad labels)."""
        return int((self.tgt_out != 0).sum())


def encode_pairs(tokenizer, pairs: list[tuple[str, str]], max_len: int = 256):
    """Tokenise ``pairs`` into ``(src_ids, tgt_ids)`` lists (``</s>`` added to the source),
    dropping pairs longer than ``max_len - 1`` tokens on either side."""
    src = tokenizer.encode_batch([s for s, _ in pairs])
    tgt = tokenizer.encode_batch([t for _, t in pairs])
    eos = tokenizer.eos_id
    return [(s + [eos], t) for s, t in zip(src, tgt) if len(s) < max_len and len(t) < max_len]


def make_batches(examples, max_tokens: int, *, max_sentences: int = 1024) -> list[list[int]]:
    """Index lists: examples sorted by length, cut so ``len × longest + 1 <= max_tokens``."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i][1]), len(examples[i][0])))
    batches, current, longest = [], [], 0
    for i in order:
        n = max(len(examples[i][0]), len(examples[i][1]) + 1)
        if current and (
            max(longest, n) * (len(current) + 1) > max_tokens or len(current) >= max_sentences
        ):
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        batches.append(current)
    return batches


def epoch_order(n_batches: int, seed: int, epoch: int) -> list[int]:
    """The shuffled batch order of ``epoch`` (a pure function of ``seed`` and ``epoch``)."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n_batches, generator=g).tolist()


def collate(examples, index: list[int], *, pad_id: int = 0, bos_id: int = 1, eos_id: int = 2):
    """Pad the examples at ``index`` into a :class:`Batch` (right padding with ``pad_id``)."""
    srcs = [examples[i][0] for i in index]
    tgts = [examples[i][1] for i in index]
    S = max(len(s) for s in srcs)
    T = max(len(t) for t in tgts) + 1
    src = torch.full((len(index), S), pad_id, dtype=torch.long)
    tgt_in = torch.full((len(index), T), pad_id, dtype=torch.long)
    tgt_out = torch.full((len(index), T), pad_id, dtype=torch.long)
    for b, (s, t) in enumerate(zip(srcs, tgts)):
        src[b, : len(s)] = torch.tensor(s)
        tgt_in[b, : len(t) + 1] = torch.tensor([bos_id, *t])
        tgt_out[b, : len(t) + 1] = torch.tensor([*t, eos_id])
    return Batch(src, tgt_in, tgt_out)
