"""qkv "flash" against PyTorch's SDPA on dense attention, measured side by side (interleaved).

    python bench/flash_vs_sdpa.py --T 1024 4096 --dtypes fp32 bf16 --structures full causal

Each repeat runs flash then SDPA on the same inputs, so machine load hits both alike; the
printed ratio is SDPA's best time / flash's best time (> 1 = flash faster). B=1, h=8, d=64,
1 torch thread by default (see README ``## Speed (issue 3)`` for why).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.nn.functional as TF  # noqa: E402

from qkv.kernels.flash import flash_attention  # noqa: E402

B, H, D = 1, 8, 64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def calls(T: int, dtype: torch.dtype, causal: bool, backward: bool):
    """Two zero-argument callables (flash, sdpa) on the same random inputs."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g).to(dtype) for _ in range(3))
    for t in (q, k, v):
        t.requires_grad_(backward)

    def wrap(fn):
        def run():
            if not backward:
                with torch.no_grad():
                    return fn()
            out = fn()
            out.backward(torch.ones_like(out))
            for t in (q, k, v):
                t.grad = None

        return run

    flash = wrap(lambda: flash_attention(q, k, v, causal=causal))
    sdpa = wrap(lambda: TF.scaled_dot_product_attention(q, k, v, is_causal=causal))
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--T", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--structures", nargs="+", default=["full", "causal"])
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"])
    p.add_argument("--reps", type=int, default=None, help="default: 5 at T<=1024, else 3")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), B={B} h={H} d={D}")
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
