"""qkv's options as arguments of PyTorch's ``scaled_dot_product_attention`` (the "torch"
backend): its bool ``attn_mask`` is also True = may attend; its ``is_causal`` is top-left
aligned, ours bottom-right, so it is passed only where the two agree.

Grouped-query calls with few queries (decoding: ``Tq <= ROWS_MAX_TQ``) run on the grouped-rows
layout: the ``G`` query heads of one kv head as ``G·Tq`` query rows of one head (q viewed as
``(..., h_kv, G·Tq, d)``, no copy), with a mask that is the same for every query head. PyTorch's
``enable_gqa`` repeats K and V per query head first: on the CPUs measured here the rows layout
read the cache 1.6-2.8× faster (`bench/results/decode_attention_zen3_avx2.md`, "torch gqa" vs
"torch rows").
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as TF
from torch import Tensor

from qkv import masks
from qkv._nonfinite import _tracked
from qkv.dispatch.case import Case


def _passes_through(Tq: int, Tk: int, causal: bool, window, has_mask: bool, has_bias: bool):
    """``is_causal`` for torch SDPA when our options need no mask built (else ``None``).

    ``is_causal`` is used only when it means the same (``Tq == Tk``, no other mask); its
    top-left alignment differs from ours when ``Tq != Tk``, so then an explicit bottom-right
    mask is built (one query, decoding, sees every key: no mask needed).
    """
    is_causal = causal and window is None and Tq == Tk and not has_mask and not has_bias
    if window is None and not has_bias and (is_causal or not causal or Tq == 1):
        return is_causal
    return None


ROWS_MAX_TQ = 16  # queries per call up to which a grouped-query call runs on grouped rows


def _rows_ok(Tq: int, h: int, h_kv: int, mask: object, bias: object) -> bool:
    """Whether the call can run as ``G·Tq`` rows per kv head: grouped query heads, few
    queries, no bias, and a mask (if any) without a query-head dimension (``(..., 1, Tq|1,
    Tk)`` or 2-D), the same for every query head of a group."""
    if h == h_kv or h_kv == 0 or Tq > ROWS_MAX_TQ or bias is not None:
        return False
    return mask is None or (isinstance(mask, Tensor) and (mask.dim() < 3 or mask.shape[-3] == 1))


def _as_rows(q: Tensor, h_kv: int) -> Tensor:
    """q ``(..., h, Tq, d)`` as ``(..., h_kv, G·Tq, d)``: query head ``hk·G + g`` is rows
    ``g·Tq ..`` of kv head ``hk`` (a view of a contiguous q). The output goes back with
    ``reshape``, not ``view``: SDPA may return any strides (CUDA's kernels write
    ``(B, T, h, d)`` memory), and then the rows cannot be regrouped without a copy."""
    *lead, h, Tq, d = q.shape
    return q.reshape(*lead, h_kv, h // h_kv * Tq, d)


def _rows_mask(m: Tensor | None, G: int) -> Tensor | None:
    """A mask ``(..., 1|Tq, Tk)`` over the rows layout's ``G·Tq`` rows (one per query row)."""
    if m is None or m.dim() < 2 or m.shape[-2] == 1:
        return m
    return m.unsqueeze(-3).expand(*m.shape[:-2], G, *m.shape[-2:]).flatten(-3, -2)


# a bool mask's additive form, per mask: (id, dtype) -> (the mask, its version, 0/-inf floats)
_ADDITIVE: dict[tuple[int, torch.dtype], tuple[Tensor, int, Tensor]] = {}
ADDITIVE_HELD = 8  # masks remembered (a model's layers pass the same one or two masks a step)
ADDITIVE_MAX = 1 << 20  # elements: a larger mask is converted per call (its call dwarfs that)
_ADDITIVE_LOCK = threading.Lock()


def additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool ``mask`` (True = may attend) as SDPA's float ``attn_mask`` in ``dtype``: 0 where
    True, ``-inf`` where False, the conversion SDPA itself makes of a bool mask on every call.
    Made once per mask and kept for the last :data:`ADDITIVE_HELD` masks, held and compared by
    identity and version (an in-place change bumps it; an untracked mask is converted on
    every call; so is one of over :data:`ADDITIVE_MAX` elements, not to hold its floats): a
    call with a mask seen before skips the conversion (7-25 % of a small SDPA call,
    ``bench/results/dispatch_small.md``)."""
    tracked = mask.numel() <= ADDITIVE_MAX and _tracked(mask)
    key = (id(mask), dtype)
    hit = _ADDITIVE.get(key) if tracked else None
    if hit is not None and hit[0] is mask and hit[1] == mask._version:
        return hit[2]
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf")
    )  # fmt: skip
    if tracked:
        with _ADDITIVE_LOCK:  # calls from several threads (a server's) share the cache
            while len(_ADDITIVE) >= ADDITIVE_HELD:
                _ADDITIVE.pop(next(iter(_ADDITIVE)))  # the oldest
            _ADDITIVE[key] = (mask, mask._version, out)
    return out


def _as_additive(mask: object, dtype: torch.dtype) -> object:
    return additive(mask, dtype) if isinstance(mask, Tensor) and mask.dtype == torch.bool else mask


def torch_run(case: Case, mask: object, bias: object) -> Callable[..., Tensor] | None:
    """``run(q, k, v, mask, bias)``: torch SDPA for every call of this signature, its keyword
    arguments worked out once (``None`` where a mask must be built per call). On the CPU a
    bool mask goes in as its remembered additive form (:func:`additive`): the same numbers
    SDPA would make of it, without making them again."""
    kw = _torch_kwargs(case)
    if kw is None:
        return None
    sdpa = TF.scaled_dot_product_attention
    s = case.shape
    dtype = case.dtype
    cpu_bool = (case.device == "cpu" and isinstance(mask, Tensor) and mask.dtype == torch.bool
                and dtype in _ADDITIVE_DTYPES)  # fmt: skip
    if not kw.get("is_causal") and _rows_ok(s.Tq, s.h, s.h_kv, mask, bias):
        kw.pop("enable_gqa")
        G, out = s.group, (*s.batch, s.h, s.Tq, s.d_v)
        if cpu_bool:
            return lambda q, k, v, mask, bias: sdpa(
                _as_rows(q, s.h_kv), k, v, attn_mask=_rows_mask(_as_additive(mask, dtype), G),
                **kw,
            ).reshape(out)  # fmt: skip
        return lambda q, k, v, mask, bias: sdpa(
            _as_rows(q, s.h_kv), k, v, attn_mask=_rows_mask(mask, G), **kw
        ).reshape(out)
    if cpu_bool:
        return lambda q, k, v, mask, bias: sdpa(q, k, v, attn_mask=_as_additive(mask, dtype), **kw)
    if mask is None and not kw:  # the plainest call: no keyword for SDPA to parse
        return lambda q, k, v, mask, bias: sdpa(q, k, v)
    if mask is None:
        return lambda q, k, v, mask, bias: sdpa(q, k, v, **kw)
    return lambda q, k, v, mask, bias: sdpa(q, k, v, attn_mask=mask, **kw)


# the dtypes whose bool masks SDPA's CPU kernels take as additive floats (fp64 runs its math
# path, where a bool mask is a masked_fill: left as it is)
_ADDITIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# PyTorch's fused CPU kernel, which SDPA runs for these calls (None where this torch lacks
# it: then the public SDPA runs); qkv's kernels call it from C++ with the log-sum-exp check
# (``flash_cpu_checked``): one call from Python, no torch ops on the row summary
_FLASH_CPU = getattr(torch._C._VariableFunctions, "_scaled_dot_product_flash_attention_for_cpu",
                     None)  # fmt: skip
# Up to this many keys a call's scores are one key block of that kernel (torch 2.13: 512); the
# log-sum-exp test below was checked against the reference there (tests/kernels/test_dispatch_small.py)
LSE_MAX_TK = 512
# From this many elements of q and k together the rule is checked after the call, below it
# by the look at q and k before; 0: every call. With the check in C++ (a pass over a few
# hundred row summaries) it costs less than the look (one pass over q and k: 2.7 µs at 64K
# elements) at every size (2-core Xeon, 1 thread, bench/dispatch.py --grid: median SDPA/qkv
# per level 0.85-0.91 -> 0.93-0.955; bench/results/dispatch_small.md). bench/dispatch.py
# --look-parts raises it to compare the two.
LSE_MIN_QK = 0
_LSE_DTYPES = (torch.float32, torch.bfloat16)


def lse_run(case: Case, mask: object, bias: object) -> Callable[..., Tensor | None] | None:
    """``run(q, k, v, mask, bias)`` that needs no look at q and k before it (``None`` where
    it does not apply): PyTorch's fused CPU kernel with its log-sum-exp, and the NaN/inf rule
    (:mod:`qkv._nonfinite`) checked on that ``(B, h, Tq)`` row summary instead of on q and k.

    Why it is enough (torch 2.13, one key block; the tests check it against the reference):
    a NaN or inf in q or k makes a row's lse NaN or inf, or, where every logit of the row is
    NaN (a NaN in its query), exactly 0 with a zero output, which the rule says is NaN; a
    ``-inf`` logit alone weighs 0 on both sides. So a row summary free of NaN, inf and 0
    means torch's answer is the rule's; otherwise q and k are looked at (lse 0 also comes from
    rows with no visible key), and ``run`` returns ``None`` when they hold a NaN or inf: the
    caller then runs the reference. The values a row may not see are still looked at before
    the call (:func:`qkv._nonfinite.quick_look` without q and k). Inference on the CPU, fp32
    or bf16, no bias, no dropout, no grouped heads, ``d_k == d_v``, the mask (if any) a bool
    tensor, and the causal/window options such that torch's own ``is_causal`` says them.
    """
    from qkv.kernels._native import native_module  # (loads the kernels: not at import)

    s = case.shape
    module = native_module()
    checked = getattr(module, "flash_cpu_checked", None)
    is_causal = _passes_through(s.Tq, s.Tk, case.causal, case.window, case.has_mask,
                                case.has_bias)  # fmt: skip
    if (
        _FLASH_CPU is None or checked is None or case.device != "cpu" or case.grad
        or case.dtype not in _LSE_DTYPES or case.kv_int8 or bias is not None
        or case.dropout_p or s.h != s.h_kv or s.empty or s.Tk > LSE_MAX_TK or is_causal is None
        or len(s.batch) != 1 or s.d_k != s.d_v  # (the kernel takes (B, h, T, d), one d)
        or math.prod(s.batch) * s.h * (s.Tq + s.Tk) * s.d_k < LSE_MIN_QK
        or not (mask is None or (isinstance(mask, Tensor) and mask.dtype == torch.bool))
    ):  # fmt: skip
        return None
    finite, scale, dtype = module.finite, case.scale, case.dtype
    sdpa = TF.scaled_dot_product_attention

    def run(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: None) -> Tensor | None:
        attn = None if mask is None else additive(mask, dtype)  # (it takes q's dtype only)
        got = checked(q, k, v, attn, is_causal, scale)
        if got is None:  # a last-dim stride other than 1, which the kernel cannot read: the
            # public SDPA (its math path), after the look at q and k the other calls skip
            if not finite(q, k, None, None):
                return None
            return sdpa(q, k, v, attn_mask=attn, is_causal=is_causal, scale=scale)
        if got[1] or finite(q, k, None, None):
            return got[0]
        return None  # a NaN or inf in q or k: only the reference keeps to the rule

    return run


def _torch_kwargs(case: Case) -> dict | None:
    """torch SDPA's keyword arguments (other than ``attn_mask``, the call's own mask) for a
    case that passes straight through to it (else ``None``): only those not at their default,
    since each keyword costs argument parsing on every call."""
    s = case.shape
    is_causal = _passes_through(s.Tq, s.Tk, case.causal, case.window, case.has_mask,
                                case.has_bias)  # fmt: skip
    if is_causal is None:
        return None
    kw: dict = {"is_causal": True} if is_causal else {}
    if case.scale is not None:
        kw["scale"] = case.scale
    if case.dropout_p:
        kw["dropout_p"] = case.dropout_p
    if s.h != s.h_kv:
        kw["enable_gqa"] = True
    return kw


def torch_sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None,
    bias: Tensor | None,
    causal: bool,
    window: int | None,
    scale: float | None,
    dropout_p: float,
) -> Tensor:
    """Our options as PyTorch SDPA arguments (its bool ``attn_mask`` is also True = attend)."""
    Tq, Tk = q.shape[-2], k.shape[-2]
    h, h_kv = q.shape[-3], k.shape[-3]
    gqa = h != h_kv
    is_causal = _passes_through(Tq, Tk, causal, window, mask is not None, bias is not None)
    rows = not is_causal and _rows_ok(Tq, h, h_kv, mask, bias)  # grouped rows (module docstring)
    if is_causal is not None and not rows:  # the mask as given: nothing to combine it with
        return TF.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=gqa,
        )  # fmt: skip
    structure = None
    if window is not None:
        structure = masks.sliding_window(Tq, Tk, window, causal=causal, device=q.device)
    elif causal and Tq > 1:  # (Tq != Tk, or another mask: is_causal would not mean ours)
        structure = masks.causal(Tq, Tk, device=q.device)
    allowed = masks.combine(mask, structure)
    if rows:  # (no bias there)
        out = TF.scaled_dot_product_attention(
            _as_rows(q, h_kv), k, v, attn_mask=_rows_mask(allowed, h // h_kv),
            dropout_p=dropout_p, scale=scale,
        )  # fmt: skip
        return out.reshape(*q.shape[:-1], v.shape[-1])
    if bias is None:
        attn_mask = allowed
    elif allowed is None:
        attn_mask = bias.to(q.dtype)
    else:
        attn_mask = torch.where(allowed, bias.to(q.dtype), float("-inf"))
    return TF.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa,
    )  # fmt: skip
