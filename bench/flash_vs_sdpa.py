"""qkv "flash" against PyTorch's SDPA on dense attention, measured side by side (interleaved).

    python bench/flash_vs_sdpa.py --T 1024 4096 --dtypes fp32 bf16 --structures full causal
    python bench/flash_vs_sdpa.py --bf16 --T 4096 8192 --threads 2

Each repeat runs flash then SDPA on the same inputs, so machine load hits both alike; the
printed ratio is SDPA's best time / flash's best time (> 1 = flash faster). B=1, h=8, d=64,
1 torch thread by default (see README ``## Speed (issue 3)`` for why). The header names the
CPU and the bf16 matmul path of the fused kernel (``QKV_BF16_MATMUL``: AMX tiles, the AVX512_BF16
dot-product kernel, bf16 widened to fp32 for the fp32 kernel, or oneDNN's brgemm).

``--bf16``: one table for bf16, each repeat running in turn the fused kernel on its bf16 path,
the same kernel forced onto oneDNN's unpacked brgemm (``QKV_BF16_MATMUL=brgemm``), PyTorch's SDPA in
bf16, the fused kernel in fp32 and SDPA in fp32; ratios of best times, and the bf16 flash
throughput as a % of this run's measured bf16 matmul peak (the fp32 one where the kernel
widens bf16 to fp32; what ``torch.matmul`` reaches on 2048² here; the attention FLOPs are
those of ``bench/_measure.attention_flops``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.nn.functional as TF  # noqa: E402

from _measure import attention_flops, machine_header, matmul_peak_gflops, step, with_bf16_matmul  # noqa: E402
from qkv.kernels._native import native_ops, native_status  # noqa: E402
from qkv.kernels.flash import flash_attention  # noqa: E402

B, H, D = 1, 8, 64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def isa_path() -> str:
    """The fused kernel's bf16 matmul path here (with QKV_BF16_MATMUL as set), or why there is
    none."""
    ops = native_ops()
    if ops is None:
        return f"no fused kernel ({native_status()})"
    return ops.bf16_path() if hasattr(ops, "bf16_path") else "unknown (old kernel build)"


def calls(T: int, dtype: torch.dtype, causal: bool, backward: bool):
    """Two zero-argument callables (flash, sdpa) on the same random inputs."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g).to(dtype) for _ in range(3))
    for t in (q, k, v):
        t.requires_grad_(backward)

    flash = step(lambda: flash_attention(q, k, v, causal=causal), (q, k, v), backward)
    sdpa = step(lambda: TF.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v),
                backward)  # fmt: skip
    return flash, sdpa


def best_pair(a, b, reps: int) -> tuple[float, float]:
    a(), b()  # warm-up
    ta = tb = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a()
        t1 = time.perf_counter()
        b()
        t2 = time.perf_counter()
        ta, tb = min(ta, t1 - t0), min(tb, t2 - t1)
    return ta, tb


CLOCK = time.perf_counter  # --cpu-time: time.thread_time


def best_of(fns: list, reps: int) -> list[float]:
    """Best time of each callable, the callables run in turn in every repeat (interleaved)."""
    for f in fns:
        f()  # warm-up
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, f in enumerate(fns):
            t0 = CLOCK()
            f()
            best[i] = min(best[i], CLOCK() - t0)
    return best


def bf16_table(args) -> None:
    """The bf16 path against SDPA, the brgemm path and fp32, interleaved (see module doc)."""
    # where bf16 is widened to fp32 (no bf16 instructions), the fp32 peak is the limit (and
    # torch's own bf16 matmul there takes minutes at 2048²: not measured)
    widened = isa_path().startswith("widen")
    peak32 = matmul_peak_gflops(torch.float32, clock=CLOCK)
    peak16 = None if widened else matmul_peak_gflops(torch.bfloat16, clock=CLOCK)
    bf16_peak = "not measured (bf16 widened to fp32)" if widened else f"{peak16:.1f} GFLOP/s"
    print(f"measured matmul peak (torch 2048², this run): bf16 {bf16_peak}, "
          f"fp32 {peak32:.1f} GFLOP/s")  # fmt: skip
    peak, peak_name = (peak32, "fp32") if widened else (peak16, "bf16")
    print(
        "| T | structure | mode | flash bf16 ms | brgemm bf16 ms | sdpa bf16 ms | flash fp32 ms "
        "| sdpa fp32 ms | **sdpa/flash bf16** | brgemm/flash | **fp32/bf16 flash** "
        f"| % {peak_name} peak |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for T in args.T:
        reps = args.reps or (5 if T <= 1024 else 3)
        for st in args.structures:
            for mode in args.modes:
                causal, bwd = st == "causal", mode != "fwd"
                f16, s16 = calls(T, torch.bfloat16, causal, bwd)
                f32, s32 = calls(T, torch.float32, causal, bwd)
                fns = [f16, with_bf16_matmul(f16, "brgemm"), s16, f32, s32]
                tf, tb, ts, tf32, ts32 = best_of(fns, reps)
                pairs = T * T / (2 if causal else 1)
                flops = attention_flops(pairs, B, H, D, bwd)
                pct = 100 * flops / tf / 1e9 / peak
                print(
                    f"| {T} | {st} | {mode} | {tf * 1e3:.1f} | {tb * 1e3:.1f} | {ts * 1e3:.1f} "
                    f"| {tf32 * 1e3:.1f} | {ts32 * 1e3:.1f} | **{ts / tf:.2f}×** | {tb / tf:.2f}× "
                    f"| **{tf32 / tf:.2f}×** | {pct:.0f} % |",
                    flush=True,
                )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--T", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--structures", nargs="+", default=["full", "causal"])
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"])
    p.add_argument("--reps", type=int, default=None, help="default: 5 at T<=1024, else 3")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bf16", action="store_true", help="the bf16 table (see above)")
    p.add_argument(
        "--cpu-time", action="store_true",
        help="time the calling thread's CPU time (1 thread only): on a loaded machine it is "
        "not inflated by time slices given to other processes, as wall time is",
    )  # fmt: skip
    args = p.parse_args()
    if args.cpu_time and args.threads != 1:
        p.error("--cpu-time needs --threads 1 (other threads' time is not counted)")
    global CLOCK
    CLOCK = time.thread_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    print(
        f"{machine_header()}\nB={B} h={H} d={D}; machine shared: compare ratios; "
        f"{'CPU' if args.cpu_time else 'wall'} time"
    )
    if args.bf16:
        bf16_table(args)
        return
    print("| T | dtype | structure | mode | flash ms | sdpa ms | sdpa/flash |")
    print("|---|---|---|---|---|---|---|")
    for T in args.T:
        reps = args.reps or (5 if T <= 1024 else 3)
        for dt in args.dtypes:
            for st in args.structures:
                for mode in args.modes:
                    f, s = calls(T, DTYPES[dt], st == "causal", mode != "fwd")
                    tf, ts = best_pair(f, s, reps)
                    print(
                        f"| {T} | {dt} | {st} | {mode} | {tf * 1e3:.1f} | {ts * 1e3:.1f} "
                        f"| **{ts / tf:.2f}×** |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
