"""qkv's int8 linear layer against fp32 and PyTorch's own dynamic int8 linear.

    PYTHONPATH=src python bench/int8_linear.py              # 1 thread
    PYTHONPATH=src python bench/int8_linear.py --threads 2

The translator's shapes: M = 1..160 rows (beams × sentences), K = 256 or 1024 inputs,
N = 256, 768, 1024 or 8000 (the vocabulary) outputs. Per shape, the methods are timed
round-robin (each round calls every method once, ``--rounds`` rounds; the best time of each),
so that the load of the shared machine falls on all of them alike:

  fp32 F.linear      torch.nn.functional.linear
  fp32 prepacked     qkv.models.incremental.SmallBatchLinear (what the decoder runs now:
                     oneDNN's prepacked weight for M > 1, a transposed weight for M = 1)
  torch dyn-int8     torch.ao.nn.quantized.dynamic.Linear (PyTorch's quantized engine)
  qkv int8           qkv.kernels.int8.SmallBatchInt8Linear (the kernel, direct call)

Ratios are the fp32 methods' time over qkv int8's (> 1: int8 faster). The CPU, the int8
path taken (``avx512_vnni`` or ``portable``) and PyTorch's quantized engine are printed.
"""

from __future__ import annotations

import argparse
import time
import warnings
from functools import partial

import torch
import torch.nn.functional as TF

from _measure import machine_header
from qkv.kernels.int8 import SmallBatchInt8Linear, int8_path
from qkv.models.incremental import SmallBatchLinear

SHAPES = [(256, 256), (256, 768), (256, 1024), (1024, 256), (256, 8000)]  # (K, N)
ROWS = [1, 5, 32, 160]


def torch_dynamic(lin: torch.nn.Linear):
    """PyTorch's dynamic-quantized int8 linear of ``lin``, or the reason it is missing."""
    try:
        from torch.ao.nn.quantized.dynamic import Linear

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the quantized tensors' deprecation notice
            return Linear.from_float(_with_qconfig(lin))
    except Exception as e:  # noqa: BLE001 (any failure: the peer is skipped, with the reason)
        return f"{type(e).__name__}: {e}"


def _with_qconfig(lin: torch.nn.Linear) -> torch.nn.Linear:
    from torch.ao.quantization import default_dynamic_qconfig

    lin.qconfig = default_dynamic_qconfig
    return lin


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_header())
    print(f"int8 linears {int8_path()} | quantized engine {torch.backends.quantized.engine} | {args.threads} thread(s)")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    names = ["fp32 F.linear", "fp32 prepacked", "torch dyn-int8", "qkv int8"]
    print(f"{'M':>4} {'K':>5} {'N':>5} " + " ".join(f"{n:>15}" for n in names)
          + "   F.linear/int8 prepacked/int8 dyn/int8")  # fmt: skip
    skipped = None
    for M in ROWS:
        for K, N in SHAPES:
            lin = torch.nn.Linear(K, N)
            with torch.no_grad():
                lin.weight.normal_(0, K**-0.5, generator=g)
            w, b = lin.weight.detach(), lin.bias.detach()
            x = torch.randn(M, K, generator=g)
            fp32_packed = SmallBatchLinear(w, b)
            ours = SmallBatchInt8Linear(w, b)
            dyn = torch_dynamic(lin)
            methods = {
                "fp32 F.linear": partial(TF.linear, x, w, b),
                "fp32 prepacked": partial(fp32_packed, x),
                "qkv int8": partial(ours, x),
            }
            if isinstance(dyn, str):
                skipped = dyn
            else:
                methods["torch dyn-int8"] = partial(dyn, x)
            reps = max(1, min(200, int(2e7 / (M * K * N))))  # calls per timing: ~ms each
            best = dict.fromkeys(methods, float("inf"))
            with torch.inference_mode():
                for f in methods.values():  # warm-up (packing, first-call costs)
                    f()
                for _ in range(args.rounds):
                    for name, f in methods.items():
                        t0 = time.perf_counter()
                        for _ in range(reps):
                            f()
                        best[name] = min(best[name], (time.perf_counter() - t0) / reps)
            us = {k: v * 1e6 for k, v in best.items()}
            cells = " ".join(f"{us[n]:>13.1f}us" if n in us else f"{'-':>15}" for n in names)
            q = us["qkv int8"]
            dyn_ratio = (
                f"{us['torch dyn-int8'] / q:>8.2f}x" if "torch dyn-int8" in us else "       -"
            )
            print(f"{M:>4} {K:>5} {N:>5} {cells}   {us['fp32 F.linear'] / q:>12.2f}x "
                  f"{us['fp32 prepacked'] / q:>12.2f}x {dyn_ratio}", flush=True)  # fmt: skip
    if skipped:
        print(f"torch dyn-int8 skipped: {skipped}")


if __name__ == "__main__":
    main()
