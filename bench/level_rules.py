"""The measurements behind ``backend="auto"``'s rules for a kernel level (qkv.dispatch).

    python bench/level_rules.py                      # the level this CPU runs
    QKV_ISA=portable python bench/level_rules.py     # another level this CPU can run

For each row of the rule table that can pick a fused kernel, that kernel against PyTorch's
SDPA on the same inputs, side by side (best of a few runs each, interleaved per case), 1 torch
thread by default: flash forward and forward+backward (causal, full, a window of 256) and the
decode kernel for 1-16 queries per kv head (GQA 4:1, d = 128) over 512-16384 keys. A ratio
above 1 means the fused kernel is faster. The header names the CPU, its vector features and
the kernel level that ran.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from _measure import machine_header, time_call  # noqa: E402
from qkv.functional import scaled_dot_product_attention as sdpa  # noqa: E402


def versus(backend: str, q, k, v, grad: bool, n: int, **kw) -> tuple[float, float]:
    """(ms of ``backend``, ms of torch) for one case."""
    def run(name):
        def f():
            out = sdpa(q, k, v, backend=name, **kw)
            if grad:
                out.sum().backward()
        return f

    with torch.set_grad_enabled(grad):
        return time_call(run(backend), n) * 1e3, time_call(run("torch"), n) * 1e3


def line(name: str, a: float, b: float) -> None:
    print(f"| {name} | {a:.2f} | {b:.2f} | **{b / a:.2f}×** |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip", nargs="*", default=[], choices=["flash", "decode"])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print("".join(f"- {line}\n" for line in machine_header().splitlines()))
    print("| case | fused ms | torch SDPA ms | torch / fused |\n|---|---|---|---|")
    if "flash" not in args.skip:
        for T in (256, 1024, 4096):
            n = 5 if T <= 1024 else 2
            for dtype in (torch.bfloat16, torch.float32):
                qkv = [torch.randn(1, 8, T, 64, dtype=dtype, requires_grad=True) for _ in "qkv"]
                name = f"flash fwd+bwd causal {str(dtype)[6:]} T={T}"
                line(name, *versus("flash", *qkv, True, n, causal=True))
            if T < 1024:
                continue
            for dtype in (torch.float32, torch.bfloat16):
                qkv = [torch.randn(1, 8, T, 64, dtype=dtype) for _ in "qkv"]
                line(f"flash window 256 {str(dtype)[6:]} T={T}",
                     *versus("flash", *qkv, False, n, window=256))  # fmt: skip
                line(f"flash fwd full {str(dtype)[6:]} T={T}", *versus("flash", *qkv, False, n))
                line(f"flash fwd causal {str(dtype)[6:]} T={T}",
                     *versus("flash", *qkv, False, n, causal=True))  # fmt: skip
    if "decode" not in args.skip:
        for dtype in (torch.float32, torch.bfloat16):
            for Tk in (512, 4096, 16384):
                k, v = (torch.randn(1, 8, Tk, 128, dtype=dtype) for _ in range(2))
                for Tq in (1, 4, 16):
                    q = torch.randn(1, 32, Tq, 128, dtype=dtype)
                    n = max(5, int(2e5 / Tk))
                    line(f"decode {str(dtype)[6:]} Tk={Tk} Tq={Tq} ({4 * Tq} rows per kv head)",
                         *versus("decode", q, k, v, False, n, causal=True))  # fmt: skip


if __name__ == "__main__":
    main()
