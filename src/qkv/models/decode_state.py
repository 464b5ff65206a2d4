"""The state of one generation on a prepared decoder: the self-attention caches, the memory's
cross-attention keys/values, the position, and where each hypothesis's rows live as beams are
reordered and finished sentences leave the batch.

Shapes: ``N = B·K`` hypotheses (sentence-major, beams inner); caches ``(N, h_kv, T, d_k)`` per
layer; cross keys/values ``(B, h_kv, S, d_k)`` per layer; the source mask ``(B, 1, 1, S)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.cache import KVCache

__all__ = ["DecodeState", "hypothesis_rows"]


def hypothesis_rows(sentences: Tensor, beams: int) -> Tensor:
    """Batch rows of the ``beams`` hypotheses of each of ``sentences (B',)``: ``(B'·beams,)``
    (sentence-major, beams inner)."""
    return (sentences[:, None] * beams + torch.arange(beams, device=sentences.device)).view(-1)


class DecodeState:
    """Per-call state: the self-attention caches, the memory's keys/values, the position."""

    def __init__(self, caches: list[KVCache], cross: list[tuple[Tensor, Tensor]],
                 cross_mask: Tensor | None, beams: int) -> None:  # fmt: skip
        self.caches = caches
        self.cross = cross  # per layer (B, h_kv, S, d_k) keys and values
        self.cross_mask = cross_mask  # (B, 1, 1, S) bool, or None
        self.beams = beams
        self.t = 0  # positions decoded so far
        self.t0 = 0  # the position of the first step (a prefilled cache's length)
        self.bias: Tensor | None = None  # the mask as an additive float bias (torch path)
        self.positions: Tensor | None = None  # (max_steps, d) added to the embeddings
        self.choices: dict[tuple[str, int], str] = {}  # attention path per (kind, Tk range)
        self.masks5: dict[tuple[int, int, int], Tensor] = {}  # the decode kernel's mask views
        # beam search with the decode kernel: the self-attention caches are never reordered;
        # rows[b, p] is the batch row holding hypothesis b's key/value at position p (N, cap)
        self.gather = False
        self.rows: Tensor | None = None
        # sentences that finished, with the decode kernel: nothing is compacted; phys[i] is
        # the cache batch row of hypothesis i (where its new keys/values go), sent[j] the
        # cross-attention batch row of running sentence j (None: all still run)
        self.phys: Tensor | None = None
        self.sent: Tensor | None = None
        self.fused = False  # steps run IncrementalDecoder's compiled step (its caches sized)

    @property
    def cross_kv(self) -> tuple[list[Tensor], list[Tensor]]:
        """The cross-attention keys and the values, one list each (layer order)."""
        return [k for k, _ in self.cross], [v for _, v in self.cross]

    def reorder(self, rows: Tensor) -> None:
        """Follow the surviving beams: hypothesis ``i`` continues row ``rows[i]`` ``(N,)``."""
        if self.rows is not None:  # nothing copied: the table says where each key lives
            t = self.t
            self.rows[:, :t] = self.rows.index_select(0, rows)[:, :t]
            return
        for c in self.caches:
            c.reorder(rows)

    def keep(self, index: Tensor) -> None:
        """Keep only the sentences ``index`` ``(B',)``, with all their beams (finished
        sentences leave the batch, so later steps compute only the rows still running)."""
        K = self.beams
        hyps = hypothesis_rows(index, K)  # (B'·K,)
        if self.gather:  # nothing copied: the kernel reads the rows still running in place
            B = self.sent.shape[0] if self.sent is not None else self._sentences()
            phys = self.phys if self.phys is not None else torch.arange(B * K)
            sent = self.sent if self.sent is not None else torch.arange(B)
            self.phys, self.sent = phys[hyps], sent[index]
            if self.rows is not None:  # its later positions already hold phys (see step)
                self.rows = self.rows.index_select(0, hyps)
        else:  # other paths: the caches compacted to the rows still running
            for c in self.caches:
                c.reorder(hyps)
            self.cross = [(k.index_select(0, index), v.index_select(0, index))
                          for k, v in self.cross]  # fmt: skip
        if self.cross_mask is not None:
            self.cross_mask = self.cross_mask.index_select(0, index)
        self.bias = None  # rebuilt from the mask on the next step
        self.choices.clear()  # the attention shapes changed
        self.masks5.clear()

    def release(self) -> None:
        """The generation is over: the caches' buffers go back to their pool (if any)."""
        for c in self.caches:
            c.reset()

    def _sentences(self) -> int:
        """How many sentences the caches hold (before any left)."""
        if self.cross:
            return self.cross[0][0].shape[0]
        return (self.caches[0].batch_size or 0) // self.beams if self.caches else 0

    def expand(self, beams: int) -> None:
        """From one row per sentence to ``beams`` identical rows each (after a first step
        that all beams share)."""
        if self.beams != 1 or self.phys is not None:
            raise ValueError(f"expand() needs one row per sentence, the state has {self.beams}")
        B = self._sentences()
        self.reorder(torch.arange(B).repeat_interleave(beams))
        self.beams = beams
        if self.gather:  # from now on beams are reordered through the table, not copied
            N, cap = B * beams, self.caches[0].capacity if self.caches else 0
            self.rows = torch.arange(N)[:, None].expand(N, cap).contiguous()
        self.choices.clear()  # the attention shapes changed
        self.masks5.clear()
