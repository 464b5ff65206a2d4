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

``--grid``: small calls (Tq, Tk <= 128) through the public entry point against PyTorch's SDPA
on the same inputs, at every kernel level this CPU runs, each level in its own process
(``QKV_ISA``), side by side: in each round SDPA and qkv take turns (``--grid-rounds`` rounds
of about 4 ms each), the ratio SDPA time / qkv time is taken per round and its median printed
(> 1: qkv faster). Each cell names the path that ran (``lse``: torch's fused kernel with the
NaN/inf check on its log-sum-exp, ``torch``: SDPA after the look at q and k, ``decode``,
``flash``). 1 torch thread, CPU time of this thread.

``--look-parts``: SDPA / qkv with and without the NaN/inf look, and with the rule checked on
the fused kernel's log-sum-exp after the call instead (the measurements of
``qkv.dispatch.torch_adapter.LSE_MIN_QK``), beside SDPA / SDPA.
``--in-context``: pieces of the dispatcher between a linear layer and SDPA, as in a model
(what each costs there against alone).
``--decode-vs-torch``: for Tq = Tk <= 16, the decode kernel against the torch backend (the
measurements of ``qkv.dispatch.rules.SMALL_MASKED``; run it under each ``QKV_ISA``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
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


GRID_SHAPES = ((1, 4, 16, 64), (1, 8, 64, 64), (1, 8, 64, 128), (1, 8, 128, 64), (8, 4, 32, 64),
               (4, 12, 128, 64))  # (B, h, T, d), Tq = Tk = T  # fmt: skip
GRID_KINDS = ("full", "causal", "mask")


def grid_cases():
    """(name, q, k, v, qkv's keyword arguments, SDPA's keyword arguments)."""
    g = torch.Generator().manual_seed(0)
    for B, h, T, d in GRID_SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = (torch.randn(B, h, T, d, generator=g).to(dtype) for _ in "qkv")
            for kind in GRID_KINDS:
                ours, theirs = {}, {}
                if kind == "causal":
                    ours, theirs = {"causal": True}, {"is_causal": True}
                elif kind == "mask":  # key padding of the last quarter, per batch row
                    lengths = torch.full((B,), T - T // 4)
                    m = masks.padding(lengths, T)  # (B, 1, 1, T)
                    ours, theirs = {"mask": m}, {"attn_mask": m}
                name = f"B={B} h={h} T={T} d={d} {str(dtype)[6:]} {kind}"
                yield name, q, k, v, ours, theirs


def _path(q, k, v, kw) -> str:
    _, decision = dispatch.decide(q, k, v, **kw)
    if decision.backend == "torch":
        return "lse" if getattr(decision, "lse_check", False) else "torch"
    return decision.backend


def grid_child(rounds: int) -> None:
    """One level (this process's QKV_ISA): one JSON line per case."""
    from qkv.kernels._native import native_level

    torch.set_num_threads(1)
    print(json.dumps({"level": native_level(), "header": machine_header()}), flush=True)
    for name, q, k, v, ours, theirs in grid_cases():
        a = functools.partial(TF.scaled_dot_product_attention, q, k, v, **theirs)
        b = functools.partial(scaled_dot_product_attention, q, k, v, **ours)
        with torch.no_grad():
            torch.testing.assert_close(b(), a(), atol=2e-2, rtol=2e-2)  # (and warm both)
            t0 = time.thread_time()
            a()
            calls = max(2, int(0.004 / max(time.thread_time() - t0, 1e-6)))
            ta, tb = [], []
            for _ in range(rounds):
                ta.append(per_call(a, calls))
                tb.append(per_call(b, calls))
        ratios = [x / y for x, y in zip(ta, tb)]
        row = {"case": name, "path": _path(q, k, v, ours), "sdpa_us": statistics.median(ta) * 1e6,
               "qkv_us": statistics.median(tb) * 1e6, "ratio": statistics.median(ratios)}  # fmt: skip
        print(json.dumps(row), flush=True)


def grid(levels: list[str], rounds: int) -> None:
    """Every level in its own process; the table of SDPA / qkv per case and level."""
    from qkv.kernels._levels import runnable_names

    levels = levels or list(reversed(runnable_names()))
    results: dict[str, dict[str, dict]] = {}
    for level in levels:
        env = {**os.environ, "QKV_ISA": level, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, __file__, "--grid-child", "--grid-rounds", str(rounds)]
        lines = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        rows = [json.loads(line) for line in lines.splitlines() if line.startswith("{")]
        if not results:
            print(rows[0]["header"].split("\nqkv kernels")[0])
        print(f"QKV_ISA={level}: {rows[0]['header'].split('qkv kernels: ')[1]}", flush=True)
        results[level] = {r["case"]: r for r in rows[1:]}
    print(f"\nSDPA time / qkv time (median of {rounds} interleaved rounds; > 1: qkv faster), "
          "the path qkv ran, and SDPA's µs per call at the first level\n")  # fmt: skip
    print("| case | SDPA µs | " + " | ".join(levels) + " |")
    print("|---|---|" + "---|" * len(levels))
    worst = {lv: (float("inf"), "") for lv in levels}
    for name in results[levels[0]]:
        cells = []
        for lv in levels:
            r = results[lv][name]
            cells.append(f"{r['ratio']:.2f} {r['path']}")
            worst[lv] = min(worst[lv], (r["ratio"], name))
        print(f"| {name} | {results[levels[0]][name]['sdpa_us']:.1f} | " + " | ".join(cells) + " |")
    for lv in levels:
        ratios = [r["ratio"] for r in results[lv].values()]
        print(f"{lv}: median {statistics.median(ratios):.3f}, lowest {worst[lv][0]:.2f} "
              f"({worst[lv][1]})")  # fmt: skip


def paired(a, b, rounds: int) -> float:
    """Median over interleaved rounds (~3 ms each) of a's time / b's time."""
    t0 = time.thread_time()
    a()
    calls = max(2, int(0.003 / max(time.thread_time() - t0, 1e-6)))
    return statistics.median(per_call(a, calls) / per_call(b, calls) for _ in range(rounds))


def look_parts(rounds: int) -> None:
    """Where a call's time over SDPA goes, SDPA / qkv: with the NaN/inf look at q and k ahead
    of SDPA (``torch_adapter.LSE_MIN_QK`` out of reach), the same with the decision's look
    removed, with the rule checked on the fused kernel's log-sum-exp after the call instead
    (``LSE_MIN_QK`` 0); the path "auto" takes; SDPA against itself (the noise)."""
    from qkv.dispatch import torch_adapter

    torch.set_num_threads(1)
    print(machine_header())
    print("\n| case | q+k elements | auto takes | look ahead | without the look | check after "
          "(lse) | SDPA / SDPA |\n|---|---|---|---|---|---|---|")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    threshold = torch_adapter.LSE_MIN_QK

    def ratio(a, b, lse_from: int, bare: bool = False) -> float:
        dispatch._DECISIONS.clear()
        torch_adapter.LSE_MIN_QK = lse_from
        if bare:  # the decision without its look
            _, decision = dispatch.decide(q, k, v, **ours)
            key = next(key for key, (_, d) in dispatch._DECISIONS.items() if d is decision)
            case, decision = dispatch._DECISIONS[key]
            dispatch._DECISIONS[key] = (case, dataclasses.replace(decision, look=None))
        try:
            return paired(a, b, rounds)
        finally:
            torch_adapter.LSE_MIN_QK = threshold
            dispatch._DECISIONS.clear()

    for B, h, T, d in ((1, 8, 64, 64), (1, 8, 128, 128), (4, 12, 128, 64)):
        for dtype in (torch.float32, torch.bfloat16):
            for kind, ours, theirs in (("full", {}, {}),
                                       ("causal", {"causal": True}, {"is_causal": True})):  # fmt: skip
                q, k, v = (torch.randn(B, h, T, d, generator=g).to(dtype) for _ in "qkv")
                a = functools.partial(TF.scaled_dot_product_attention, q, k, v, **theirs)
                b = functools.partial(scaled_dot_product_attention, q, k, v, **ours)
                with torch.no_grad():
                    path = _path(q, k, v, ours)
                    ahead = ratio(a, b, 1 << 62)
                    bare = ratio(a, b, 1 << 62, bare=True)
                    after = ratio(a, b, 0)
                    noise = paired(a, a, rounds)
                name = f"B={B} h={h} T={T} d={d} {str(dtype)[6:]} {kind}"
                print(f"| {name} | {B * h * 2 * T * d} | {path} | {ahead:.3f} | {bare:.3f} | "
                      f"{after:.3f} | {noise:.3f} |", flush=True)  # fmt: skip


def in_context(rounds: int) -> None:
    """The per-call costs between two kernels, as in a model: each call follows a linear
    layer (64x512 @ 512x512); µs over (linear, SDPA) per call, median of interleaved rounds.
    Small pieces of the dispatcher cost several times their isolated time there."""
    from qkv.dispatch import cache
    from qkv.kernels._native import native_module

    torch.set_num_threads(1)
    module = native_module()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 64, 64, generator=g) for _ in "qkv")
    x, w = torch.randn(64, 512, generator=g), torch.randn(512, 512, generator=g)
    sdpa, linear = TF.scaled_dot_product_attention, TF.linear
    call = (None, None, False, None, None, None, 0.0, False, None)
    _, decision = cache._decide(q, k, v, "auto", call)

    def busy(n: int) -> None:
        for _ in range(n):
            pass

    t0 = time.thread_time()
    busy(100_000)
    per = (time.thread_time() - t0) / 100_000
    tensors = (q, k, v)
    pieces = {
        "SDPA again (noise)": lambda: None,
        "a Python loop": functools.partial(busy, int(1e-6 / per)),
        "tensor metadata in Python (shape, dtype, device, requires_grad)": lambda: [
            (t.shape, t.dtype, t.device, t.requires_grad) for t in tensors],
        "the kernels' signature (C++)": lambda: module.signature(q, k, v, None, None),
        "the decision's lookup (_decide)": lambda: cache._decide(q, k, v, "auto", call),
        "the NaN/inf look (finite(q, k), C++)": lambda: decision.look(q, k, v, None),
    }  # fmt: skip
    print(machine_header())
    print("\n| between the linear and SDPA | alone µs | µs more per call |\n|---|---|---|")
    with torch.no_grad():
        base = lambda: (linear(x, w), sdpa(q, k, v))  # noqa: E731
        for name, piece in pieces.items():
            alone = statistics.median(per_call(piece, 2000) for _ in range(5)) * 1e6
            more = statistics.median(
                (per_call(lambda piece=piece: (linear(x, w), piece(), sdpa(q, k, v)), 10)
                 - per_call(base, 10)) for _ in range(rounds)
            ) * 1e6  # fmt: skip
            print(f"| {name} | {alone:.2f} | {more:.1f} |", flush=True)
        whole = statistics.median(
            (per_call(lambda: (linear(x, w), scaled_dot_product_attention(q, k, v)), 10)
             - per_call(base, 10)) for _ in range(rounds)
        ) * 1e6  # fmt: skip
        print(f"| the whole of qkv's call (scaled_dot_product_attention) | - | {whole:.1f} |")


