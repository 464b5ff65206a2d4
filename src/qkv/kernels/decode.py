"""Decode attention: a few queries (``Tq`` = 1..16) over a long KV cache, at memory speed.

When a model generates, each step's queries attend over every cached key; the step reads K
and V once and does little arithmetic per byte, so its limit is the machine's read
bandwidth. :func:`decode_attention` runs the fused C++ kernel ``qkv/csrc/decode_cpu.cpp``
(flash-decoding: the keys of all kv heads are split across the threads, each keeps a
running max/sum/partial output per query row, and one log-sum-exp merge combines them):

- K and V are read once, in their stored dtype (fp32, bf16, or an int8 cache's packed rows
  of :func:`qkv.cache.quantize_rows`, scales applied to the scores and to the weights;
  sums in fp32);
- grouped-query heads are never repeated: the ``G`` query heads of one kv head and their
  ``Tq`` queries form one ``(G·Tq, d)`` matrix that reads its kv head once;
- ``k``/``v`` may be any strided view whose last dim is contiguous, such as a slice
  ``cache[:, :, :T]`` of a preallocated ``(B, h_kv, T_max, d)`` buffer: no copy is made;
- ``causal``/``window`` (queries aligned bottom-right: query ``i`` sits at key position
  ``Tk - Tq + i``), a bool ``mask`` (True = may attend; broadcast views read in place, e.g. a
  key-padding mask ``(B, 1, 1, Tk)``), any ``scale``; the log-sum-exp comes back too.

Inference only (no backward), CPU fp32/bf16, no bias/soft-cap/dropout:
:func:`decode_rejects` says why a call cannot run here. ``backend="auto"`` of
:func:`qkv.functional.scaled_dot_product_attention` picks this kernel for inference calls
with ``Tq <= 16`` (see :mod:`qkv.dispatch`), ``backend="decode"`` asks for it.
Speed: ``python bench/decode_attention.py`` (docs/kernels.md).

>>> q = torch.randn(1, 8, 1, 64)  # (B, h, Tq, d): one new token
>>> cache = torch.randn(2, 1, 2, 4096, 64)  # K and V buffers (B, h_kv, T_max, d)
>>> k, v = cache[0, :, :, :1000], cache[1, :, :, :1000]  # the 1000 filled positions
>>> decode_attention(q, k, v).shape
torch.Size([1, 8, 1, 64])
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from qkv._validate import AttentionShape, check_mask, check_options, check_qkv
from qkv.kernels._native import decode_ops, native_module, native_status
from qkv.kernels._settings import check_decode
from qkv.kernels.flash import _mask_view, reference_attention

__all__ = [
    "MAX_TQ", "as_unpacked", "decode_attention", "decode_rejects", "prepared_call", "run_decode"
]

MAX_TQ = 16  # "auto" picks the decode kernel up to this many queries (bench/decode_attention.py)
_FP32_MAX = float(torch.finfo(torch.float32).max)


def decode_rejects(
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    grad: bool = False,
    has_bias: bool = False,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> str | None:
    """Why the decode kernel cannot run a call (``None``: it can).

    It covers CPU fp32/bf16 inference with causal/window structure and bool masks.
    """
    kind = device if isinstance(device, str) else device.type
    if kind != "cpu":
        return f"device {torch.device(device).type}: the decode kernel is CPU-only"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype}: the decode kernel takes float32/bfloat16"
    if grad:
        return "gradients needed: the decode kernel is inference-only (no backward)"
    for name, present in (("bias", has_bias), ("softcap", softcap is not None)):
        if present:
            return f"{name} given: the decode kernel takes causal/window structure and bool masks"
    if dropout_p > 0:
        return f"dropout_p={dropout_p} > 0: the decode kernel has no dropout"
    if scale is not None and not 0 < scale < _FP32_MAX:
        return f"scale={scale} is not a positive fp32 number"
    if decode_ops() is None:
        return f"fused kernels {native_status()}"
    return None


# an int8 row as the kernel reads it (qkv.cache.quantize_rows writes it): d int8 values, then
# their fp32 scale in 4 bytes
SCALE_BYTES = 4


def row_scales(packed: Tensor) -> Tensor:
    """The fp32 scales ``(..., 1)`` of packed int8 rows ``(..., d + 4)``: a view where the
    rows' layout allows it (``d`` a multiple of 4), else a copy."""
    tail = packed[..., -SCALE_BYTES:]
    try:
        return tail.view(torch.float32)
    except RuntimeError:  # d not a multiple of 4: a copy (contiguous() may be the same tensor)
        return tail.clone(memory_format=torch.contiguous_format).view(torch.float32)


