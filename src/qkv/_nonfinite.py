"""NaN and inf in attention inputs: one rule on every backend.

The rule, stated on the logits ``x = softcap(q kᵀ · scale) + bias`` of a query row:

- a NaN or ``+inf`` logit at a key the row may see makes the row's output (and lse) NaN;
  a NaN or inf in ``q``, ``k`` or ``bias`` gives such a logit (inf·0 and inf - inf are NaN,
  ``+inf`` is the largest logit and ``exp(inf - inf)`` its weight);
- a ``-inf`` logit gets weight 0, as a ``-inf`` in a float mask or bias always has: it is the
  only non-finite logit that leaves a row finite;
- a row whose logits are all ``-inf`` (every key masked, or ``-inf`` through an inf in ``q``
  or ``k``) is empty: zeros and lse ``-inf``, whatever its values;
- values at keys the row may see are multiplied by their weights as IEEE arithmetic does
  (an inf value gives inf; a NaN or inf value times a zero weight, underflowed or from a
  ``-inf`` logit, gives NaN);
- values at keys the row may **not** see (its mask, ``causal``/``window``, a ``-inf`` bias)
  take no part at all: a NaN left in the unused tail of a preallocated cache never reaches
  an output.

An int8 cache (:func:`qkv.cache.quantize_rows`) stores a row holding a NaN or an inf as a
row of NaN (scale NaN): its scales say where the non-finite rows are.

The reference math (:func:`qkv.functional.attention_steps`) and the fused kernels follow the
first three by construction (their row maximum looks for NaN where a max instruction drops
it). The last one needs care, since ``0 · NaN`` is NaN: :func:`values_for_kernel` zeroes the
values at keys no row may see before a kernel reads them (a cheap look at the mask first,
the values themselves only at keys some row may not see), and sends a call whose non-finite
value sits at a key that some rows see and others do not to the reference, which
:func:`weights_times_values` (:mod:`qkv.kernels.reference`) computes exactly. PyTorch's SDPA
gives zeros for a row whose logits are all NaN, so :func:`scores_may_be_nonfinite` sends
such calls to the reference too.

On CUDA these checks are skipped (each would wait for the device): there the kernels' own
IEEE behaviour applies. A NaN at a key a row sees still makes it NaN; a NaN or inf at a key it
may not see can reach it, and torch's fused CUDA kernels can turn an inf value into NaN (their
online softmax rescales it by zero; seen on an H100).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from qkv._versions import version
from qkv.block_mask import BlockMask
from qkv.kernels._native import native_module
from qkv.kernels.decode import row_scales
from qkv.kernels.reference import checked as _checked
from qkv.kernels.reference import finite as _finite
from qkv.kernels.reference import weights_times_values

__all__ = ["quick_look", "scores_may_be_nonfinite", "values_for_flash", "values_for_kernel",
           "weights_times_values"]


def _as_float_rows(v: Tensor) -> Tensor:
    """``v`` itself, or for an int8 cache's packed rows ``(..., Tk, d + 4)`` their scales
    ``(..., Tk, 1)``: finite exactly where the row is (quantize_rows)."""
    return row_scales(v) if v.dtype == torch.int8 else v


def scores_may_be_nonfinite(q: Tensor, k: Tensor, bias: Tensor | None) -> bool:
    """Whether a NaN or inf in ``q``, ``k`` or ``bias`` (other than a bias's ``-inf``) may
    make logits NaN or ``+inf``: then only the reference follows the rule everywhere."""
    if not _checked(q):
        return False
    if not _finite(q, k):
        return True
    return bias is not None and bool((bias.isnan() | bias.isposinf()).any())


def _key_ranges(Tq: int, Tk: int, causal: bool, window: int | None) -> tuple[range, range]:
    """Keys every row sees and keys some row sees under ``causal``/``window`` (see
    :func:`qkv.masks.sliding_window`; row i sits at key position ``p(i) = Tk - Tq + i``)."""
    p0, p1 = Tk - Tq, Tk - 1  # the first and the last row's positions
    if window is None:
        if not causal:
            return range(0, Tk), range(0, Tk)
        return range(0, min(max(p0 + 1, 0), Tk)), range(0, Tk)
    ahead = 0 if causal else window - 1  # keys after p(i) a row sees

    def span(a: int, b: int) -> range:  # [a, b) within [0, Tk), empty when b <= a
        a, b = min(max(a, 0), Tk), min(b, Tk)
        return range(a, max(a, b))

    return span(p1 - window + 1, p0 + ahead + 1), span(p0 - window + 1, p1 + ahead + 1)


_SMALL = 1 << 16  # values of at most this many elements are summed whole (one op)


def _seen_keys(
    mask: Tensor | None, bias: Tensor | None, every: range, some: range, Tk: int, device
) -> tuple[Tensor, Tensor]:
    """Two ``(Tk,)`` bools: keys every row (of every batch and head) may see, and keys some
    row may see (an over-estimate that takes mask, bias and structure apart)."""
    by_every = torch.zeros(Tk, dtype=torch.bool, device=device)
    by_every[every.start : every.stop] = True
    by_some = torch.zeros_like(by_every)
    by_some[some.start : some.stop] = True
    for allowed in (mask, None if bias is None else ~bias.isneginf()):
        if allowed is not None:
            rows = allowed.reshape(-1, allowed.shape[-1])  # (..., Tk) or (..., 1)
            by_every &= rows.all(0).expand(Tk)
            by_some &= rows.any(0).expand(Tk)
    return by_every, by_some


_last_hidden: tuple = ((), None)  # (what it was computed from, the indices): see below


def _tracked(t: Tensor | None) -> bool:
    """Whether every change to ``t`` bumps its version: not for an inference tensor (no
    version), nor for memory torch did not allocate (``torch.from_numpy``, ``frombuffer``,
    DLPack: its storage is not resizable), which numpy may refill behind torch's back."""
    if t is None:
        return True
    return not t.is_inference() and t.untyped_storage().resizable()


def _hidden_keys(
    mask: Tensor | None, bias: Tensor | None, every: range, some: range, Tk: int, device
) -> Tensor:
    """The indices of the keys some row may not see, remembered for the last mask and bias
    (a decoder's layers pass the same mask at each step: one look at it per step). The
    tensors themselves are held, compared by identity and version: a tensor alive cannot be
    another one at the same address, and an in-place change bumps its version. A mask made
    under ``torch.inference_mode()`` has no version, and one over numpy's memory can change
    without a version bump (a buffer refilled in place at each step would look unchanged):
    such masks are looked at on every call."""
    global _last_hidden
    versions = tuple(None if t is None else version(t) for t in (mask, bias))
    untracked = not (_tracked(mask) and _tracked(bias))
    (held, idx) = _last_hidden  # one read: another thread may replace it meanwhile
    if (not untracked and held and held[0] is mask and held[1] is bias
            and held[2:] == (versions, every, some)):  # fmt: skip
        return idx
    by_every, _ = _seen_keys(mask, bias, every, some, Tk, device)
    idx = (~by_every).nonzero().squeeze(-1)
    if not untracked:
        _last_hidden = ((mask, bias, versions, every, some), idx)
    return idx


def values_for_kernel(
    v: Tensor,
    *,
    mask: Tensor | None,
    bias: Tensor | None,
    causal: bool,
    window: int | None,
    Tq: int,
) -> tuple[Tensor, bool]:
    """``(v, exact)``: the values a kernel may read, and whether the kernel then follows the
    rule. Values at keys no row may see are zeroed (in a copy, made only when one of them is
    NaN or inf); ``exact`` is False when a NaN or inf sits at a key some rows see and others
    do not (only :func:`weights_times_values` keeps it out of the rows that do not). An int8
    cache's packed rows are looked at through their scales (a zeroed row: scale 0).

    The usual call costs one pass of :func:`_finite`: over all values when they are few or
    most keys are hidden from some row; else over the values at keys some row may not see
    (none for one query row under ``causal``; with a mask or a bias, the keys it hides
    somewhere, found once per mask).
    """
    Tk = v.shape[-2]
    if not _checked(v) or Tq == 0 or Tk == 0:
        return v, True
    every, some = _key_ranges(Tq, Tk, causal, window)
    exact, hidden = _values_seen(_as_float_rows(v), mask, bias, every, some, Tk)
    if not exact:
        return v, False
    return (v, True) if hidden is None else (v.masked_fill(hidden.unsqueeze(-1), 0), True)


def values_for_flash(
    v: Tensor,
    *,
    mask: Tensor | BlockMask | None,
    bias: Tensor | None,
    causal: bool,
    window: int | None,
    Tq: int,
) -> tuple[Tensor, bool]:
    """:func:`values_for_kernel` for the fused flash kernel, whose ``mask`` may be a
    :class:`~qkv.block_mask.BlockMask`: its hidden keys are anywhere, so every value is
    looked at (exact only when all are finite)."""
    if isinstance(mask, BlockMask):
        return v, not _checked(v) or _finite(v)
    return values_for_kernel(v, mask=mask, bias=bias, causal=causal, window=window, Tq=Tq)


def _values_seen(
    v: Tensor, mask: Tensor | None, bias: Tensor | None, every: range, some: range, Tk: int
) -> tuple[bool, Tensor | None]:
    """:func:`values_for_kernel` on float rows (values, or an int8 cache's scales):
    ``(exact, keys to zero (Tk,) or None)``."""
    if mask is None and bias is None:
        outside = [(0, every.start), (every.stop, Tk)]
        outside = [(a, b) for a, b in outside if a < b]
        if not outside:
            return True, None
        # few values, or most keys: one pass over all of them (a slice is a strided copy)
        if v.numel() <= _SMALL or 2 * sum(b - a for a, b in outside) >= Tk:
            if _finite(v):
                return True, None
        elif all(_finite(v[..., a:b, :]) for a, b in outside):
            return True, None
    elif v.numel() <= _SMALL:
        if _finite(v):
            return True, None
    elif _finite(v.index_select(-2, _hidden_keys(mask, bias, every, some, Tk, v.device))):
        return True, None
    # a NaN or inf among the values a kernel may multiply by a zero weight
    by_every, by_some = _seen_keys(mask, bias, every, some, Tk, v.device)
    bad = ~torch.isfinite(v).reshape(-1, Tk, v.shape[-1]).all(-1).all(0)  # (Tk,)
    if bool((bad & ~by_every & by_some).any()):
        return False, None
    return True, ~by_some


Look = Callable[[Tensor, Tensor, Tensor, "Tensor | None"], bool]


def _never(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> bool:
    return False


def quick_look(case, backend: str, *, scores: bool = True) -> Look | None:
    """How every call of one signature (``case``, :class:`qkv.dispatch.Case`, run by
    ``backend``) checks its inputs against the rule first: ``look(q, k, v, bias)`` is True
    when nothing NaN or inf sits where the backend would break the rule, so that it runs as
    it is; False sends the call through :func:`values_for_kernel` (and, for torch SDPA,
    :func:`scores_may_be_nonfinite`), which decide exactly. ``None``: nothing to look at.

    What a look reads, worked out once per signature: q and k and a bias's NaN/+inf for
    torch SDPA; the values where some row may not see some key (a mask, a bias, causal rows
    with Tq > 1, a window) and they are few (:data:`_SMALL`) or causal rows or a window hide
    at least half the keys (then :func:`values_for_kernel` would read them all too; other
    calls with more go to it, which reads only the hidden keys). All of it in one call of the
    kernels' ``finite`` (C++, ~1 µs for a small call). ``scores=False``: not q and k, which
    the run checks itself (:func:`qkv.dispatch.torch_adapter.lse_run`).
    """
    s = case.shape
    if case.device == "cuda" or backend == "math" or s.empty:
        return None
    qk = backend == "torch" and scores
    every, _ = _key_ranges(s.Tq, s.Tk, case.causal, case.window)
    hidden = case.has_mask or case.has_bias or (every.start, every.stop) != (0, s.Tk)
    look_v = hidden
    look_bias = qk and case.has_bias
    if not (qk or look_v):
        return None
    module = native_module()
    per_row = 1 if case.kv_int8 else s.d_v  # an int8 cache: its scales
    # causal rows or a window hiding at least half the keys: values_for_kernel reads every
    # value then too, whatever their number (one pass: the look can be that pass)
    most = not (case.has_mask or case.has_bias) and 2 * (s.Tk - len(every)) >= s.Tk
    many = math.prod(s.batch) * s.h_kv * s.Tk * per_row > _SMALL
    if module is None or (look_v and many and not most):
        return _never
    finite = module.finite
    rows = _as_float_rows if case.kv_int8 else None

    def look(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> bool:
        return finite(
            q if qk else None, k if qk else None,
            (v if rows is None else rows(v)) if look_v else None, bias if look_bias else None,
        )  # fmt: skip

    return look
