"""bf16 flash attention on AMX against the machine's own limits and the peers, side by side.

    python bench/amx_flash.py                    # T = 4096, d = 128 and 64, full and causal
    python bench/amx_flash.py --threads 1 2 --T 4096 8192 --out bench/results/amx_flash.md

Every round runs, in turn and on the same inputs: the bf16 GEMM ``torch.matmul`` of 2048²
(oneDNN on AMX tiles: the rate a tuned GEMM reaches on this core), qkv's forward on its own
tile kernel (``QKV_BF16_MATMUL=amx``), the same call through oneDNN's brgemm on tiles (the
path it replaced, ``onednn``), PyTorch's SDPA in bf16 and OpenVINO's ScaledDotProductAttention
in bf16 (the bf16 peer; skipped if ``openvino`` is not installed: ``pip install -e .[bench]``).
Each figure is the best of its rounds (1 thread: the thread's own CPU time, so that time spent
descheduled by other processes is not counted; 2 threads: wall time).

Besides the ratios, each throughput is given as a share of two limits measured in the same
process (``bench/amx_peak.cpp``, built on first use): the GEMM's rate above, and the AMX
unit's own peak, tdpbf16ps on tiles that never leave the registers, with the core clock that
the same run measures (dependent imuls) rather than /proc/cpuinfo's nominal one.

The forward+backward row (d = 128, full) is qkv's autograd through the fused kernel against
SDPA's, both in bf16.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as TF  # noqa: E402

from _measure import attention_flops, fwd_bwd, machine_header, with_bf16_matmul  # noqa: E402
from qkv.kernels._native import native_ops  # noqa: E402
from qkv.kernels.flash import flash_attention  # noqa: E402

H = 4  # query heads (B = 1)


def amx_limits(threads: int) -> dict | str:
    """The AMX unit's register-tile peak (TFLOP/s, all threads) and the clock (GHz), or why
    they could not be measured."""
    try:
        from torch.utils import cpp_extension

        mod = cpp_extension.load(
            name="qkv_bench_amx_peak",
            sources=[str(Path(__file__).with_name("amx_peak.cpp"))],
            extra_cflags=["-O2", "-mamx-tile", "-mamx-bf16", "-mavx512f"],
            verbose=False,
        )
    except Exception as e:  # no compiler, or a compiler without AMX
        return f"not built: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
    try:
        best, ghz = 0.0, 0.0
        for _ in range(3):
            best = max(best, mod.amx_bf16_tflops(2_000_000))
            ghz = max(ghz, mod.clock_ghz(50_000_000))
    except RuntimeError as e:
        return f"not measured: {e}"
    return {"peak": best * threads, "ghz": ghz, "per_cycle": best * 1e3 / ghz}


def openvino_sdpa(q, k, v, causal: bool, threads: int):
    """OpenVINO's SDPA on q, k, v (bf16 in, bf16 out): a callable, or why there is none."""
    try:
        import openvino as ov
        import openvino.opset13 as ops
    except ImportError as e:
        return f"not installed ({e.name})"
    params = [ops.parameter(list(t.shape), ov.Type.bf16, name=n) for n, t in
              (("q", q), ("k", k), ("v", v))]  # fmt: skip
    model = ov.Model([ops.scaled_dot_product_attention(*params, causal=causal)], params, "sdpa")
    config = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "bf16"}
    try:
        req = ov.Core().compile_model(model, "CPU", config).create_infer_request()
        tensors = [ov.Tensor(t.view(torch.int16).numpy(), list(t.shape), ov.Type.bf16)
                   for t in (q, k, v)]  # fmt: skip
        req.infer(tensors)
        y = np.array(req.get_output_tensor(0).data).view(np.int16)
        y = torch.from_numpy(y).view(torch.bfloat16).view(q.shape[:-1] + v.shape[-1:])
        ref = TF.scaled_dot_product_attention(q, k, v, is_causal=causal)
        if not torch.allclose(y.float(), ref.float(), atol=3e-2):
            return "wrong answer"
    except Exception as e:  # an OpenVINO without this op or precision
        return f"failed: {str(e).splitlines()[0][:100]}"
    return lambda: req.infer(tensors)