def decode_vs_torch(rounds: int) -> None:
    """Tq = Tk <= 16 without grouped heads, where "auto" takes the decode kernel: its time
    against the torch backend's (both through qkv), per option; the SMALL_MASKED rule."""
    from qkv.kernels._native import native_level

    torch.set_num_threads(1)
    print(f"level {native_level()}: torch backend time / decode backend time (> 1: decode faster)")
    print("| case | full | causal | mask |\n|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for B, h in ((1, 4), (4, 8)):
        for dtype in (torch.float32, torch.bfloat16):
            for T in (4, 8, 16):
                q, k, v = (torch.randn(B, h, T, 64, generator=g).to(dtype) for _ in "qkv")
                cells = []
                for kind in GRID_KINDS:
                    kw = {"causal": kind == "causal"}
                    if kind == "mask":
                        kw = {"mask": masks.padding(torch.full((B,), T - T // 4), T)}
                    run = functools.partial(scaled_dot_product_attention, q, k, v, **kw)
                    with torch.no_grad():
                        ratio = paired(functools.partial(run, backend="torch"),
                                       functools.partial(run, backend="decode"), rounds)  # fmt: skip
                    cells.append(f"{ratio:.2f}")
                print(f"| B={B} h={h} T={T} {str(dtype)[6:]} | " + " | ".join(cells) + " |",
                      flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--grid", action="store_true", help="small calls against SDPA, every level")
    p.add_argument("--levels", nargs="*", default=[], help="with --grid: these levels only")
    p.add_argument("--grid-rounds", type=int, default=31)
    p.add_argument("--grid-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--look-parts", action="store_true", help="the look's share of a call")
    p.add_argument("--in-context", action="store_true", help="costs between two kernels")
    p.add_argument("--decode-vs-torch", action="store_true",
                   help="Tq = Tk <= 16: the decode kernel against torch (this QKV_ISA)")  # fmt: skip
    args = p.parse_args()
    if args.look_parts:
        return look_parts(args.grid_rounds)
    if args.in_context:
        return in_context(args.grid_rounds)
    if args.decode_vs_torch:
        return decode_vs_torch(args.grid_rounds)
    if args.grid_child:
        return grid_child(args.grid_rounds)
    if args.grid:
        return grid(args.levels, args.grid_rounds)
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
