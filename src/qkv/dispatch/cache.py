"""Decisions remembered per call signature, with how to run them (the fast paths).

A call's decision depends on its tensors' metadata and its options only (and, with
gradients, on whether the scores can exceed ``HUGE_LOGITS``), so :func:`decide` works it out
once per signature: the choice, the chosen backend's argument checks, and a fast path that
runs it (torch SDPA's keyword arguments, flash's plan, the prepared decode call).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from qkv._nonfinite import quick_look
from qkv._validate import check_bias, check_mask, check_options, check_qkv
from qkv.dispatch.case import Case, _bias_bound, _logit_bound, describe
from qkv.dispatch.rules import HUGE_LOGITS, Decision, choose
from qkv.dispatch.torch_adapter import lse_run, torch_run
from qkv.kernels import decode as _decode
from qkv.kernels import flash as _flash
from qkv.kernels._native import native_module

# the options of a call, in the order :func:`_decide` takes them, and their defaults
OPTIONS = ("mask", "bias", "causal", "window", "scale", "softcap", "dropout_p",
           "return_weights", "weights_heads")  # fmt: skip
_DEFAULTS = (None, None, False, None, None, None, 0.0, False, None)
# signature -> (case, decision with its run and look)
_DECISIONS: dict[tuple, tuple[Case, Decision]] = {}
DECISION_CACHE_SIZE = 1024  # signatures remembered (the cache is emptied when full)


def _meta(x: object) -> object:
    """What of a tensor argument the decision and the checks look at: its metadata."""
    if isinstance(x, Tensor):
        return (x.shape, x.dtype, x.device, x.requires_grad)
    return tuple(x) if isinstance(x, list) else x


def _signature(q: Tensor, k: Tensor, v: Tensor, mask: object, bias: object) -> object:
    """The metadata of the tensors (shapes, dtypes, devices, requires_grad), hashable."""
    module = native_module()
    if module is not None:
        try:
            return module.signature(q, k, v, mask, bias)  # (~0.3 µs, the Python tuple ~1 µs)
        except TypeError:  # a mask or bias that is not a tensor: the checks will say so
            pass
    return (*map(_meta, (q, k, v)), _meta(mask), _meta(bias))


def decide(
    q: Tensor, k: Tensor, v: Tensor, backend: str = "auto", **options
) -> tuple[Case, Decision]:
    """:func:`describe` + :func:`choose`, and the argument checks of the chosen backend, once
    per call signature (shapes, dtypes, devices, options, gradient mode, whether the fused
    kernel is available; see the module docstring). ``options``: those of :func:`describe`.

    The :class:`Decision` says how to run the call: ``decision.run(q, k, v, mask, bias)``
    (``None`` where the call needs more: weights, a mask to build), after
    ``decision.look(q, k, v, bias)`` (the NaN/inf rule's look, :mod:`qkv._nonfinite`; where
    it is False only :func:`qkv.functional.scaled_dot_product_attention` keeps to the rule).

    Raises what those raise (nothing is remembered then). The cached :class:`Case` is the
    first call's (its ``logit_bound`` too); :func:`explain_dispatch` always recomputes.
    """
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise TypeError(f"decide() got unexpected options {sorted(unknown)}; known: {OPTIONS}")
    call = tuple(options.get(n, d) for n, d in zip(OPTIONS, _DEFAULTS))
    return _decide(q, k, v, backend, call)


def _decide(q: Tensor, k: Tensor, v: Tensor, backend: str, call: tuple) -> tuple[Case, Decision]:
    """:func:`decide` with the options as a tuple in :data:`OPTIONS` order."""
    mask, bias, causal, window, scale, softcap, dropout_p, return_weights, heads = call
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)):
        check_qkv(q, k, v)  # raises the clear error
    # grad mode first: under no_grad the three getters are skipped (each costs µs after a
    # kernel, its code cold: bench/dispatch.py --in-context)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    huge = False
    if grad:
        try:  # values: checked on every call (a shape error is raised by the checks below)
            huge = bool(q.numel() and k.numel()) and (
                _logit_bound(q, k, scale) >= HUGE_LOGITS or _bias_bound(bias) >= HUGE_LOGITS
            )
        except (IndexError, RuntimeError):
            pass
    if isinstance(heads, (list, Tensor)):  # by value (the checks read the indices)
        heads = tuple(heads.tolist() if isinstance(heads, Tensor) else heads)
    # window's type too: window=True must not reuse window=1's checks (scalars hash alike)
    key = (
        backend, grad, huge, _flash.native_ops() is None, causal, window, type(window), scale,
        softcap, dropout_p, return_weights, heads, _signature(q, k, v, mask, bias),
    )  # fmt: skip
    try:
        hit = _DECISIONS.get(key)
    except TypeError:  # an unhashable option value: decide without remembering
        key, hit = None, None
    if hit is not None:
        return hit
    options = dict(zip(OPTIONS, call))
    case = describe(q, k, v, **options)  # (also checks q, k, v)
    # the options first: a bad value is the same error whichever backend was asked for
    check_options(window=window, scale=scale, softcap=softcap, dropout_p=dropout_p, dtype=q.dtype)
    decision = choose(case, backend)
    if decision.backend != "math":  # math checks its mask and bias itself
        check_mask(mask, case.shape, q.device)
        check_bias(bias, case.shape, q.device)
    lean = lse_run(case, mask, bias) if decision.backend == "torch" else None
    run = lean or _fast_path(q, k, v, case, decision, mask, bias)
    look = quick_look(case, decision.backend, scores=lean is None)
    entry = (case, dataclasses.replace(decision, run=run, look=look, lse_check=lean is not None))
    if key is not None:
        if len(_DECISIONS) >= DECISION_CACHE_SIZE:
            _DECISIONS.clear()
        _DECISIONS[key] = entry
    return entry


def _fast_path(q, k, v, case: Case, decision: Decision, mask, bias) -> Callable | None:
    """``run(q, k, v, mask, bias) -> output`` for every call of this signature, worked out
    once: torch SDPA with its keyword arguments, flash with its plan, or the decode kernel
    (all read only metadata and options). ``None`` where the call needs more (weights, a mask
    to build)."""
    if case.return_weights:
        return None
    if decision.backend == "torch":
        return torch_run(case, mask, bias)
    if decision.backend == "decode":
        return _decode.prepared_call(case.shape, causal=case.causal, window=case.window,
                                     scale=case.scale, four=q.dim() == 4)  # fmt: skip
    if decision.backend == "flash":
        return _flash.prepared_call(
            q, k, v, case.shape, mask=mask, bias=bias, causal=case.causal, window=case.window,
            scale=case.scale, softcap=case.softcap,
        )  # fmt: skip
    return None
