"""Packed variable-length sequences: several sequences concatenated in one row, no padding.

As FlashAttention's ``flash_attn_varlen_func``: tokens of all sequences are stacked along
the first dim and ``cu_seqlens`` (cumulative lengths, starting at 0) says where each one
starts. Attention is block-diagonal: a token sees only its own sequence. The blocks outside
the diagonal are never computed: each sequence is one attention call (sequences that all
have the same length run as one batched call), on the ``backend`` that
:func:`qkv.functional.scaled_dot_product_attention` picks (``"flash"`` when the log-sum-exp
is asked for).

Shapes::

    q            (total_q, h,    d_k)
    k            (total_k, h_kv, d_k)
    v            (total_k, h_kv, d_v)
    cu_seqlens   (n_seq + 1,) int, cu_seqlens[0] = 0, cu_seqlens[-1] = total
    output       (total_q, h, d_v)
    lse          (h, total_q)
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv import functional
from qkv.kernels.flash import flash_attention

__all__ = ["packed_mask", "varlen_attention"]


def _lengths(cu: Tensor | list[int], total: int, name: str) -> list[int]:
    cu_list = [int(x) for x in torch.as_tensor(cu).tolist()]
    if len(cu_list) < 2 or cu_list[0] != 0 or cu_list[-1] != total:
        raise ValueError(
            f"{name} must start at 0 and end at the number of tokens ({total}), got {cu_list}"
        )
    lengths = [b - a for a, b in zip(cu_list, cu_list[1:])]
    if min(lengths) < 0:
        raise ValueError(f"{name} must be non-decreasing, got {cu_list}")
    return cu_list


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor | list[int],
    cu_seqlens_k: Tensor | list[int] | None = None,
    *,
    causal: bool = False,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention within each packed sequence (block-diagonal), differentiable.

    Args:
        q, k, v: packed ``(total, heads, d)`` (see the module docstring).
        cu_seqlens_q: cumulative query lengths ``[0, L0, L0+L1, ...]``.
        cu_seqlens_k: cumulative key lengths (default: ``cu_seqlens_q``).
        causal, window, scale, softcap: per sequence, as in
            :func:`qkv.functional.scaled_dot_product_attention` (causal is bottom-right within
            each sequence when its query and key lengths differ).
        return_lse: also return the log-sum-exp ``(h, total_q)`` (runs on ``"flash"``).
        block_q, block_k: flash tile sizes (setting them selects ``"flash"``).
        backend: per-sequence path, as in :func:`qkv.functional.scaled_dot_product_attention`.

    >>> q = k = v = torch.randn(7, 2, 16)  # two sequences: 3 and 4 tokens
    >>> varlen_attention(q, k, v, [0, 3, 7], causal=True).shape
    torch.Size([7, 2, 16])
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 3:
            raise ValueError(
                f"{name} must be packed (total, heads, d), got {getattr(t, 'shape', t)}"
            )
    cq = _lengths(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    ck = cq if cu_seqlens_k is None else _lengths(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    if len(cq) != len(ck):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe as many sequences, got "
            f"{len(cq) - 1} and {len(ck) - 1}"
        )
    use_flash = return_lse or block_q is not None or block_k is not None or backend == "flash"
    if use_flash and backend not in ("auto", "flash"):
        raise ValueError(f"return_lse/block sizes need backend 'flash' or 'auto', got {backend!r}")
    opts = dict(causal=causal, window=window, scale=scale, softcap=softcap)

    def attend(qi: Tensor, ki: Tensor, vi: Tensor) -> tuple[Tensor, Tensor | None]:
        if use_flash:
            return flash_attention(
                qi, ki, vi, **opts, return_lse=True, block_q=block_q, block_k=block_k
            )
        return functional.scaled_dot_product_attention(qi, ki, vi, **opts, backend=backend), None

    qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))  # (heads, total, d)
    len_q = {b - a for a, b in zip(cq, cq[1:])}
    len_k = {b - a for a, b in zip(ck, ck[1:])}
    n = len(cq) - 1
    if len(len_q) == 1 and len(len_k) == 1:  # equal lengths: one batched call
        Lq, Lk = len_q.pop(), len_k.pop()
        qb = qh.unflatten(1, (n, Lq)).transpose(0, 1)  # (n, h, Lq, d_k)
        kb = kh.unflatten(1, (n, Lk)).transpose(0, 1)  # (n, h_kv, Lk, d_k)
        vb = vh.unflatten(1, (n, Lk)).transpose(0, 1)  # (n, h_kv, Lk, d_v)
        out, lse = attend(qb, kb, vb)  # (n, h, Lq, d_v), (n, h, Lq)
        out = out.transpose(0, 1).flatten(1, 2)  # (h, total_q, d_v)
        lse = None if lse is None else lse.transpose(0, 1).flatten(1, 2)  # (h, total_q)
    else:
        outs, lses = [], []
        for i in range(n):
            qi, ki, vi = (
                qh[:, cq[i] : cq[i + 1]],
                kh[:, ck[i] : ck[i + 1]],
                vh[:, ck[i] : ck[i + 1]],
            )
            # an empty sequence (Lq_i or Lk_i = 0) gives zeros and lse -inf, as every backend
            o, l = attend(qi, ki, vi)  # noqa: E741 (h, Lq_i, d_v), (h, Lq_i)
            outs.append(o)
            lses.append(l)
        out = torch.cat(outs, dim=1)
        lse = torch.cat(lses, dim=1) if use_flash else None
    out = out.transpose(0, 1)  # (total_q, h, d_v)
    return (out, lse) if return_lse else out


def packed_mask(
    cu_seqlens_q: Tensor | list[int],
    cu_seqlens_k: Tensor | list[int] | None = None,
    *,
    causal: bool = False,
    device: torch.device | str | None = None,
) -> Tensor:
    """The dense block-diagonal ``(total_q, total_k)`` mask of a packing (True = may attend).

    What :func:`varlen_attention` computes without building it; for references and for
    libraries that need a dense mask (O(total²) memory).
    """
    cq = [int(x) for x in torch.as_tensor(cu_seqlens_q).tolist()]
    ck = cq if cu_seqlens_k is None else [int(x) for x in torch.as_tensor(cu_seqlens_k).tolist()]
    seq_q = torch.repeat_interleave(torch.arange(len(cq) - 1), torch.tensor(cq).diff())
    seq_k = torch.repeat_interleave(torch.arange(len(ck) - 1), torch.tensor(ck).diff())
    allowed = seq_q[:, None] == seq_k[None, :]  # (total_q, total_k)
    if causal:  # bottom-right within each sequence: key offset <= query offset + (Lk - Lq)
        start_q, start_k = torch.tensor(cq[:-1]), torch.tensor(ck[:-1])
        len_q, len_k = torch.tensor(cq).diff(), torch.tensor(ck).diff()
        pos_q = torch.arange(cq[-1]) - start_q[seq_q] + (len_k - len_q)[seq_q]  # on key axis
        pos_k = torch.arange(ck[-1]) - start_k[seq_k]
        allowed &= pos_k[None, :] <= pos_q[:, None]
    return allowed.to(device)