def measure(calls: dict, rounds: int, clock) -> dict[str, float]:
    """Best time of each callable over interleaved rounds (one warm-up call each first)."""
    best = {}
    for f in calls.values():
        f()
    for _ in range(rounds):
        for name, f in calls.items():
            t = clock()
            f()
            best[name] = min(best.get(name, float("inf")), clock() - t)
    return best


def row(T: int, d: int, causal: bool, backward: bool, threads: int, rounds: int,
        limits: dict | str) -> list[str]:  # fmt: skip
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, T, d, dtype=torch.bfloat16, requires_grad=backward)
               for _ in range(3))  # fmt: skip
    a, b = (torch.randn(2048, 2048, dtype=torch.bfloat16) for _ in range(2))
    qkv_call = lambda: flash_attention(q, k, v, causal=causal)  # noqa: E731
    sdpa_call = lambda: TF.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    calls = {"gemm": lambda: a @ b}
    if backward:
        calls |= {"qkv": fwd_bwd(with_bf16_matmul(qkv_call, "amx"), (q, k, v)),
                  "sdpa": fwd_bwd(sdpa_call, (q, k, v))}  # fmt: skip
        peers = {}
    else:
        with torch.no_grad():
            calls |= {"qkv": with_bf16_matmul(qkv_call, "amx"), "qkv onednn": with_bf16_matmul(qkv_call, "onednn"),
                      "sdpa": sdpa_call}  # fmt: skip
        ov = openvino_sdpa(q.detach(), k.detach(), v.detach(), causal, threads)
        peers = {"openvino": ov}
        if callable(ov):
            calls["openvino"] = ov
    clock = time.thread_time if threads == 1 else time.perf_counter
    with torch.set_grad_enabled(backward):
        t = measure(calls, rounds, clock)
    gemm = 2 * 2048**3 / t["gemm"] / 1e12
    pairs = T * (T + 1) // 2 if causal else T * T
    flops = attention_flops(pairs, 1, H, d, backward)
    tf = flops / t["qkv"] / 1e12
    peak = limits["peak"] if isinstance(limits, dict) else None
    cells = [f"{'fwd+bwd' if backward else 'fwd'}", "causal" if causal else "full", str(T),
             str(d), f"{t['qkv'] * 1e3:.1f}", f"{tf:.3f}", f"{tf / gemm * 100:.0f} %",
             f"{tf / peak * 100:.0f} %" if peak else "-", f"{gemm:.3f}"]  # fmt: skip
    for name in ("qkv onednn", "sdpa", "openvino"):
        if name in t:
            cells.append(f"{t[name] / t['qkv']:.2f}x")
        elif name in peers:
            cells.append(str(peers[name]))
        else:
            cells.append("-")
    return cells


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--T", type=int, nargs="+", default=[4096])
    p.add_argument("--d", type=int, nargs="+", default=[128, 64])
    p.add_argument("--threads", type=int, nargs="+", default=[1])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--no-backward", action="store_true", help="forward rows only")
    p.add_argument("--out", type=Path, help="also write the table (markdown) here")
    args = p.parse_args()
    ops = native_ops()
    if ops is None or not ops.bf16_path().startswith("amx"):
        raise SystemExit(f"needs qkv's AMX path; this machine's bf16 path: "
                         f"{ops.bf16_path() if ops else 'no fused kernel'}")  # fmt: skip
    lines = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        limits = amx_limits(threads)
        lines += ["", machine_header(), f"bf16 path: {ops.bf16_path()}"]
        if isinstance(limits, dict):
            lines.append(f"AMX peak (register tiles): {limits['peak']:.2f} TFLOP/s on {threads} "
                         f"thread(s), clock {limits['ghz']:.2f} GHz, "
                         f"{limits['per_cycle']:.0f} flop/cycle per core")  # fmt: skip
        else:
            lines.append(f"AMX peak: {limits}")
        lines += ["", "| pass | structure | T | d | qkv ms | qkv TFLOP/s | of GEMM | of AMX peak "
                  "| GEMM TFLOP/s | vs oneDNN path | vs SDPA | vs OpenVINO |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        cases = [(T, d, c, False) for T in args.T for d in args.d for c in (False, True)]
        if not args.no_backward:
            cases.append((args.T[0], args.d[0], False, True))
        for T, d, causal, bwd in cases:
            cells = row(T, d, causal, bwd, threads, args.rounds, limits)
            lines.append("| " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
