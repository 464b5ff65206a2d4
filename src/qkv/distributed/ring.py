"""Ring attention: exact attention over a sequence split across the ranks of a process group.

Each of the ``P`` ranks holds a shard of the sequence (see :mod:`qkv.distributed.shard`):
its queries and its keys/values. At step ``s`` rank ``r`` attends its queries to the K/V
block that rank ``r − s`` owns, while it already sends that block on to rank ``r + 1`` and
receives the next one from rank ``r − 1`` (``batch_isend_irecv``, overlapped with the
block's math). After ``P`` steps every query has seen every key. The partial results are
merged with their log-sum-exps, so the result is the exact softmax over the whole sequence::

    step 0        step 1        step 2          (P = 3; rank r holds Q_r, computes with ...)
    r0: KV0       r0: KV2       r0: KV1
    r1: KV1       r1: KV0       r1: KV2
    r2: KV2       r2: KV1       r2: KV0

The backward runs the same ring: K/V travel again, and each block's dK/dV accumulator
travels with it, collecting every rank's contribution, and arrives home after ``P`` hops.

Masks (causal, sliding window) are decided from GLOBAL positions, so contiguous and zigzag
shards both give the exact result; blocks (and tiles) that the mask hides entirely are skipped.

Failure: every wait on the network has a timeout (``timeout=``, default the process
group's). If a peer process dies, gloo/nccl fail the pending receive at once; if a peer
stalls (raised and is stuck elsewhere), the wait fails after ``timeout``. Either way this
rank raises :class:`RingAttentionError` saying which peer and which step, instead of hanging.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from qkv._validate import check_options, check_qkv
from qkv.distributed.block import band, block_backward, block_forward, visibility
from qkv.distributed.shard import local_length, segments

__all__ = ["RingAttentionError", "RingStats", "record_ring_stats", "ring_attention"]


class RingAttentionError(RuntimeError):
    """A peer of the ring failed or timed out; raised instead of hanging."""


@dataclass
class RingStats:
    """Time spent in ring attention, filled inside :func:`record_ring_stats`.

    ``wait_s`` is the time this rank sat waiting on the network (communication NOT hidden
    behind computation); ``total_s`` the wall time of the ring calls.
    """

    total_s: float = 0.0
    wait_s: float = 0.0
    steps: int = 0
    skipped_blocks: int = 0
    calls: list[str] = field(default_factory=list)


_STATS: list[RingStats] = []


@contextmanager
def record_ring_stats():
    """Collect :class:`RingStats` for the ring calls (forward and backward) inside the block.

    >>> with record_ring_stats() as stats:  # doctest: +SKIP
    ...     ring_attention(q, k, v, causal=True).sum().backward()
    >>> stats.wait_s / stats.total_s  # doctest: +SKIP
    """
    stats = RingStats()
    _STATS.append(stats)
    try:
        yield stats
    finally:
        _STATS.remove(stats)


@dataclass(frozen=True)
class _Ring:
    group: dist.ProcessGroup | None
    world: int
    rank: int
    T: int
    layout: str
    timeout: timedelta | None

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.world

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.world

    def segs(self, rank: int) -> list[tuple[int, int]]:
        return segments(self.T, rank, self.world, self.layout)

    def length(self, rank: int) -> int:
        return local_length(self.T, rank, self.world, self.layout)

    def error(self, what: str, step: int, e: Exception) -> RingAttentionError:
        return RingAttentionError(
            f"ring_attention: rank {self.rank}/{self.world} failed {what} at "
            f"step {step} (sending to rank {self.next}, receiving from rank {self.prev}); "
            f"a peer raised, died or stalled (timeout={self.timeout}): {e}"
        )

    def wait(self, works: list, what: str, step: int) -> float:
        """Wait for ``works``; return the seconds waited. Any failure → RingAttentionError."""
        t0 = time.perf_counter()
        try:
            for w in works:
                if self.timeout is None:
                    w.wait()
                else:
                    w.wait(self.timeout)
        except Exception as e:  # gloo/nccl raise RuntimeError subclasses (DistBackendError, ...)
            raise self.error(f"waiting for {what}", step, e) from e
        return time.perf_counter() - t0

    def exchange(self, send: list[Tensor], recv: list[Tensor]) -> list:
        """Start sending ``send`` to the next rank and receiving ``recv`` from the previous.

        Starting can fail too (gloo raises at once when a peer has already closed its
        connection): that is reported as a RingAttentionError like a failed wait.
        """
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=self.next) for t in send]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=self.prev) for t in recv]
        try:
            return dist.batch_isend_irecv(ops)
        except Exception as e:
            raise self.error("starting a K/V exchange", -1, e) from e


def _make_ring(
    T_local: int,
    group: dist.ProcessGroup | None,
    layout: str,
    timeout: timedelta | None,
    seq_len: int | None,
) -> _Ring:
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("group= was given but torch.distributed is not initialized")
        return _Ring(None, 1, 0, T_local, layout, timeout)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if seq_len is None:  # learn every rank's length: one tiny all_gather
        mine = torch.tensor([T_local], dtype=torch.int64)
        if dist.get_backend(group) == "nccl":
            mine = mine.cuda()
        got = [torch.zeros_like(mine) for _ in range(world)]
        ring = _Ring(group, world, rank, -1, layout, timeout)
        try:
            work = dist.all_gather(got, mine, group=group, async_op=True)
        except Exception as e:
            raise ring.error("starting the shard-length exchange", 0, e) from e
        ring.wait([work], "shard lengths", 0)
        lengths = [int(t) for t in got]
        seq_len = sum(lengths)
    else:
        lengths = [local_length(seq_len, r, world, layout) for r in range(world)]
        lengths[rank] = T_local
    want = [local_length(seq_len, r, world, layout) for r in range(world)]
    if lengths != want:
        raise ValueError(
            f"ring_attention: shard lengths {lengths} do not match a {layout!r} split of "
            f"T={seq_len} over {world} ranks, which gives {want}; shard with "
            f"qkv.distributed.shard(x, rank, world, layout={layout!r})"
        )
    return _Ring(group, world, rank, seq_len, layout, timeout)


def _merge(out: Tensor, lse: Tensor, o_b: Tensor, lse_b: Tensor) -> None:
    """In place: ``(out, lse) ⊕ (o_b, lse_b)``, the softmax over the union of both key sets.

    ``lse = -inf`` marks a row with no key so far; two such rows stay zero (never NaN).
    """
    new = torch.logaddexp(lse, lse_b)  # (B, h, T)
    safe = new.masked_fill(new == float("-inf"), 0.0)
    w_old = torch.exp(lse - safe).unsqueeze(-1)  # exp(-inf - 0) = 0 for empty rows
    w_new = torch.exp(lse_b - safe).unsqueeze(-1)
    out.mul_(w_old).add_(o_b.float() * w_new)
    lse.copy_(new)


def _pairs(ring: _Ring, src: int, lohi):
    """(q rows, k rows, q_start, k_start) of the segment pairs of (my queries, src's keys)."""
    q_off = 0
    for qs, qn in ring.segs(ring.rank):
        k_off = 0
        for ks, kn in ring.segs(src):
            if visibility(qs, qn, ks, kn, lohi) != "none":
                yield slice(q_off, q_off + qn), slice(k_off, k_off + kn), qs, ks
            k_off += kn
        q_off += qn


def _like(t: Tensor, T: int, *, dtype=None, old: Tensor | None = None) -> Tensor:
    """An uninitialised ``(B, h_kv, T, d)`` buffer like ``t``; reuses ``old`` if it fits."""
    shape = (*t.shape[:2], T, t.shape[-1])
    if old is not None and old.shape == shape and (dtype is None or old.dtype == dtype):
        return old
    return torch.empty(shape, device=t.device, dtype=t.dtype if dtype is None else dtype)


def _forward(q, k, v, ring: _Ring, causal, window, scale, stats):
    B, h, T, d = q.shape
    lohi = band(causal, window)
    out = torch.zeros(B, h, T, v.shape[-1], device=q.device, dtype=torch.float32)
    lse = torch.full((B, h, T), float("-inf"), device=q.device)
    kb, vb = k, v  # the K/V block in hand: (B, h_kv, T_src, d)
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        works = []
        if step < ring.world - 1:  # start moving K/V on before computing with it
            n = ring.length((src - 1) % ring.world)
            nk, nv = _like(k, n), _like(v, n)
            works = ring.exchange([kb, vb], [nk, nv])
        pairs = list(_pairs(ring, src, lohi))
        for qr, kr, qs, ks in pairs:
            o_b, lse_b = block_forward(
                q[:, :, qr], kb[:, :, kr], vb[:, :, kr], scale=scale,
                q_start=qs, k_start=ks, causal=causal, window=window,
            )  # fmt: skip
            _merge(out[:, :, qr], lse[:, :, qr], o_b, lse_b)
        if stats is not None:
            stats.steps += 1
            stats.skipped_blocks += not pairs
        if works:
            waited = ring.wait(works, "the next K/V block", step)
            if stats is not None:
                stats.wait_s += waited
            kb, vb = nk, nv
    return out.to(q.dtype), lse


def _backward(q, k, v, out, lse, dout, ring: _Ring, causal, window, scale, stats):
    lohi = band(causal, window)
    f32 = torch.float32
    delta = (dout.float() * out.float()).sum(-1)  # (B, h, T)  D = rowsum(dO ∘ O)
    dq = torch.zeros(q.shape, device=q.device, dtype=f32)
    kb, vb = k, v
    # dK/dV accumulators: `part` is computed here, `sent` travels on, `got` arrives; three
    # buffers in turn, so the gradient side holds at most three blocks' worth at a time
    sent = got = spare_k = spare_v = None
    works_d: list = []
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        T_src = kb.shape[2]
        works_kv = []
        if step < ring.world - 1:
            n = ring.length((src - 1) % ring.world)
            nk, nv = _like(k, n), _like(v, n)
            works_kv = ring.exchange([kb, vb], [nk, nv])
        # this step's share of block src's gradients, computed from zero so that the
        # accumulator travelling from the previous rank can arrive meanwhile
        part = (
            _like(k, T_src, dtype=f32, old=spare_k).zero_(),
            _like(v, T_src, dtype=f32, old=spare_v).zero_(),
        )
        for qr, kr, qs, ks in _pairs(ring, src, lohi):
            dq_b, dk_b, dv_b = block_backward(
                q[:, :, qr], kb[:, :, kr], vb[:, :, kr], dout[:, :, qr], lse[:, :, qr],
                delta[:, :, qr], scale=scale, q_start=qs, k_start=ks, causal=causal,
                window=window, out=out[:, :, qr],
            )  # fmt: skip
            dq[:, :, qr] += dq_b
            part[0][:, :, kr] += dk_b
            part[1][:, :, kr] += dv_b
        waited = 0.0
        spare_k = spare_v = None
        if works_d:  # the accumulator of block src, from the previous rank
            waited += ring.wait(works_d, "a dK/dV accumulator", step)
            part[0].add_(got[0])
            part[1].add_(got[1])
            spare_k, spare_v = sent  # its send is done: reuse as the next `part`
        if ring.world > 1:  # pass block src's accumulator on; after P hops it is home
            n = ring.length((src - 1) % ring.world)
            old = got if got is not None else (None, None)
            got = (_like(k, n, dtype=f32, old=old[0]), _like(v, n, dtype=f32, old=old[1]))
            works_d = ring.exchange(list(part), list(got))
        sent = part
        if works_kv:
            waited += ring.wait(works_kv, "the next K/V block", step)
            kb, vb = nk, nv
        if stats is not None:
            stats.wait_s += waited
            stats.steps += 1
    if ring.world > 1:
        waited = ring.wait(works_d, "this rank's dK/dV", ring.world)
        if stats is not None:
            stats.wait_s += waited
        sent = got
    return dq.to(q.dtype), sent[0].to(k.dtype), sent[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, causal, window, scale):
        stats = _STATS[-1] if _STATS else None
        t0 = time.perf_counter()
        out, lse = _forward(q, k, v, ring, causal, window, scale, stats)
        if stats is not None:
            stats.total_s += time.perf_counter() - t0
            stats.calls.append("forward")
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.causal, ctx.window, ctx.scale = ring, causal, window, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        stats = _STATS[-1] if _STATS else None
        t0 = time.perf_counter()
        dq, dk, dv = _backward(
            q, k, v, out, lse, dout.contiguous(), ctx.ring, ctx.causal, ctx.window, ctx.scale,
            stats,
        )  # fmt: skip
        if stats is not None:
            stats.total_s += time.perf_counter() - t0
            stats.calls.append("backward")
        return dq, dk, dv, None, None, None, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = False,
    window: int | None = None,
    scale: float | None = None,
    layout: str = "contiguous",
    timeout: float | timedelta | None = None,
    seq_len: int | None = None,
) -> Tensor:
    """Exact attention over a sequence sharded across ``group``; differentiable.

    Every rank passes its own shard (made by :func:`qkv.distributed.shard` with the same
    ``layout``) and gets the attention output of its own queries over ALL keys.

    Args:
        q: this rank's queries ``(B, h, T_local, d_k)``.
        k: this rank's keys ``(B, h_kv, T_local, d_k)``; ``h % h_kv == 0`` (grouped heads).
        v: this rank's values ``(B, h_kv, T_local, d_v)``.
        group: the context-parallel process group (default: the whole world). Without an
            initialized process group, the call runs on one process (``P = 1``).
        causal: key ``j`` is visible to query ``i`` when ``j <= i`` (global positions;
            True = may attend).
        window: sliding window over global positions (see ``qkv.functional``): with
            ``causal`` the ``window`` most recent keys, else keys within ``window - 1``.
        scale: multiplies the scores; default ``1/√d_k``.
        layout: ``"contiguous"`` or ``"zigzag"``: how the sequence was sharded.
        timeout: seconds (or timedelta) to wait on a peer before raising
            :class:`RingAttentionError`; default the process group's timeout.
        seq_len: the global length, if known; saves one small ``all_gather`` per call.

    Returns:
        ``(B, h, T_local, d_v)``: this rank's rows of the full attention.

    >>> # under torchrun --nproc_per_node 2, gloo:
    >>> # q_l = shard(q, rank, 2, layout="zigzag")  (same for k, v)
    >>> # out_l = ring_attention(q_l, k_l, v_l, causal=True, layout="zigzag")
    >>> # unshard(all_gather(out_l), layout="zigzag") == scaled_dot_product_attention(q, k, v, causal=True)
    """
    shape = check_qkv(q, k, v)
    check_options(window=window, scale=scale, softcap=None, dropout_p=0.0, dtype=q.dtype)
    if q.dim() != 4:
        raise ValueError(f"q must be (B, h, T_local, d_k), got shape {tuple(q.shape)}")
    if shape.Tk != shape.Tq:
        raise ValueError(
            f"ring_attention is self-attention over one sharded sequence: q and k/v must hold "
            f"the same positions, got T_local={shape.Tq} for q and {shape.Tk} for k/v"
        )
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=timeout)
    scale = 1.0 / math.sqrt(shape.d_k) if scale is None else float(scale)
    ring = _make_ring(shape.Tq, group, layout, timeout, seq_len)
    return _RingAttention.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), ring, causal, window, scale
    )