def dequantize_rows(packed: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Packed int8 rows ``(..., d + 4)`` (:func:`qkv.cache.quantize_rows`) → ``(..., d)`` in
    ``dtype``."""
    if packed.dtype != torch.int8 or packed.shape[-1] < SCALE_BYTES:
        raise ValueError(f"packed must be int8 rows (..., d + {SCALE_BYTES}), got "
                         f"{packed.dtype} {tuple(packed.shape)}")  # fmt: skip
    return (packed[..., :-SCALE_BYTES].float() * row_scales(packed)).to(dtype)


def as_unpacked(t: Tensor, like: Tensor) -> Tensor:
    """``t`` as the attention call sees it: an int8 cache's packed rows ``(..., d + 4)``
    become a stand-in ``(..., d)`` in ``like``'s dtype (a broadcast zero: metadata only, for
    shape checks and dispatch); any other tensor is returned as it is."""
    if t.dtype != torch.int8:
        return t
    return like.new_zeros(()).expand(*t.shape[:-1], t.shape[-1] - SCALE_BYTES)


def _mask_arg(mask: Tensor | None, shape: AttentionShape) -> Tensor | None:
    """The mask as the kernel reads it: a bool view ``(Nb, h_kv, G, Tq, Tk)``, unit key stride."""
    if mask is None:
        return None
    if mask.shape[-1] == 1 and shape.Tk > 1:  # broadcast over the keys: spelt out (small)
        mask = mask.expand(*mask.shape[:-1], shape.Tk).contiguous()
    return _mask_view(mask, shape)


def decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    window: int | None = None,
    scale: float | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of a few queries over a KV cache, on the decode kernel.

    Args:
        q: ``(..., h, Tq, d_k)``, fp32 or bf16 (any ``Tq`` works; it is fastest up to 16).
        k: ``(..., h_kv, Tk, d_k)``, ``h % h_kv == 0``; any strides, last dim contiguous
            (else it is copied once). In q's dtype, or an int8 cache's packed rows
            ``(..., h_kv, Tk, d_k + 4)`` (:func:`qkv.cache.quantize_rows`).
        v: ``(..., h_kv, Tk, d_v)``, as ``k`` (int8 when ``k`` is).
        mask: bool, **True = may attend**, ``(Tq, Tk)`` or ``(..., h|1, Tq|1, Tk|1)``.
        causal, window, scale: as :func:`qkv.functional.scaled_dot_product_attention`
            (query ``i`` sits at key position ``Tk - Tq + i``).
        return_lse: also return the log-sum-exp ``(..., h, Tq)`` (fp32; ``-inf`` for a row
            with no visible key).

    Returns:
        ``out (..., h, Tq, d_v)`` in q's dtype, or ``(out, lse)``. Rows with no visible
        key are zeros. NaN and inf follow the rule of :mod:`qkv._nonfinite`
        (docs/errors.md), as every backend of
        :func:`qkv.functional.scaled_dot_product_attention`: a call whose non-finite value
        sits at a key some rows see and others do not runs the reference math instead.

    Raises:
        ValueError: the call is one the kernel does not run (:func:`decode_rejects`), or
            its arguments are malformed.
    """
    if (k.dtype == torch.int8) != (v.dtype == torch.int8):
        raise TypeError(f"k and v must both be int8 rows or neither, got {k.dtype}, {v.dtype}")
    shape = check_qkv(q, as_unpacked(k, q), as_unpacked(v, q))
    check_options(window=window, scale=scale, softcap=None, dropout_p=0.0, dtype=q.dtype)
    check_mask(mask, shape, q.device)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    why = decode_rejects(q.device, q.dtype, grad=grad, scale=scale)
    if why is not None:
        raise ValueError(f"decode_attention cannot run this call: {why}")
    from qkv._nonfinite import values_for_kernel  # (it imports this module)

    v, exact = values_for_kernel(v, mask=mask, bias=None, causal=causal, window=window,
                                 Tq=shape.Tq)  # fmt: skip
    if exact:
        out, lse = run_decode(q, k, v, shape, mask=mask, causal=causal, window=window,
                              scale=scale)  # fmt: skip
    else:  # only the reference keeps such a value out of the rows that may not see it
        if k.dtype == torch.int8:
            k, v = dequantize_rows(k, q.dtype), dequantize_rows(v, q.dtype)
        out, lse = reference_attention(
            q, k, v, shape, mask=mask, bias=None, causal=causal, window=window, scale=scale,
            softcap=None, alibi_slopes=None, rel_bias=None,
        )  # fmt: skip
    return (out, lse) if return_lse else out


