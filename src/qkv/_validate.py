"""Argument checks shared by every attention path.

Each check raises a ``ValueError``/``TypeError`` that names the argument and shows the
expected and the actual shape or dtype. Nothing is broadcast silently: a mask or bias must
be 2-D ``(Tq, Tk)`` or have exactly as many dims as the scores ``(..., h, Tq, Tk)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class AttentionShape:
    """Sizes of one attention call: ``batch`` is the leading ``...`` of q."""

    batch: tuple[int, ...]
    h: int
    h_kv: int
    Tq: int
    Tk: int
    d_k: int
    d_v: int

    @property
    def scores(self) -> tuple[int, ...]:
        return (*self.batch, self.h, self.Tq, self.Tk)

    @property
    def group(self) -> int:
        return self.h // self.h_kv if self.h_kv else 1  # h = h_kv = 0: no heads at all

    @property
    def empty(self) -> bool:
        """No score to compute: a zero batch dim, ``h``, ``Tq`` or ``Tk``.

        Every backend then returns the same: an output of zeros (empty unless only
        ``Tk = 0``: each query sees no key, so its row is zero), log-sum-exp ``-inf``, and
        zero gradients. ``d_k = 0`` is an error (:func:`check_qkv`).
        """
        return 0 in (*self.batch, self.h, self.Tq, self.Tk)


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> AttentionShape:
    """Check q ``(..., h, Tq, d_k)``, k ``(..., h_kv, Tk, d_k)``, v ``(..., h_kv, Tk, d_v)``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if q.dim() < 3:
        raise ValueError(
            f"q must have shape (..., h, Tq, d_k) with at least 3 dims, got {_shape(q)}; "
            "add a head dim with q.unsqueeze(0)"
        )
    for name, t in (("k", k), ("v", v)):
        if t.dim() != q.dim():
            raise ValueError(
                f"{name} must have as many dims as q ({q.dim()}: (..., h_kv, Tk, d)), "
                f"got {name}.shape={_shape(t)}"
            )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(
            f"q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}"
        )
    batch = _shape(q)[:-3]
    if _shape(k)[:-3] != batch or _shape(v)[:-3] != batch:
        raise ValueError(
            f"q, k, v must share leading dims {batch}, got k={_shape(k)[:-3]}, v={_shape(v)[:-3]}"
        )
    h, Tq, d_k = q.shape[-3:]
    h_kv, Tk, d_k2 = k.shape[-3:]
    if d_k2 != d_k:
        raise ValueError(
            f"k's head dim must equal q's: expected d_k={d_k}, got k.shape={_shape(k)}"
        )
    if v.shape[-3] != h_kv or v.shape[-2] != Tk:
        raise ValueError(
            f"v must be (..., h_kv={h_kv}, Tk={Tk}, d_v) to match k, got v.shape={_shape(v)}"
        )
    if d_k == 0:
        raise ValueError(
            f"q and k need a head dim d_k >= 1 (the scores q·kᵀ are sums over it), "
            f"got q.shape={_shape(q)}, k.shape={_shape(k)}"
        )
    if (h_kv == 0 and h != 0) or (h_kv != 0 and h % h_kv != 0):
        raise ValueError(
            f"q's heads must be a multiple of k/v's heads (grouped-query attention): "
            f"h={h}, h_kv={h_kv}, h % h_kv = {h % h_kv if h_kv else 'undefined'}"
        )
    return AttentionShape(batch, h, h_kv, Tq, Tk, d_k, v.shape[-1])


def check_broadcast(name: str, t: Tensor, target: tuple[int, ...]) -> None:
    """``t`` must be 2-D ``(Tq, Tk)`` or as many dims as ``target``, each 1 or equal."""
    if t.dim() != 2 and t.dim() != len(target):
        hint = " (for a key-padding mask use qkv.masks.padding(...), shape (B, 1, 1, Tk))"
        raise ValueError(
            f"{name} must be 2-D (Tq, Tk)={target[-2:]} or {len(target)}-D broadcastable to "
            f"{target}, got shape {_shape(t)}{hint if name == 'mask' else ''}"
        )
    tail = target[-t.dim() :]
    for size, want in zip(t.shape, tail):
        if size not in (1, want):
            raise ValueError(f"{name} of shape {_shape(t)} does not broadcast to {target}")


