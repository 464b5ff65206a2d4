"""Which attention path runs, and why: the ``backend=`` choice, explained.

Backends of :func:`qkv.functional.scaled_dot_product_attention`:

- ``"math"``: the reference (:func:`qkv.functional.attention_steps`); always valid.
- ``"torch"``: ``torch.nn.functional.scaled_dot_product_attention`` (PyTorch's fused CPU
  kernel), our options converted to its ``attn_mask``/``is_causal``/``enable_gqa``.
- ``"flash"``: :func:`qkv.kernels.flash.flash_attention` (tiled, O(T) memory, block skipping).
- ``"decode"``: :func:`qkv.kernels.decode.decode_attention` (a few queries over a long KV
  cache: keys split across threads, K/V read once; CPU fp32/bf16 inference).
- ``"auto"`` (default): the first valid backend of the rule table below.

``"auto"`` rules, measured on the 2-core Xeon (AVX-512 + AMX) this repository is developed on
(``python bench/flash_vs_sdpa.py`` and ``bench/attention.py``, 1 and 2 threads, B=1 h=8 d=64;
the ratio is the chosen backend's speed over the other's; full numbers in README
``## Speed (issue 3)``). "fused" means flash runs its fused C++ kernel (fp32/bf16 on the CPU,
with masks, biases and soft-capping; :func:`qkv.kernels.flash.fused_kernel_rejects`;
measured with and without a key-padding mask; biases, ALiBi, soft-capping and block masks in
``bench/variants.py``):

==================================================  =======  =======================================
case (first matching row wins)                      backend  why (measured)
==================================================  =======  =======================================
block mask / ALiBi / ``rel_bias``, fused kernel      flash    no dense (Tq, Tk) mask or bias at all
int8 K/V rows (``qkv.cache``), decode-able, Tq <= 16  decode   reads the rows as stored (else widened)
``return_weights`` for all heads                    math     the weights are materialised anyway
``return_weights`` with ``weights_heads``           flash    those heads' weights from the saved lse
``dropout_p > 0``                                   torch    flash has no dropout (math if softcap)
``softcap``                                         flash    torch SDPA has no soft-capping
decode-able, fp32, a tensor mask, no grouped heads,  torch    1.1-1.4× decode (``SMALL_MASKED``)
``9 <= Tq``, ``Tk <= 32``
decode-able, ``Tq <= 16``                            decode   see below
fused, gradients needed, bf16                       flash    fwd+bwd 1.5-2.5× (T=16-4096)
fused, gradients needed, fp32, ``Tk >= 1024``       flash    fwd+bwd 1.1-1.2× (0.5-1.0× below)
fused, ``window``, ``Tk >= 2·window``               flash    1.5× (T=512) to 4.5× (T=2048), w=256
fused, ``Tq·Tk >= 1024²``                           flash    forward 1.0-1.2× (fp32), 1.3-1.7× (bf16)
``window``, ``Tk >= 4·window`` (not fused, fp32/64)  flash    1.4× (T=1024) to 6.2× (T=4096), w=256
``window``, ``Tk >= 16·window`` (not fused, 16-bit)  flash    2.0× at T=4096 (0.5× at T=1024)
everything else (shorter inference, fp64)           torch    flash's forward is 0.3-1.1× of it there
==================================================  =======  =======================================

The kernel levels without AVX-512 (:mod:`qkv.kernels._levels`) were measured on a 2-core AMD
EPYC (Zen 3: AVX2, no AVX-512), 1 thread, with ``python bench/level_rules.py`` (q
``(1, 8, T, 64)`` for flash; decode as below). On ``avx2`` the fused rows above hold as they
are (fwd+bwd bf16 6.2-7.5×, fp32 1.1-1.5×; window 2.4-9.6×; forward at ``Tq·Tk >= 1024²``
1.0-1.6×, bf16 1.0-1.3×), and the decode row below holds up to 64 rows per kv head (beyond
16 rows the work is arithmetic, and its scores are taken by broadcasts, 60-74 GFLOP/s, about
80 % of the fp32 matmul peak). On ``portable`` and ``neon`` the flash softmax is the compiler's
scalar loops and these rows replace the fused ones (the first five rows hold on every level):

==================================================  =======  =======================================
case (first matching row wins)                      backend  why (measured)
==================================================  =======  =======================================
decode-able, ``Tq <= 16``, ``G·Tq <= 64`` rows      decode   avx2: 1.1-2.0× torch on grouped rows
                                                             (fp32/bf16, 4-64 rows, Tk=1024-16384);
                                                             portable, neon: bf16 and ``G·Tq <= 4``
                                                             only (2.2×)
fused, gradients needed, bf16 (portable, neon)      flash    fwd+bwd 4.0-5.6× (T=256-4096)
fused, ``window``, ``Tk >= 4·window`` (portable)    flash    1.1× (T=1024) to 5.4× (T=4096), w=256
``window`` (not fused), as above                    flash    as above
everything else (portable, neon)                    torch    fused flash 0.4-0.9× forward,
                                                             0.7-0.9× fp32 fwd+bwd
==================================================  =======  =======================================

"decode-able": CPU fp32/bf16 inference (no gradients), no bias/soft-cap/dropout, the fused
kernels built (:func:`qkv.kernels.decode.decode_rejects`), bool masks and causal/window
allowed. Measured with ``python bench/decode_attention.py`` on a 2-core AMD EPYC (Zen 4,
AVX-512 + AVX512_BF16), q ``(1, 32, Tq, 128)``, GQA cache ``(1, 8, Tk, 128)``, Tq in
{1, 4, 16}, Tk from 512 to 65536, 1 thread: 0.96-33× the "torch" path (SDPA with
``enable_gqa``; below 1× only at fp32 Tk=512 Tq=16); without GQA (h=4-8, d=16-64,
Tk=16-1024) 1.0-7×, its Python dispatch included. (PyTorch's SDPA on the grouped-rows layout,
which qkv's "torch" path does not use, is faster for some fp32 caches held in L3: 0.8-0.9× at
Tk <= 1024, Tq >= 4.) See docs/kernels.md.

On a 2-core AMD EPYC Zen 5 (``avx512_bf16``, no AMX; ``python bench/level_rules.py``, 1
thread) every fused row of the first table and the decode row (4-64 rows per kv head,
Tk = 512-16384, fp32 and bf16) ran 2.1-29× the "torch" path
(``bench/results/level_rules_zen5_avx512_bf16.md``).

Empty inputs (a zero batch dim, ``h``, ``Tq`` or ``Tk``) run the reference whatever the
request: every backend's answer is the same zeros (see :mod:`qkv.functional`).

"torch" is rejected for: ``softcap``; weights/lse requested (it returns neither); a bias that
requires grad. "flash" is rejected for ``dropout_p > 0``. "decode" is rejected for calls
that are not decode-able (above). Fully masked rows: PyTorch 2.13's CPU
kernels return zeros for them, as qkv requires (checked in tests/dispatch/test_dispatch.py).

Every call logs one debug line on ``logging.getLogger("qkv")``; :func:`explain_dispatch` says
which backend a call would use and why each faster one was rejected.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from qkv._validate import check_qkv
from qkv.block_mask import BlockMask
from qkv.dispatch.case import Case, describe
from qkv.kernels._levels import build_of
from qkv.kernels._native import native_level
from qkv.kernels.decode import MAX_TQ, decode_rejects
from qkv.kernels.flash import fused_kernel_rejects

logger = logging.getLogger("qkv")

BACKENDS = ("math", "torch", "flash", "decode")
HUGE_LOGITS = 2.0**16  # beyond it, gradients from a recomputed softmax lose all accuracy
# fastest first (as measured); "auto" takes the first valid one in this order unless a rule
# of the table in the module docstring picks another.
_SPEED_ORDER = ("decode", "torch", "flash", "math")
WINDOW_RATIO = 4  # fp32/fp64: flash beats torch+dense mask from Tk >= 4·window (1.4× at 1024/256)
WINDOW_RATIO_LOW = 16  # bf16/fp16: from Tk >= 16·window (0.5× at 1024/256, 2.0× at 4096/256)
# with flash's fused C++ kernel (see the table above)
FUSED_GRAD_TK = 1024
FUSED_WINDOW_RATIO = 2
FUSED_AREA = 1024 * 1024
# The kernel levels without AVX-512 (qkv.kernels._levels), the second table of the docstring:
# the decode kernel up to this many query rows per kv head (G·Tq), for these dtypes: avx2
# (Zen 3, 1 thread, against torch on the grouped-rows layout that the torch backend runs)
# Tk = 16384: fp32 1.51× / 1.53× at 4 / 8 rows, 1.63× / 1.32× / 1.49× at 16 / 32 / 64 rows,
# bf16 1.99× / 1.49×, 1.30× / 1.18× / 1.23×; Tk = 1024: fp32 1.51× / 1.28×, 1.23× / 1.11× /
# 1.18×, bf16 1.94× / 1.45×, 1.25× / 1.14× / 1.18× (bench/results/decode_attention_zen3_avx2*);
# the portable loops 2.2× for bf16 at 4 rows (torch's bf16 path is slow there), 0.1-0.9×
# for everything else
UNTUNED_DECODE = {
    "avx2": (64, (torch.float32, torch.bfloat16)),
    "portable": (4, (torch.bfloat16,)),
    "neon": (4, (torch.bfloat16,)),
}
# A few fp32 queries over as few keys, with a tensor mask and no grouped heads: torch SDPA (its
# additive mask remembered per mask, torch_adapter.additive) beats the decode kernel there.
# Measured on the 2-core Xeon (1 thread, `bench/dispatch.py --decode-vs-torch` under each
# QKV_ISA, two runs; bench/results/dispatch_small.md): Tq = Tk = 16, B=1 h=4 and B=4 h=8,
# d=64, a padding mask: the decode kernel at 0.72-0.93x torch's speed on amx, avx512 and avx2;
# bf16 was mixed (0.85-1.2x) and keeps the decode kernel, as do fewer queries (T <= 8: decode
# 1.0-1.6x) and grouped heads (1.3-1.5x at Tq = 1-4).
SMALL_MASKED = {"min_tq": 9, "max_tk": 32, "dtypes": (torch.float32,)}
# the levels whose flash softmax is scalar code: the second table's fused rows replace the first's
UNTUNED_LEVELS = ("portable", "neon")
UNTUNED_WINDOW_RATIO = 4  # fused flash with a window from Tk >= 4·window (1.1× at 1024/256)


@dataclass
class Decision:
    """The chosen backend and, for every backend, why it was not chosen (or ``None``)."""

    backend: str
    requested: str
    reasons: dict[str, str] = field(default_factory=dict)
    kernel: str | None = None  # for "flash": which of its two kernels runs, and why
    why: str = ""  # why this backend: the rule that picked it
    # how to run it, worked out once per call signature by qkv.dispatch.decide (None from
    # choose alone): run(q, k, v, mask, bias) -> output, for calls that return no weights
    run: Callable[..., Tensor] | None = field(default=None, compare=False, repr=False)
    # the NaN/inf rule's look at the inputs first (qkv._nonfinite.quick_look): look(q, k, v,
    # bias) False sends the call to the rule's exact checks before it runs; None: no look
    look: Callable[..., bool] | None = field(default=None, compare=False, repr=False)
    # run checks q and k itself, on torch's log-sum-exp (torch_adapter.lse_run): it returns
    # None where they break the rule (then the reference runs), and look reads no q or k
    lse_check: bool = field(default=False, compare=False, repr=False)

    def __str__(self) -> str:
        lines = [f"backend={self.backend!r} (requested {self.requested!r})"]
        if self.why:
            lines.append(f"  because: {self.why}")
        if self.kernel is not None:
            lines.append(f"  flash kernel: {self.kernel}")
        for name in _SPEED_ORDER:
            if name != self.backend and name in self.reasons:
                lines.append(f"  not {name!r}: {self.reasons[name]}")
        return "\n".join(lines)


def invalid(case: Case) -> dict[str, str]:
    """``{backend: reason}`` for each backend that cannot run this case."""
    out: dict[str, str] = {}
    if case.softcap is not None:
        out["torch"] = "softcap is not supported by torch SDPA"
    elif case.return_weights:
        out["torch"] = "weights requested: torch SDPA returns neither weights nor log-sum-exp"
    elif case.bias_requires_grad:
        out["torch"] = "bias requires grad: only math and flash differentiate the bias"
    if case.dropout_p > 0:
        out["flash"] = f"dropout_p={case.dropout_p} > 0: flash has no dropout"
    return out


def _decode_limit(case: Case) -> tuple[int, tuple[torch.dtype, ...]] | None:
    """On a kernel level without AVX-512: the query rows per kv head (G·Tq) and dtypes up to
    which "auto" takes the decode kernel (the second table); ``None`` on the others (the
    AVX-512 table's levels, and devices other than the CPU)."""
    level = native_level()  # avx2_vnni, avx512_vnni: their builds (VNNI changes int8 only)
    return UNTUNED_DECODE.get(build_of(level) if level else None) if case.device == "cpu" else None


def _small_masked(case: Case) -> bool:
    """The :data:`SMALL_MASKED` class: where torch SDPA beats the decode kernel."""
    s, c = case.shape, SMALL_MASKED
    return (case.has_mask and not case.kv_int8 and s.group == 1 and s.Tq >= c["min_tq"]
            and s.Tk <= c["max_tk"] and case.dtype in c["dtypes"])  # fmt: skip


def _rule(case: Case, fused_why: str | None, decode_why: str | None) -> tuple[str, str]:
    """The measured rule for ``"auto"``: (preferred backend, why).

    ``fused_why``: why flash's fused kernel cannot run the case (``None``: it can);
    ``decode_why``: likewise for the decode kernel.
    """
    s = case.shape
    fused = fused_why is None
    limit = _decode_limit(case)  # the levels of the second table
    decode = (
        decode_why is None
        and s.Tq <= MAX_TQ
        and (limit is None or (s.group * s.Tq <= limit[0] and case.dtype in limit[1]))
    )
    few = f"inference, Tq={s.Tq} <= {MAX_TQ} queries: the decode kernel reads K/V once"
    if case.return_weights and case.weights_heads is None:
        return "math", "all heads' weights requested: math materialises them anyway"
    if case.return_weights and decode:
        return "decode", f"{few}; the selected heads' weights come from its log-sum-exp"
    if case.return_weights:
        return "flash", "weights of selected heads are recomputed from flash's log-sum-exp"
    if case.dropout_p > 0:
        return "torch", "dropout: torch SDPA has it"
    if case.grad and case.logit_bound >= HUGE_LOGITS:
        return "math", (f"gradients with scores up to {case.logit_bound:.1e} >= {HUGE_LOGITS:.0e}: "
                        "torch and flash rebuild the weights from an fp32 log-sum-exp too coarse "
                        "there; math differentiates its own softmax")  # fmt: skip
    if case.softcap is not None:
        return "flash", "softcap: flash supports it without materialising Tq×Tk"
    if decode and _small_masked(case):
        return "torch", (f"fp32, a tensor mask, Tq={s.Tq} > {SMALL_MASKED['min_tq'] - 1} "
                         f"queries over Tk={s.Tk} <= {SMALL_MASKED['max_tk']} keys, no grouped "
                         "heads: torch SDPA is 1.1-1.4× the decode kernel")  # fmt: skip
    if decode:
        return "decode", f"{few}, split across threads (up to 33× the torch path)"
    level = native_level()
    untuned = case.device == "cpu" and level in UNTUNED_LEVELS
    if untuned:  # the fused rows of the second table
        if fused and case.grad and case.dtype == torch.bfloat16:
            return "flash", f"gradients needed, bf16: fused flash is 4.0-5.6× torch SDPA ({level})"
        if fused and case.window is not None and UNTUNED_WINDOW_RATIO * case.window <= s.Tk:
            return "flash", (f"window={case.window} <= Tk/{UNTUNED_WINDOW_RATIO}: fused flash "
                             f"skips blocks, 1.1-5.4× torch ({level})")  # fmt: skip
    else:
        if fused and case.grad and case.dtype == torch.bfloat16:
            return "flash", "gradients needed, bf16: flash's fused kernel is 1.5-2.5× torch SDPA"
        if fused and case.grad and s.Tk >= FUSED_GRAD_TK:
            return "flash", (
                f"gradients needed, Tk >= {FUSED_GRAD_TK}: fused flash is 1.1-1.2× torch"
            )
        if fused and case.window is not None and FUSED_WINDOW_RATIO * case.window <= s.Tk:
            return "flash", (
                f"window={case.window} <= Tk/{FUSED_WINDOW_RATIO}: fused flash skips blocks"
            )
        if fused and s.Tq * s.Tk >= FUSED_AREA:
            return "flash", (
                "Tq·Tk >= 1024²: fused flash forward is 1.0-1.2× (fp32), 1.3-1.7× (bf16)"
            )
    low = case.dtype in (torch.bfloat16, torch.float16)
    ratio = WINDOW_RATIO_LOW if low else WINDOW_RATIO
    if case.window is not None and ratio * case.window <= s.Tk:
        return "flash", f"window={case.window} <= Tk/{ratio}: flash skips empty blocks, O(T·w)"
    # the last row of the table, said for this call (no bias is named unless it was given)
    if limit is not None and decode_why is None and s.Tq <= MAX_TQ:
        rows, dtypes = limit
        return "torch", (f"{s.group * s.Tq} query rows per kv head in {case.dtype}: the {level} "
                         f"decode kernel is slower than torch SDPA beyond {rows} rows or "
                         f"outside {', '.join(str(d) for d in dtypes)}")  # fmt: skip
    if not fused:
        return "torch", f"flash would run its PyTorch-ops kernel ({fused_why}): torch is faster"
    if untuned:
        return "torch", (
            f"kernel level {level}: torch SDPA's dense kernels are faster here "
            "(fused flash 0.4-0.9× forward, 0.7-0.9× fp32 forward+backward)"
        )
    if case.grad:
        why = f"gradients needed, fp32, Tk={s.Tk} < {FUSED_GRAD_TK}"
        return "torch", f"{why}: torch SDPA's fwd+bwd is faster (fused flash 0.5-1.0×)"
    why = f"inference, Tq·Tk = {s.Tq}·{s.Tk} < 1024²"
    return "torch", f"{why}: torch SDPA's forward is faster (fused flash 0.3-1.1×)"


def _fused_reason(case: Case) -> str | None:
    """Why flash's fused C++ kernel cannot run this case (``None``: it can)."""
    return fused_kernel_rejects(case.device, case.dtype)


def _decode_reason(case: Case) -> str | None:
    """Why the decode kernel cannot run this case (``None``: it can)."""
    return decode_rejects(
        case.device, case.dtype, grad=case.grad, has_bias=case.has_bias, softcap=case.softcap,
        dropout_p=case.dropout_p, scale=case.scale,
    )  # fmt: skip


def choose(case: Case, backend: str = "auto") -> Decision:
    """Pick the backend for ``case``; ``backend`` is ``"auto"`` or one of :data:`BACKENDS`."""
    if backend not in (*BACKENDS, "auto"):
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
    bad = invalid(case)
    # only "auto" and "decode" look at the decode kernel (the first look may build it)
    decode_why = _decode_reason(case) if backend in ("auto", "decode") else None
    if decode_why is not None:
        bad["decode"] = decode_why
    if case.kv_int8 and "decode" not in bad and case.return_weights:
        bad["decode"] = "weights requested: they are rebuilt from widened int8 rows"
    if backend != "auto" and backend in bad:
        raise ValueError(f"backend={backend!r} cannot run this call: {bad[backend]}")
    if case.kv_int8 and backend == "auto" and "decode" not in bad and case.shape.Tq <= MAX_TQ:
        reasons = {n: INT8_ROWS for n in BACKENDS if n != "decode"}
        return Decision("decode", "auto", reasons, why=INT8_ROWS)
    if case.shape.empty:  # the same zeros from every backend: the reference returns them
        why = "empty input (a zero batch dim, h, Tq or Tk): no score to compute"
        reasons = {n: f"{why}; every backend gives the same zeros" for n in BACKENDS}
        reasons.pop("math")
        return Decision("math", backend, reasons, why=why)
    # only "auto" and "flash" look at flash's kernels (the first look may build the fused one)
    fused_why = _fused_reason(case) if backend in ("auto", "flash") else None
    if backend != "auto":
        reasons = {n: "not requested" for n in BACKENDS if n != backend}
        return Decision(backend, backend, reasons, _flash_kernel(backend, fused_why), "requested")
    preferred, why = _rule(case, fused_why, decode_why)
    if preferred in bad:  # e.g. dropout with softcap
        preferred, why = "math", "the only backend valid for this combination"
    reasons = dict(bad)
    for name in _SPEED_ORDER:
        if name not in reasons and name != preferred:
            slow = "the reference: slowest, holds (Tq, Tk) per head"
            reasons[name] = slow if name == "math" else f"rule: {why}"
    if "decode" not in bad and case.shape.Tq > MAX_TQ:  # said for this call, not a rule's
        reasons["decode"] = (f"Tq={case.shape.Tq} > {MAX_TQ} queries: the decode kernel is "
                             "for a few queries over a long cache; tiled kernels reuse K/V more")  # fmt: skip
    reasons.pop(preferred, None)
    return Decision(preferred, "auto", reasons, _flash_kernel(preferred, fused_why), why)


def _flash_kernel(backend: str, fused_why: str | None) -> str | None:
    if backend != "flash":
        return None
    return "fused C++ kernel" if fused_why is None else f"PyTorch-ops kernel ({fused_why})"


INT8_ROWS = (
    "an int8 cache: the decode kernel reads its rows as stored (a quarter of fp32's bytes); "
    "any other backend gets them widened to q's dtype first"
)
FUSED_EXTRAS = (
    "block mask / ALiBi slopes / rel_bias: fused flash runs them without a dense (Tq, Tk) tensor"
)


def extras_decision(
    device: torch.device | str, dtype: torch.dtype, backend: str, *, empty: bool,
    scale: float | None, dropout_p: float, return_weights: bool, weights_heads,
) -> Decision | str:  # fmt: skip
    """The first row of the table, for a call with a block mask, ALiBi slopes or a relative
    table: the :class:`Decision` to run them on flash's fused kernel, or why it cannot (then
    they are expanded to a dense mask and bias, and the other rows decide)."""
    if backend not in ("auto", "flash"):
        return f"backend={backend!r} requested"
    if dropout_p > 0:
        return f"dropout_p={dropout_p} > 0: flash has no dropout"
    if return_weights and weights_heads is None:
        return "all heads' weights requested"
    if empty:
        return "empty input"
    why = fused_kernel_rejects(device, dtype, scale=scale)
    if why is not None:
        return why
    reasons = {"torch": FUSED_EXTRAS, "math": "the reference: slowest, holds (Tq, Tk) per head",
               "decode": FUSED_EXTRAS}  # fmt: skip
    return Decision("flash", backend, reasons, "fused C++ kernel", FUSED_EXTRAS)


def explain_dispatch(
    q: Tensor, k: Tensor, v: Tensor, *, backend: str = "auto",
    alibi_slopes: Tensor | None = None, rel_bias: Tensor | None = None, **kwargs,
) -> Decision:  # fmt: skip
    """Which backend ``scaled_dot_product_attention(q, k, v, **kwargs)`` runs, and why, for
    every call it takes (block masks, ``alibi_slopes`` and ``rel_bias`` included).

    ``print()`` the result for one line per rejected backend.

    >>> q = k = v = torch.randn(1, 2, 64, 16)
    >>> explain_dispatch(q, k, v, softcap=30.0).backend
    'flash'
    >>> explain_dispatch(q, k, v, alibi_slopes=torch.ones(2)).kernel
    'fused C++ kernel'
    """
    mask = kwargs.get("mask")
    extras = isinstance(mask, BlockMask) or alibi_slopes is not None or rel_bias is not None
    if extras:
        shape = check_qkv(q, k, v)
        d = extras_decision(
            q.device, q.dtype, backend, empty=shape.empty, scale=kwargs.get("scale"),
            dropout_p=kwargs.get("dropout_p", 0.0),
            return_weights=kwargs.get("return_weights", False),
            weights_heads=kwargs.get("weights_heads"),
        )  # fmt: skip
        if isinstance(d, Decision):
            return d
        # expanded to a dense mask and bias: decided as such a call (only metadata is read)
        dense = q.new_zeros(()).expand(*shape.batch, shape.h, shape.Tq, shape.Tk)
        if mask is not None:
            kwargs["mask"] = dense.bool()
        if alibi_slopes is not None or rel_bias is not None:
            kwargs["bias"] = dense
    return choose(describe(q, k, v, **kwargs), backend)


def log_decision(decision: Decision, case: Case) -> None:
    if logger.isEnabledFor(logging.DEBUG):
        s = case.shape
        rejected = "; ".join(f"{n}: {r}" for n, r in decision.reasons.items())
        logger.debug(
            "sdpa backend=%s (requested %s) q=(%s, h=%d, Tq=%d, d=%d) Tk=%d %s | %s",
            decision.backend, decision.requested, s.batch, s.h, s.Tq, s.d_k, s.Tk,
            case.dtype, rejected,
        )  # fmt: skip
