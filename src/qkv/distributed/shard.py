"""Split a sequence over the ranks of a context-parallel group, and put it back together.

Two layouts of a sequence of ``T`` positions over ``world`` ranks::

    contiguous  world=2:  rank 0 | 0 1 2 3 |            rank 1 | 4 5 6 7 |
    zigzag      world=2:  rank 0 | 0 1 | 6 7 |          rank 1 | 2 3 | 4 5 |

``contiguous`` cuts the sequence into ``world`` chunks; rank ``r`` holds chunk ``r``.
``zigzag`` cuts it into ``2·world`` chunks; rank ``r`` holds chunks ``r`` and
``2·world − 1 − r``. With causal attention the late positions see many more keys than the
early ones, so contiguous shards leave the last rank with most of the work; zigzag gives
every rank one early and one late chunk, and the same amount of work.

**Uneven lengths.** ``T`` need not divide evenly: chunks follow ``torch.tensor_split``, so the
first ``T % n`` chunks are one position longer than the rest (``n`` = number of chunks).
Ranks then hold shards whose lengths differ by at most one (contiguous) or two (zigzag),
and ``ring_attention`` handles that; a chunk may even be empty when ``T < n``.

Every shard is described by its **segments**: ``(start, length)`` runs of global positions,
one for contiguous, two for zigzag. Positions are what RoPE, causal masks and windows need.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["LAYOUTS", "chunk_sizes", "segments", "positions", "shard", "unshard"]

LAYOUTS = ("contiguous", "zigzag")


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _check_rank(rank: int, world: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need world >= 1 and 0 <= rank < world, got rank={rank}, world={world}")


def chunk_sizes(T: int, n: int) -> list[int]:
    """Sizes of ``n`` chunks of ``T`` as ``torch.tensor_split`` cuts them (first ``T % n`` longer).

    >>> chunk_sizes(10, 4)
    [3, 3, 2, 2]
    """
    if T < 0 or n < 1:
        raise ValueError(f"need T >= 0 and n >= 1, got T={T}, n={n}")
    base, extra = divmod(T, n)
    return [base + (i < extra) for i in range(n)]


def segments(T: int, rank: int, world: int, layout: str = "contiguous") -> list[tuple[int, int]]:
    """The ``(start, length)`` runs of global positions that ``rank`` holds, in shard order.

    >>> segments(8, 0, 2, "zigzag")
    [(0, 2), (6, 2)]
    """
    _check_layout(layout)
    _check_rank(rank, world)
    n = world if layout == "contiguous" else 2 * world
    sizes = chunk_sizes(T, n)
    starts = [sum(sizes[:i]) for i in range(n)]
    chunks = [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]
    return [(starts[c], sizes[c]) for c in chunks]


def local_length(T: int, rank: int, world: int, layout: str = "contiguous") -> int:
    """How many positions ``rank`` holds."""
    return sum(n for _, n in segments(T, rank, world, layout))


def positions(
    T: int,
    rank: int,
    world: int,
    layout: str = "contiguous",
    *,
    device: torch.device | str | None = None,
) -> Tensor:
    """Global positions ``(T_local,)`` of the tokens ``rank`` holds, in shard order.

    Feed them to position embeddings (``embedding(positions)``) so every rank uses the
    positions its tokens have in the whole sequence.

    >>> positions(10, 1, 2, "zigzag").tolist()
    [3, 4, 5, 6, 7]
    """
    runs = [torch.arange(s, s + n, device=device) for s, n in segments(T, rank, world, layout)]
    return torch.cat(runs)


def shard(x: Tensor, rank: int, world: int, *, layout: str = "contiguous", dim: int = -2) -> Tensor:
    """The part of ``x`` along ``dim`` that ``rank`` of ``world`` holds.

    ``dim`` is the sequence dim: ``-2`` for ``(B, h, T, d)`` heads, ``1`` for ``(B, T, d_model)``
    activations or ``(B, T)`` token ids. Returns a new contiguous tensor.

    >>> x = torch.arange(8)[None]  # (B=1, T=8)
    >>> shard(x, 1, 2, layout="zigzag", dim=1)
    tensor([[2, 3, 4, 5]])
    """
    T = x.shape[dim]
    runs = [x.narrow(dim, s, n) for s, n in segments(T, rank, world, layout)]
    return torch.cat(runs, dim=dim).contiguous()


def unshard(parts: list[Tensor] | tuple[Tensor, ...], *, layout: str = "contiguous", dim: int = -2):
    """Inverse of :func:`shard`: ``parts[r]`` is rank ``r``'s shard; returns the whole sequence.

    The total length is the sum of the parts' lengths; each part must have the length
    :func:`shard` gives it (checked).

    >>> x = torch.randn(2, 4, 9, 8)
    >>> torch.equal(unshard([shard(x, r, 3, layout="zigzag") for r in range(3)], layout="zigzag"), x)
    True
    """
    world = len(parts)
    if world < 1:
        raise ValueError("unshard() needs at least one part")
    T = sum(p.shape[dim] for p in parts)
    pieces: list[tuple[int, Tensor]] = []
    for r, p in enumerate(parts):
        want = local_length(T, r, world, layout)
        if p.shape[dim] != want:
            raise ValueError(
                f"part {r} has length {p.shape[dim]} along dim {dim}, expected {want} for "
                f"T={T}, world={world}, layout={layout!r}"
            )
        offset = 0
        for start, n in segments(T, r, world, layout):
            pieces.append((start, p.narrow(dim, offset, n)))
            offset += n
    pieces.sort(key=lambda sp: sp[0])
    return torch.cat([t for _, t in pieces], dim=dim)
