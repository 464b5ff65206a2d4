"""What ``backend="auto"`` costs per call over calling the kernel it picks directly.

    python bench/dispatch.py

For each case: the chosen kernel called directly (PyTorch's SDPA or qkv's ``flash_attention``
with the same arguments) and ``qkv.functional.scaled_dot_product_attention(backend="auto")``,
in alternating rounds of ``--calls`` calls each (the machine is shared: interleaving lets the
load hit both alike); the best round's mean per call is kept. Times are this thread's CPU
time (``time.thread_time``), which other processes' load does not inflate the way it does
wall time (1 torch thread, so the calls run on this thread). Small shapes, so that the
overhead is not lost in the kernel's own time. Forward calls under ``torch.no_grad()`` unless
the case says ``grad`` (then the call only builds the graph: no backward). Calls that need
gradients also pay a check on the values (the scores' bound, to pick the reference backend
for huge logits), shown separately: it is not a decision that can be cached. Where "auto"
picks flash the overhead can be negative: ``flash_attention`` checks its arguments and
makes its plan on every call, the dispatcher once per signature.

The NaN/inf rule's look at the inputs (``Decision.look``, one C++ call; qkv._nonfinite) is part
of every call's overhead and is also timed alone, beside the exact Python checks it spares a
call whose inputs are finite (``values_for_kernel`` and, for torch SDPA,
``scores_may_be_nonfinite``: what every call ran before the look existed).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.nn.functional as TF  # noqa: E402

from _measure import machine_header  # noqa: E402
from qkv import dispatch, masks  # noqa: E402
from qkv._nonfinite import scores_may_be_nonfinite, values_for_kernel  # noqa: E402
from qkv.dispatch import _logit_bound, explain_dispatch  # noqa: E402
from qkv.functional import scaled_dot_product_attention  # noqa: E402
from qkv.kernels.flash import flash_attention  # noqa: E402

TARGET_US = 5.0


def cases():
    """(name, q, k, v, kwargs, grad)."""
    g = torch.Generator().manual_seed(0)

    def qkv(T, dtype, h=4, d=32, grad=False):
        return [torch.randn(1, h, T, d, generator=g).to(dtype).requires_grad_(grad) for _ in "qkv"]

    yield "fp32 T=32", *qkv(32, torch.float32), {}, False
    yield "fp32 T=32 causal", *qkv(32, torch.float32), {"causal": True}, False
    yield (
        "fp32 T=64 padding mask",
        *qkv(64, torch.float32),
        {"mask": masks.padding(torch.tensor([50]), 64)},
        False,
    )
    yield "bf16 T=32 window", *qkv(32, torch.bfloat16), {"causal": True, "window": 8}, False
    yield "bf16 T=32 grad", *qkv(32, torch.bfloat16, grad=True), {"causal": True}, True
    yield "fp32 T=32 grad", *qkv(32, torch.float32, grad=True), {}, True


def direct(backend: str, q, k, v, kw):
    """The chosen kernel with the same arguments, called without qkv's dispatcher."""
    if backend == "flash":
        return lambda: flash_attention(q, k, v, **kw)
    mask = kw.get("mask")
    causal, window = kw.get("causal", False), kw.get("window")
    if window is not None:
        mask = masks.combine(
            mask, masks.sliding_window(q.shape[-2], k.shape[-2], window, causal=causal)
        )
        causal = False
    return lambda: TF.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


def per_call(fn, calls: int) -> float:
    t = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - t) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(machine_header())
    print("CPU time per call; shared machine")
    print(
        f"| case | picks | direct µs | auto µs | overhead µs (target ≤ {TARGET_US:g}) "
        "| of which the logit guard µs | of which the NaN/inf look µs | exact checks spared µs |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, q, k, v, kw, grad in cases():
        decision = explain_dispatch(q, k, v, **kw)
        a = direct(decision.backend, q, k, v, kw)
        b = functools.partial(scaled_dot_product_attention, q, k, v, **kw)
        ctx = torch.enable_grad() if grad else torch.no_grad()
        with ctx:
            a(), b()
            ta = tb = float("inf")
            for _ in range(args.rounds):
                ta = min(ta, per_call(a, args.calls))
                tb = min(tb, per_call(b, args.calls))
        over = (tb - ta) * 1e6
        # gradient calls check the scores' bound on the values (dispatch.HUGE_LOGITS)
        guard = "-"
        if grad:
            bound = functools.partial(_logit_bound, q, k, None)
            guard = f"{min(per_call(bound, args.calls) for _ in range(3)) * 1e6:.1f}"
        look, spared = _rule_costs(q, k, v, kw, args.calls)
        print(
            f"| {name} | {decision.backend} | {ta * 1e6:.1f} | {tb * 1e6:.1f} | **{over:.1f}** "
            f"| {guard} | {look} | {spared} |",
            flush=True,
        )


def _rule_costs(q, k, v, kw, calls: int) -> tuple[str, str]:
    """The decision's NaN/inf look alone, and the exact checks it spares (µs per call)."""
    _, decision = dispatch.decide(q, k, v, **kw)
    if decision.look is None:
        return "-", "-"
    mask, bias = kw.get("mask"), kw.get("bias")
    look = functools.partial(decision.look, q, k, v, bias)

    def exact():
        values_for_kernel(v, mask=mask, bias=bias, causal=kw.get("causal", False),
                          window=kw.get("window"), Tq=q.shape[-2])  # fmt: skip
        if decision.backend == "torch":
            scores_may_be_nonfinite(q, k, bias)

    with torch.no_grad():
        t_look = min(per_call(look, calls) for _ in range(3))
        t_exact = min(per_call(exact, calls) for _ in range(3))
    return f"{t_look * 1e6:.1f}", f"{t_exact * 1e6:.1f}"


if __name__ == "__main__":
    main()
