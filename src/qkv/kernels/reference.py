"""The reference attention's softmax and values product, shared by
:func:`qkv.functional.attention_steps` and the kernels' own entry points.

Both follow the NaN/inf rule of :mod:`qkv._nonfinite` exactly: :func:`safe_softmax` gives an
all ``-inf`` row zero weights (not NaN), and :func:`weights_times_values` keeps values at keys
a row may not see out of its output, even a NaN there. :func:`dense_attention` puts them
together for calls a fused kernel cannot run under that rule (a NaN value at a key that some
rows see and others do not).
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.kernels._native import native_module

__all__ = ["checked", "dense_attention", "finite", "safe_softmax", "weights_times_values"]


def checked(x: Tensor) -> bool:
    """Whether NaN and inf are looked for in ``x`` (not on CUDA: each look would wait)."""
    return x.device.type != "cuda"


def finite(x: Tensor, y: Tensor | None = None) -> bool:
    """Whether ``x`` (and ``y``) hold no NaN or inf: the kernels' ``finite`` (one pass in C++,
    a bits test on contiguous tensors), else one ``isfinite`` per tensor."""
    module = native_module() if x.is_cpu and (y is None or y.is_cpu) else None
    if module is not None:
        return module.finite(x, y, None, None)
    return all(bool(torch.isfinite(t).all()) for t in (x, y) if t is not None and t.numel())


def safe_softmax(masked: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax over the last dim that gives zeros (not NaN) for an all ``-inf`` row.

    Returns ``(weights, lse)``. Computed in float32 at least, for bf16/fp16 inputs.
    """
    x = masked.float() if masked.dtype in (torch.float16, torch.bfloat16) else masked
    if x.shape[-1] == 0:  # Tk = 0: no key at all; exp keeps the graph (zero gradients)
        return x.exp(), x.new_full(x.shape[:-1], float("-inf"))
    row_max = x.amax(dim=-1, keepdim=True).detach()  # (..., Tq, 1)
    row_max = row_max.masked_fill(row_max == float("-inf"), 0.0)  # empty row: any finite shift
    e = torch.exp(x - row_max)  # exp(-inf) = 0, so masked keys contribute nothing
    denom = e.sum(dim=-1, keepdim=True)
    empty = denom == 0
    weights = e / denom.masked_fill(empty, 1.0)  # an empty row stays all zeros
    lse = (torch.log(denom) + row_max).squeeze(-1)  # -inf for an empty row
    return weights, lse


def weights_times_values(
    weights: Tensor,
    v: Tensor,
    mask: Tensor | None,
    bias: Tensor | None,
    lse: Tensor | None = None,
) -> Tensor:
    """``weights @ v`` where keys a row may not see (``mask`` False, or a ``-inf`` bias) take
    no part, even with a NaN or inf value there; at keys it may see, IEEE's ``w · x``. Rows
    whose ``lse`` is ``-inf`` (every logit ``-inf``) are zeros whatever the values.

    ``weights`` ``(..., Tq, Tk)``, ``v`` ``(..., Tk, d_v)``, ``mask`` and ``bias``
    broadcastable to ``weights`` or None, ``lse`` ``(..., Tq)`` or None. The usual case
    (finite values) is one matmul.
    """
    if not checked(v) or finite(v):
        return weights @ v
    out = _times_nonfinite(weights, v, mask, bias)
    if lse is None:
        return out
    return out.masked_fill((lse == float("-inf")).unsqueeze(-1), 0.0)


def _times_nonfinite(
    weights: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None
) -> Tensor:
    if mask is None and bias is None:
        return weights @ v
    out = weights @ v.masked_fill(~torch.isfinite(v), 0.0)  # the finite part
    seen = torch.ones_like(weights, dtype=torch.bool)
    if mask is not None:
        seen = seen & mask
    if bias is not None:
        seen = seen & ~bias.isneginf()

    # which non-finite values each output element meets, as counts of (row may see, kind)
    def meets(rows: Tensor, kind: Tensor) -> Tensor:
        return (rows.to(out.dtype) @ kind.to(out.dtype)) > 0

    positive = seen & (weights > 0)
    nan = meets(seen, v.isnan()) | meets(seen & (weights == 0), v.isinf())  # 0·inf
    pinf, ninf = meets(positive, v.isposinf()), meets(positive, v.isneginf())
    out = out.masked_fill(pinf, float("inf")).masked_fill(ninf, float("-inf"))
    return out.masked_fill(nan | (pinf & ninf), float("nan"))


def dense_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None,
    bias: Tensor | None,
    scale: float,
    softcap: float | None,
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of the reference math on dense arguments: ``mask`` (True = may attend,
    any structure already in it) and ``bias`` broadcastable to the scores ``(..., h, Tq,
    Tk)``; grouped kv heads repeated. Scores in fp32 for bf16/fp16 inputs; ``lse`` fp32 (fp64
    for fp64 inputs)."""
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = (t.repeat_interleave(group, dim=-3) for t in (k, v))  # (..., h, Tk, d)
    wide = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    x = (q.to(wide) @ k.to(wide).transpose(-2, -1)) * scale  # (..., h, Tq, Tk)
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    if bias is not None:  # a -inf bias masks its key, even where the score is +inf
        x = torch.where(bias == float("-inf"), bias.to(x.dtype), x + bias)
    if mask is not None:
        x = x.masked_fill(~mask, float("-inf"))
    weights, lse = safe_softmax(x)
    out = weights_times_values(weights, v.to(wide), mask, bias, lse).to(q.dtype)
    return out, lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