def prepared_call(
    shape: AttentionShape, *, causal: bool, window: int | None, scale: float | None, four: bool
) -> Callable[[Tensor, Tensor, Tensor, Tensor | None, Tensor | None], Tensor] | None:
    """:func:`run_decode`'s output for every call of this signature, worked out once:
    ``run(q, k, v, mask, bias) -> out`` for arguments already checked (the dispatcher's), a
    direct call into the extension's module (no operator schema to parse: a few µs of a
    short decode step). ``None`` where :func:`run_decode` takes another route (empty inputs,
    tensors other than 4-D: ``four``)."""
    module = native_module()
    if module is None or shape.empty or not four:
        return None
    scale = 1.0 / math.sqrt(shape.d_k) if scale is None else float(scale)
    window_arg = -1 if window is None else window
    decode, causal = module.decode, bool(causal)
    ops = decode_ops()

    def run(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None) -> Tensor:
        check_decode(k.dtype, ops)  # the kernel's QKV_DECODE_* setting for this cache
        m = None if mask is None else _mask_arg(mask, shape)
        return decode(q, k, v, m, scale, causal, window_arg)

    return run


def run_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    shape: AttentionShape,
    *,
    mask: Tensor | None,
    causal: bool,
    window: int | None,
    scale: float | None,
    splits: int = 0,
) -> tuple[Tensor, Tensor]:
    """:func:`decode_attention` on arguments already checked (the dispatcher's entry).

    ``splits > 0`` cuts the keys into that many pieces merged by log-sum-exp (default: one
    per thread, fewer for small calls); the tests use it to check the merge on small inputs.
    """
    scale = 1.0 / math.sqrt(shape.d_k) if scale is None else float(scale)
    out_shape = (*shape.batch, shape.h, shape.Tq)
    if shape.empty:  # no score to compute: zeros, lse = -inf (as every backend)
        out = q.new_zeros(*out_shape, shape.d_v)
        return out, torch.full(out_shape, float("-inf"), device=q.device)
    four = q.dim() == 4  # (B, h, T, d): passed as they are (the common case, per step)
    q4 = q if four else q.reshape(-1, shape.h, shape.Tq, shape.d_k)  # (Nb, h, Tq, d_k)
    # (Nb, h_kv, Tk, d_k), (Nb, h_kv, Tk, d_v); int8 rows 4 bytes longer
    k4 = k if four else k.reshape(-1, shape.h_kv, shape.Tk, k.shape[-1])
    v4 = v if four else v.reshape(-1, shape.h_kv, shape.Tk, v.shape[-1])
    if k4.stride(-1) != 1:
        k4 = k4.contiguous()
    if v4.stride(-1) != 1:
        v4 = v4.contiguous()
    window_arg = -1 if window is None else window
    mask5 = _mask_arg(mask, shape)
    check_decode(k4.dtype, decode_ops())  # the kernel's QKV_DECODE_* setting for this cache
    out, lse = decode_ops().fwd(
        q4.contiguous(), k4, v4, mask5, scale, bool(causal), window_arg, splits
    )
    if four:
        return out, lse
    return out.view(*out_shape, shape.d_v), lse.view(out_shape)