def check_mask(mask: Tensor | None, shape: AttentionShape, device: torch.device) -> None:
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a bool tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(
            f"mask must be bool (True = may attend), got dtype {mask.dtype}; "
            "pass additive float masks as bias="
        )
    if mask.device != device:
        raise ValueError(f"mask must be on {device}, got {mask.device}")
    check_broadcast("mask", mask, shape.scores)


def check_bias(bias: Tensor | None, shape: AttentionShape, device: torch.device) -> None:
    if bias is None:
        return
    if not isinstance(bias, Tensor) or not bias.dtype.is_floating_point:
        raise TypeError(
            "bias must be a floating-point tensor added to the scaled scores, got "
            f"{getattr(bias, 'dtype', type(bias).__name__)}"
        )
    if bias.device != device:
        raise ValueError(f"bias must be on {device}, got {bias.device}")
    check_broadcast("bias", bias, shape.scores)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_options(
    *,
    window: int | None,
    scale: float | None,
    softcap: float | None,
    dropout_p: float,
    dtype: torch.dtype | None = None,
) -> None:
    """The options' values; ``dtype`` (the inputs') bounds ``scale`` and ``softcap`` by the
    range of the scores' dtype (float32 for every input but float64), where every backend
    computes them: beyond it they round to 0 or inf and the answer would be NaN."""
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"window must be an int >= 1 or None, got {window!r}")
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    lo, hi = torch.finfo(wide).tiny, torch.finfo(wide).max
    for name, x in (("scale", scale), ("softcap", softcap)):
        if x is None:
            continue
        if not 0 < x < math.inf:
            raise ValueError(f"{name} must be a finite number > 0 or None, got {x!r}")
        if dtype is not None and not lo <= x <= hi:
            raise ValueError(
                f"{name}={x!r} is outside what {_dtype_name(wide)} holds ({lo:.3g} to "
                f"{hi:.3g}), the dtype the scores of {_dtype_name(dtype)} inputs are computed in"
            )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")


def check_heads(heads, h: int, name: str = "weights_heads") -> tuple[int, ...] | None:
    """Query-head indices: ints in ``[0, h)`` (``None`` passes through)."""
    if heads is None:
        return None
    ok = not isinstance(heads, (str, bytes)) and hasattr(heads, "__iter__")
    items = list(heads.tolist() if isinstance(heads, Tensor) else heads) if ok else []
    if not ok or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < h for i in items
    ):
        raise ValueError(f"{name} must be a list of query-head indices in [0, {h}), got {heads!r}")
    return tuple(items)


def check_block_mask(bm, shape: AttentionShape, device: torch.device) -> None:
    """A :class:`qkv.masks.BlockMask` must cover exactly these scores: ``(B|1, H|1, Tq, Tk)``."""
    b, h = bm.index.shape[:2]
    batch = math.prod(shape.batch)
    if (bm.Tq, bm.Tk) != (shape.Tq, shape.Tk) or h not in (1, shape.h) or b not in (1, batch):
        raise ValueError(
            f"mask: BlockMask for B={bm.B}, H={bm.H}, Tq={bm.Tq}, Tk={bm.Tk} does not fit "
            f"scores {shape.scores} (B: 1 or {batch}, H: 1 or {shape.h}, Tq={shape.Tq}, "
            f"Tk={shape.Tk})"
        )
    if bm.index.device != device:
        raise ValueError(f"mask: BlockMask must be on {device}, got {bm.index.device}")


def check_per_head(
    alibi_slopes: Tensor | None, rel_bias: Tensor | None, shape: AttentionShape,
    device: torch.device,
) -> None:  # fmt: skip
    """ALiBi slopes ``(h,)`` and a relative table ``(h, Tq + Tk - 1)``: floating, on device."""
    want = {"alibi_slopes": (shape.h,), "rel_bias": (shape.h, shape.Tq + shape.Tk - 1)}
    for name, t in (("alibi_slopes", alibi_slopes), ("rel_bias", rel_bias)):
        if t is None:
            continue
        if not isinstance(t, Tensor) or not t.dtype.is_floating_point:
            got = getattr(t, "dtype", type(t).__name__)
            raise TypeError(f"{name} must be a floating-point tensor, got {got}")
        if tuple(t.shape) != want[name]:
            raise ValueError(f"{name} must have shape {want[name]}, got {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} must be on {device}, got {t.device}")
