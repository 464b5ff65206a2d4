"""Context parallelism: attention over a sequence split across processes (torch.distributed).

* :mod:`~qkv.distributed.shard` — split/unsplit a sequence (contiguous or zigzag) and the
  global positions of each rank's tokens;
* :mod:`~qkv.distributed.block` — the per-block attention math (forward, backward from lse);
* :mod:`~qkv.distributed.ring` — :func:`ring_attention`, exact and differentiable;
* :mod:`~qkv.distributed.context_parallel` — run a model's ``MultiHeadAttention`` layers
  context-parallel without rewriting the model.
"""

from qkv.distributed.context_parallel import ContextParallelAttention, make_context_parallel
from qkv.distributed.ring import RingAttentionError, RingStats, record_ring_stats, ring_attention
from qkv.distributed.shard import chunk_sizes, positions, segments, shard, unshard

__all__ = [
    "ContextParallelAttention",
    "RingAttentionError",
    "RingStats",
    "chunk_sizes",
    "make_context_parallel",
    "positions",
    "record_ring_stats",
    "ring_attention",
    "segments",
    "shard",
    "unshard",
]
