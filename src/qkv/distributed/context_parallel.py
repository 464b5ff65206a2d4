"""Run a model's attention layers context-parallel, without rewriting the model.

Every rank feeds the model its shard of the sequence ``(B, T_local, ...)`` (made with
:func:`qkv.distributed.shard`, ``dim=1``). Everything except attention works per token, so
it needs no change; attention needs every key, so each :class:`~qkv.MultiHeadAttention` is
swapped for a :class:`ContextParallelAttention` that runs :func:`ring_attention` and rotates
RoPE by each token's GLOBAL position.

>>> model = make_context_parallel(model, group, layout="zigzag")  # doctest: +SKIP
>>> ids_l = shard(ids, rank, world, layout="zigzag", dim=1)   # doctest: +SKIP
>>> logits_l = model(ids_l)                                  # doctest: +SKIP

The swap keeps the same ``w_q, w_k, w_v, w_o`` modules (shared, not copied), so parameter
names, ``state_dict`` keys and optimizers are unchanged. Position embeddings added outside
attention (learned, sinusoidal) must be looked up with :func:`qkv.distributed.positions`.
Gradients of the replicated parameters are per-rank partial sums: all-reduce them over the
group (sum) before the optimizer step, as the example ``examples/train_context_parallel.py``
does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from qkv.attention import MultiHeadAttention
from qkv.distributed.ring import _make_ring, ring_attention
from qkv.positional import ALiBi, RotaryEmbedding

__all__ = ["ContextParallelAttention", "make_context_parallel"]


class ContextParallelAttention(nn.Module):
    """A :class:`~qkv.MultiHeadAttention` whose attention step is the ring over ``group``.

    Self-attention only: ``x (B, T_local, d_model)`` is this rank's shard of the sequence;
    the output is this rank's shard ``(B, T_local, d_model)``. ``causal`` and ``window``
    use global positions (True = may attend where allowed); masks, biases, caches, cross-
    attention, ALiBi and attention dropout are not supported and raise ``ValueError``.

    Args:
        mha: the layer to run context-parallel (its projections are shared, not copied).
        group: the context-parallel process group (default: the whole world).
        layout: how the sequence was sharded, ``"contiguous"`` or ``"zigzag"``.
        timeout: seconds to wait on a peer before raising (see :func:`ring_attention`).
    """

    def __init__(
        self,
        mha: MultiHeadAttention,
        group: dist.ProcessGroup | None = None,
        *,
        layout: str = "zigzag",
        timeout: float | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(mha, MultiHeadAttention):
            raise TypeError(f"mha must be a qkv.MultiHeadAttention, got {type(mha).__name__}")
        if mha.kdim != mha.d_model or mha.vdim != mha.d_model:
            raise ValueError(
                f"context parallelism is for self-attention: kdim={mha.kdim}, vdim={mha.vdim} "
                f"must equal d_model={mha.d_model}"
            )
        if mha.dropout > 0:
            raise ValueError(f"ring attention has no attention dropout; got dropout={mha.dropout}")
        if isinstance(mha.position, ALiBi):
            raise ValueError("ALiBi is not supported context-parallel (use RoPE or none)")
        self.d_model, self.n_heads, self.n_kv_heads = mha.d_model, mha.n_heads, mha.n_kv_heads
        self.d_k, self.kdim, self.vdim, self.dropout = mha.d_k, mha.kdim, mha.vdim, 0.0
        self.w_q, self.w_k, self.w_v, self.w_o = mha.w_q, mha.w_k, mha.w_v, mha.w_o
        self.position = mha.position
        self.group, self.layout, self.timeout = group, layout, timeout

    split_heads = MultiHeadAttention.split_heads
    merge_heads = staticmethod(MultiHeadAttention.merge_heads)

    def _rotate(self, x: Tensor, segs: list[tuple[int, int]]) -> Tensor:
        """RoPE on ``x (B, h, T_local, d_k)`` by each run's global start position."""
        parts, off = [], 0
        for start, n in segs:
            parts.append(self.position.rotate(x[:, :, off : off + n], start))
            off += n
        return torch.cat(parts, dim=2)  # (B, h, T_local, d_k)

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        causal: bool = False,
        window: int | None = None,
        **unsupported,
    ) -> Tensor:
        if context is not None:
            raise ValueError("ContextParallelAttention is self-attention only: got context=")
        given = [k for k, v in unsupported.items() if v is not None and v is not False]
        if given:
            raise ValueError(f"ContextParallelAttention does not support {given}")
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be (B, T_local, {self.d_model}), got {tuple(x.shape)}")
        ring = _make_ring(x.shape[1], self.group, self.layout, None, None)  # global length
        q = self.split_heads(self.w_q(x), self.n_heads)  # (B, h, T_local, d_k)
        k = self.split_heads(self.w_k(x), self.n_kv_heads)  # (B, h_kv, T_local, d_k)
        v = self.split_heads(self.w_v(x), self.n_kv_heads)  # (B, h_kv, T_local, d_k)
        if isinstance(self.position, RotaryEmbedding):
            segs = ring.segs(ring.rank)
            q, k = self._rotate(q, segs), self._rotate(k, segs)
        out = ring_attention(
            q,
            k,
            v,
            group=self.group,
            causal=causal,
            window=window,
            layout=self.layout,
            timeout=self.timeout,
            seq_len=ring.T,
        )  # fmt: skip  (B, h, T_local, d_k)
        return self.w_o(self.merge_heads(out))  # (B, T_local, d_model)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_heads={self.n_heads}, layout={self.layout!r}"


def make_context_parallel(
    model: nn.Module,
    group: dist.ProcessGroup | None = None,
    *,
    layout: str = "zigzag",
    timeout: float | None = None,
) -> nn.Module:
    """Swap every :class:`~qkv.MultiHeadAttention` in ``model`` (in place) for its ring version.

    Parameter names and ``state_dict`` keys stay the same. Returns ``model``.
    """
    if isinstance(model, MultiHeadAttention):
        return ContextParallelAttention(model, group, layout=layout, timeout=timeout)
    for name, child in list(model.named_children()):
        if isinstance(child, MultiHeadAttention):
            setattr(
                model, name, ContextParallelAttention(child, group, layout=layout, timeout=timeout)
            )
        else:
            make_context_parallel(child, group, layout=layout, timeout=timeout)
    return model
