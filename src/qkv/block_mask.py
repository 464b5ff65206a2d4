"""Block masks without a compiler: FlexAttention's ``create_block_mask``, evaluated per block.

A :class:`BlockMask` summarises a mask (True = may attend) on a grid of ``(bq, bk)`` blocks:
each block is **empty** (skipped by the kernel), **full** (attended without reading any
mask) or **partial** (its bool tile is kept). ``scaled_dot_product_attention(q, k, v,
mask=block_mask)`` and ``MultiHeadAttention(..., mask=block_mask)`` accept one; the fused
kernel runs its blocks as they are, the other backends expand it with :meth:`BlockMask.to_dense`.

Shapes: ``index (B|1, H|1, nqb, nkb)`` int32 (``-1`` empty, ``-2`` full, ``t >= 0`` partial
with tile ``t``), ``tiles (P, bq, bk)`` bool. Memory is O(blocks + partial blocks · bq·bk),
never ``(Tq, Tk)``.

>>> bm = create_block_mask(lambda b, h, q, kv: kv <= q, None, None, 1024, 1024)
>>> bm.counts()
{'empty': 28, 'full': 28, 'partial': 8}
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "BlockMask",
    "create_block_mask",
    "document_mask",
    "prefix_lm_mask",
    "sliding_window_mask",
]

BLOCK_SIZE = 128  # FlexAttention's default; also the fused kernel's block with a block mask
EMPTY, FULL = -1, -2
_CHUNK_ELEMENTS = 1 << 19  # mask_fn evaluated on ~512K (query, key) pairs at a time
_ONES = 0x0101010101010101  # eight True bytes read as one int64 word

MaskFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True, eq=False)
class BlockMask:
    """A mask summarised per block (see the module docstring). Build with
    :func:`create_block_mask` or the shortcuts; ``B``/``H`` are ``None`` when shared."""

    B: int | None
    H: int | None
    Tq: int
    Tk: int
    block_size: tuple[int, int]
    index: Tensor  # (B|1, H|1, nqb, nkb) int32
    tiles: Tensor  # (P, bq, bk) bool
    spans: Tensor | None = None  # (P, bq, 2) int32, derived: see __post_init__

    def __post_init__(self) -> None:
        # Each tile row's keys as one span [lo, hi) when they are contiguous (rows of causal,
        # window, document and prefix tiles are), else [-1, -1]: the kernel then narrows the
        # row's key range instead of reading mask bytes (as for causal blocks).
        t = self.tiles
        if self.spans is not None or t.dim() != 3:
            return
        n = t.shape[-1]
        cols = torch.arange(n, device=t.device)
        count = t.sum(-1, dtype=torch.int32)  # (P, bq)
        lo = torch.where(t, cols, n).amin(-1).to(torch.int32)
        hi = torch.where(t, cols + 1, 0).amax(-1).to(torch.int32)
        lo = torch.where(count == 0, 0, lo)
        hi = torch.where(count == 0, 0, hi)
        span = count == hi - lo
        spans = torch.stack([torch.where(span, lo, -1), torch.where(span, hi, -1)], -1)
        object.__setattr__(self, "spans", spans.contiguous())

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.B or 1, self.H or 1, self.Tq, self.Tk)

    def counts(self) -> dict[str, int]:
        """How many blocks are empty, full and partial (over every batch and head)."""
        idx = self.index
        return {
            "empty": int((idx == EMPTY).sum()),
            "full": int((idx == FULL).sum()),
            "partial": int((idx >= 0).sum()),
        }

    def sparsity(self) -> float:
        """Fraction of blocks skipped (empty)."""
        return float((self.index == EMPTY).float().mean()) if self.index.numel() else 0.0

    def to_dense(self) -> Tensor:
        """The mask ``(B|1, H|1, Tq, Tk)`` (True = may attend): O(Tq·Tk), for the reference."""
        bq, bk = self.block_size
        b, h, nqb, nkb = self.index.shape
        P = self.tiles.shape[0]
        dev = self.index.device
        ext = torch.cat(
            [self.tiles, torch.zeros(1, bq, bk, dtype=torch.bool, device=dev),
             torch.ones(1, bq, bk, dtype=torch.bool, device=dev)]
        )  # fmt: skip
        idx = self.index.long()
        idx = torch.where(idx == EMPTY, P, torch.where(idx == FULL, P + 1, idx))
        dense = ext[idx]  # (b, h, nqb, nkb, bq, bk)
        dense = dense.permute(0, 1, 2, 4, 3, 5).reshape(b, h, nqb * bq, nkb * bk)
        return dense[..., : self.Tq, : self.Tk]

    def __repr__(self) -> str:
        c = self.counts()
        return (
            f"BlockMask(B={self.B}, H={self.H}, Tq={self.Tq}, Tk={self.Tk}, "
            f"block_size={self.block_size}, empty={c['empty']}, full={c['full']}, "
            f"partial={c['partial']})"
        )


def _check_sizes(B, H, Tq, Tk, block_size) -> tuple[int, int]:
    for name, x in (("B", B), ("H", H)):
        if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < 1):
            raise ValueError(f"{name} must be an int >= 1 or None (same for all), got {x!r}")
    for name, x in (("Tq", Tq), ("Tk", Tk)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be an int >= 1, got {x!r}")
    bs = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    if len(bs) != 2 or not all(isinstance(x, int) and x >= 1 for x in bs):
        raise ValueError(f"block_size must be an int >= 1 or a pair of them, got {block_size!r}")
    return bs  # type: ignore[return-value]


def create_block_mask(
    mask_fn: MaskFn,
    B: int | None,
    H: int | None,
    Tq: int,
    Tk: int,
    *,
    block_size: int | tuple[int, int] = BLOCK_SIZE,
    device: torch.device | str | None = None,
) -> BlockMask:
    """A :class:`BlockMask` from ``mask_fn(b, h, q_idx, kv_idx) -> bool`` (FlexAttention's form).

    ``mask_fn`` receives int32 index tensors that broadcast together (``b``, ``h`` 0-dim,
    ``q_idx`` ``(rows, 1)``, ``kv_idx`` ``(1, cols)``) and returns True where query ``q_idx``
    may attend to key ``kv_idx`` (indices from 0, not aligned bottom-right). ``B``/``H``
    ``None`` means the same mask for every batch entry/head (``b``/``h`` are then 0). It is
    evaluated on chunks of whole blocks (~512K pairs), so no ``(Tq, Tk)`` tensor is held.

    >>> docs = torch.tensor([0] * 300 + [1] * 212)
    >>> bm = create_block_mask(lambda b, h, q, kv: docs[q] == docs[kv], None, None, 512, 512)
    >>> bm.counts()["empty"]
    4
    """
    bq, bk = _check_sizes(B, H, Tq, Tk, block_size)
    nqb, nkb = -(-Tq // bq), -(-Tk // bk)
    Bm, Hm = B or 1, H or 1
    # chunks of whole blocks, ~512K pairs: the mask_fn's temporaries stay in cache (measured
    # 2-4x faster than 8M-pair chunks); int32 indices halve their size again
    cols = min(nkb, max(1, _CHUNK_ELEMENTS // (bq * bk))) * bk
    rows = max(1, _CHUNK_ELEMENTS // (bq * cols)) * bq
    index = torch.empty(Bm, Hm, nqb, nkb, dtype=torch.int32, device=device)
    tiles: list[Tensor] = []
    n_tiles = 0
    for b in range(Bm):
        bt = torch.tensor(b, dtype=torch.int32, device=device)
        for h in range(Hm):
            ht = torch.tensor(h, dtype=torch.int32, device=device)
            for qs in range(0, Tq, rows):
                qe = min(qs + rows, Tq)
                q_idx = torch.arange(qs, qe, dtype=torch.int32, device=device).unsqueeze(1)
                for ks in range(0, Tk, cols):
                    ke = min(ks + cols, Tk)
                    kv_idx = torch.arange(ks, ke, dtype=torch.int32, device=device).unsqueeze(0)
                    m = torch.as_tensor(mask_fn(bt, ht, q_idx, kv_idx), device=device)
                    if m.dtype != torch.bool:
                        raise TypeError(
                            f"mask_fn must return bool (True = may attend), got {m.dtype}"
                        )
                    try:
                        m = m.expand(qe - qs, ke - ks)
                    except RuntimeError:
                        raise ValueError(
                            f"mask_fn must return a bool tensor that broadcasts to (q_idx, kv_idx)"
                            f" = ({qe - qs}, {ke - ks}), got shape {tuple(m.shape)}"
                        ) from None
                    state, new = _summarise(m, bq, bk, n_tiles)
                    if new is not None:
                        tiles.append(new)
                        n_tiles += new.shape[0]
                    index[b, h, qs // bq : qs // bq + state.shape[0],
                          ks // bk : ks // bk + state.shape[1]] = state  # fmt: skip
    tile_t = torch.cat(tiles) if tiles else torch.zeros(0, bq, bk, dtype=torch.bool, device=device)
    return BlockMask(B, H, Tq, Tk, (bq, bk), index, tile_t.contiguous())


def _summarise(m: Tensor, bq: int, bk: int, first: int) -> tuple[Tensor, Tensor | None]:
    """States ``(nq, nk)`` of the blocks of a chunk ``m (rows, cols)`` (rows, cols multiples of
    the block unless at the sequence's end) and the tiles of its partial blocks, numbered from
    ``first``. any / all per block are maxima over the bytes read 8 at a time as int64 words
    (a word of 8 Trues is ``_ONES``; xor with it, and a block is full when every word is 0):
    the fastest reductions measured (torch's bool ``any``/``all`` and int64 ``amin`` were 5-40x
    slower). Outside the sequence counts as False for any, True for all."""
    r, c = m.shape
    nq, nk = -(-r // bq), -(-c // bk)
    u = m.contiguous().view(torch.uint8)
    if r == nq * bq and c == nk * bk and bk % 8 == 0 and u.storage_offset() % 8 == 0:
        w = u.view(torch.int64).view(nq, bq, nk, bk // 8)
        any_ = w.amax(3).amax(1) != 0  # (nq, nk)
        all_ = (w ^ _ONES).amax(3).amax(1) == 0
        lo = u
    else:  # a chunk at the sequence's end (or an odd block): padded, bytes reduced
        pad = (0, nk * bk - c, 0, nq * bq - r)
        lo = torch.nn.functional.pad(u, pad, value=0)
        hi = torch.nn.functional.pad(u, pad, value=1)
        any_ = lo.view(nq, bq, nk, bk).amax(dim=(1, 3)) > 0
        all_ = hi.view(nq, bq, nk, bk).amin(dim=(1, 3)) > 0
    state = torch.where(all_, FULL, torch.where(any_, 0, EMPTY)).to(torch.int32)
    partial = state == 0
    p = int(partial.sum())
    if not p:
        return state, None
    state[partial] = torch.arange(first, first + p, dtype=torch.int32, device=m.device)
    blocks = lo.view(torch.bool).view(nq, bq, nk, bk).transpose(1, 2)  # (nq, nk, bq, bk)
    return state, blocks[partial]  # (p, bq, bk), False outside


# --- shortcuts: block states from the structure (no per-pair evaluation), tiles only for
# the partial blocks --------------------------------------------------------------------------


def _bounds(T: int, bs: int, device) -> tuple[Tensor, Tensor]:
    """First and last index of each block ``(n,)``."""
    start = torch.arange(0, T, bs, device=device)
    return start, (start + bs).clamp(max=T) - 1


def _from_rules(
    full: Tensor, any_: Tensor, tile_fn: Callable[[Tensor, Tensor, Tensor], Tensor],
    B: int | None, Tq: int, Tk: int, bq: int, bk: int,
    key_fn: Callable[[Tensor], Tensor] | None = None,
) -> BlockMask:  # fmt: skip
    """Index and tiles from block states ``full``/``any_`` ``(B|1, 1, nqb, nkb)`` (``any_``
    may overstate: tiles found empty or full are reclassified); ``tile_fn(b, q, kv)`` gives the
    mask on broadcast index tensors. ``key_fn(pos)`` ``(P, 4) -> (P, m)``: partial blocks with
    equal keys have equal tiles, so one tile is computed and stored per distinct key."""
    dev = full.device
    index = torch.where(full, FULL, torch.where(any_, 0, EMPTY)).to(torch.int32)
    pos = (index == 0).nonzero()  # (P, 4): b, h, qb, kb
    if len(pos) and key_fn is not None:  # one representative block per distinct tile
        edge = ((pos[:, 2] + 1) * bq > Tq) | ((pos[:, 3] + 1) * bk > Tk)
        keys = torch.cat([key_fn(pos), torch.where(edge[:, None], pos[:, 2:], -1)], dim=1)
        _, inverse = torch.unique(keys, dim=0, return_inverse=True)
        first = torch.full((int(inverse.max()) + 1,), len(pos), dtype=torch.long, device=dev)
        first.scatter_reduce_(0, inverse, torch.arange(len(pos), device=dev), "amin")
        rep = pos[first]  # (U, 4)
        q = rep[:, 2, None, None] * bq + torch.arange(bq, device=dev)[None, :, None]
        kv = rep[:, 3, None, None] * bk + torch.arange(bk, device=dev)[None, None, :]
        inside = (q < Tq) & (kv < Tk)
        tiles = tile_fn(rep[:, 0, None, None], q.clamp(max=Tq - 1), kv.clamp(max=Tk - 1)) & inside
        flat = tiles.flatten(1)
        none, all_ = ~flat.any(1), (flat | ~inside.flatten(1)).all(1)
        keep = ~(none | all_)
        new_id = torch.cumsum(keep, 0, dtype=torch.int32) - 1  # tile number of kept keys
        code = torch.where(none, EMPTY, torch.where(all_, FULL, new_id)).to(torch.int32)
        index[pos.unbind(1)] = code[inverse]
        return BlockMask(B, None, Tq, Tk, (bq, bk), index, tiles[keep].contiguous())
    if len(pos):
        q = pos[:, 2, None, None] * bq + torch.arange(bq, device=dev)[None, :, None]  # (P, bq, 1)
        kv = pos[:, 3, None, None] * bk + torch.arange(bk, device=dev)[None, None, :]  # (P, 1, bk)
        inside = (q < Tq) & (kv < Tk)
        b = pos[:, 0, None, None]  # (P, 1, 1)
        tiles = tile_fn(b, q.clamp(max=Tq - 1), kv.clamp(max=Tk - 1)) & inside  # (P, bq, bk)
        flat = tiles.flatten(1)
        none, all_ = ~flat.any(1), (flat | ~inside.flatten(1)).all(1)
        keep = ~(none | all_)
        sel = pos.unbind(1)
        index[sel] = torch.where(none, EMPTY, torch.where(all_, FULL, 0)).to(torch.int32)
        kept = pos[keep].unbind(1)
        index[kept] = torch.arange(int(keep.sum()), dtype=torch.int32, device=dev)
        tiles = tiles[keep]
    else:
        tiles = torch.zeros(0, bq, bk, dtype=torch.bool, device=dev)
    return BlockMask(B, None, Tq, Tk, (bq, bk), index, tiles.contiguous())


def _causal_window_rules(T, bq, bk, window, sinks, device):
    """(full, any) ``(nqb, nkb)`` of ``kv <= q`` (and the window/sinks), Tq = Tk = T."""
    qs, qe = _bounds(T, bq, device)
    ks, ke = _bounds(T, bk, device)
    qs, qe, ks, ke = qs[:, None], qe[:, None], ks[None, :], ke[None, :]
    full, any_ = ke <= qs, ks <= qe
    if window is not None:
        full_w, any_w = ks > qe - window, ke > qs - window
        if sinks:
            full_w, any_w = full_w | (ke < sinks), any_w | (ks < sinks)
        full, any_ = full & full_w, any_ & any_w
    return full, any_


def _check_window(window, sinks) -> None:
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"window must be an int >= 1 or None, got {window!r}")
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"sinks must be an int >= 0, got {sinks!r}")


def document_mask(
    document_ids: Tensor, *, causal: bool = True, window: int | None = None,
    block_size: int | tuple[int, int] = BLOCK_SIZE,
) -> BlockMask:  # fmt: skip
    """Packed sequences: token ``i`` attends to ``j`` only within its document.

    ``document_ids`` ``(T,)`` or ``(B, T)`` integers (segment ids; sorted ones give the most
    empty blocks, any order is correct). With ``causal`` only ``j <= i``; ``window`` keeps
    the ``window`` most recent keys (causal). Self-attention: ``Tq = Tk = T``.

    >>> document_mask(torch.tensor([0, 0, 1, 1, 1]), block_size=2).to_dense()[0, 0].int()
    tensor([[1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1]], dtype=torch.int32)
    """
    if (
        not isinstance(document_ids, Tensor)
        or document_ids.dim() not in (1, 2)
        or (document_ids.dtype.is_floating_point or document_ids.dtype == torch.bool)
    ):
        raise ValueError(
            "document_ids must be an integer tensor (T,) or (B, T), got "
            f"{getattr(document_ids, 'dtype', type(document_ids).__name__)} "
            f"{tuple(getattr(document_ids, 'shape', ()))}"
        )
    _check_window(window, 0)
    if window is not None and not causal:
        raise ValueError("document_mask's window is causal: pass causal=True with window")
    B = document_ids.shape[0] if document_ids.dim() == 2 else None
    ids = document_ids.reshape(B or 1, -1).long()  # (B|1, T)
    T = ids.shape[1]
    if T == 0:
        raise ValueError("document_ids must hold at least one token")
    bq, bk = _check_sizes(B, None, T, T, block_size)
    dev = ids.device

    def ranges(bs: int) -> tuple[Tensor, Tensor]:  # per block min/max id (B|1, n)
        n = -(-T // bs)
        pad = torch.nn.functional.pad(ids, (0, n * bs - T), value=0).view(-1, n, bs)
        lo = torch.where(torch.arange(n * bs, device=dev).view(n, bs) < T, pad, ids.max())
        hi = torch.where(torch.arange(n * bs, device=dev).view(n, bs) < T, pad, ids.min())
        return lo.amin(-1), hi.amax(-1)

    qmin, qmax = ranges(bq)
    kmin, kmax = ranges(bk)
    full = (
        (qmin == qmax)[:, :, None]
        & (kmin == kmax)[:, None, :]
        & (qmin[:, :, None] == kmin[:, None, :])
    )
    any_ = (qmax[:, :, None] >= kmin[:, None, :]) & (kmax[:, None, :] >= qmin[:, :, None])
    if causal:
        cf, ca = _causal_window_rules(T, bq, bk, window, 0, dev)
        full, any_ = full & cf, any_ & ca

    def tile_fn(b, q, kv):
        m = ids[b, q] == ids[b, kv]
        if causal:
            m = m & (kv <= q)
        if window is not None:
            m = m & (kv > q - window)
        return m

    def key_fn(pos: Tensor) -> Tensor:
        # The tile is (doc[q] == doc[kv]) ∧ causal/window(q - kv). A block side inside one
        # document is described by that document's id, a side across a boundary by its
        # block; q - kv matters only within (-bq, window + bk).
        b, qb, kb = pos[:, 0], pos[:, 2], pos[:, 3]
        qu, ku = qmin[b, qb] == qmax[b, qb], kmin[b, kb] == kmax[b, kb]
        d = (qb * bq - kb * bk).clamp(-bq, (window or 0) + bk)
        q_side = torch.where(qu, torch.where(ku, -1, qmin[b, qb]), -2 - qb)
        k_side = torch.where(ku, torch.where(qu, (qmin[b, qb] == kmin[b, kb]).long(), kmin[b, kb]),
                             -2 - kb)  # fmt: skip
        return torch.stack([d, q_side, k_side, torch.where(qu & ku, -1, b)], 1)

    return _from_rules(full[:, None], any_[:, None], tile_fn, B, T, T, bq, bk, key_fn)


def prefix_lm_mask(
    prefix_length: int | Tensor, T: int, *, block_size: int | tuple[int, int] = BLOCK_SIZE
) -> BlockMask:
    """Prefix-LM: every token sees the first ``prefix_length`` tokens (bidirectional
    prefix) and, causally, the ones before it: ``j <= i or j < prefix_length``.

    ``prefix_length`` an int or an integer tensor ``(B,)`` (one per batch entry).
    """
    lengths = torch.as_tensor(prefix_length)
    if lengths.dim() > 1 or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise ValueError(
            f"prefix_length must be an int or an integer tensor (B,), got {prefix_length!r}"
        )
    B = lengths.shape[0] if lengths.dim() == 1 else None
    L = lengths.reshape(-1).long()  # (B|1,)
    bq, bk = _check_sizes(B, None, T, T, block_size)
    dev = L.device
    cf, ca = _causal_window_rules(T, bq, bk, None, 0, dev)
    ks, ke = _bounds(T, bk, dev)
    full = cf[None] | (ke[None, None, :] < L[:, None, None])  # (B|1, nqb, nkb)
    any_ = ca[None] | (ks[None, None, :] < L[:, None, None])

    def tile_fn(b, q, kv):
        return (kv <= q) | (kv < L[b])

    def key_fn(pos: Tensor) -> Tensor:  # the tile depends on q - kv and on L - ks
        qs, ks = pos[:, 2] * bq, pos[:, 3] * bk
        return torch.stack([(qs - ks).clamp(-bq, bk), (L[pos[:, 0]] - ks).clamp(0, bk)], 1)

    return _from_rules(full[:, None], any_[:, None], tile_fn, B, T, T, bq, bk, key_fn)


def sliding_window_mask(
    T: int, window: int, *, sinks: int = 0, block_size: int | tuple[int, int] = BLOCK_SIZE
) -> BlockMask:
    """Causal sliding window with attention sinks: ``j <= i`` and (``i - j < window`` or
    ``j < sinks``) — the window of StreamingLLM with its first ``sinks`` tokens kept."""
    _check_window(window, sinks)
    if window is None:
        raise ValueError("window must be an int >= 1, got None")
    bq, bk = _check_sizes(None, None, T, T, block_size)
    full, any_ = _causal_window_rules(T, bq, bk, window, sinks, None)

    def tile_fn(b, q, kv):
        return (kv <= q) & ((kv > q - window) | (kv < sinks))

    def key_fn(pos: Tensor) -> Tensor:  # the tile depends on q - kv and on ks below sinks
        qs, ks = pos[:, 2] * bq, pos[:, 3] * bk
        return torch.stack([(qs - ks).clamp(-bq, window + bk), ks.clamp(max=sinks)], 1)

    return _from_rules(full[None, None], any_[None, None], tile_fn, None, T, T, bq, bk, key_fn)
