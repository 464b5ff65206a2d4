"""Attention speed and memory: qkv's backends against PyTorch, measured side by side.

    python bench/attention.py              # full table + targets (~10-20 min on 2 cores)
    python bench/attention.py --quick      # T in {256, 1024}, a minute or two
    python bench/attention.py --only window,packed,mha,memory   # just the issue's targets
    python bench/attention.py --T 1024 4096 --dtypes bf16 --structures causal

Prints one table (forward and forward+backward time, GFLOP/s, fraction of this machine's
measured matmul peak, peak memory, speed ratio vs PyTorch's default SDPA), then the issue's
targets. Saves bench/results/attention.{md,csv,png}. Shapes: B=1, h=8, d=64 (d_model=512
for the module rows). Timings are the best of several runs (5 at T<=1024, 2 at 4096, 1 above),
after one warm-up run.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.nn.functional as TF  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from tqdm import tqdm  # noqa: E402

import qkv  # noqa: E402
from _measure import (  # noqa: E402
    attention_flops,
    machine_header,
    matmul_peak_gflops,
    threads_note,
)
from _targets import run_targets, timed  # noqa: E402
from qkv import masks  # noqa: E402
from qkv.functional import explain_dispatch, scaled_dot_product_attention  # noqa: E402
from qkv.kernels._blocks import Structure  # noqa: E402

B, H, D, WINDOW = 1, 8, 64, 256
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DENSE_LIMIT = 1024  # methods that hold (B, h, T, T) run up to this T
MODULE_LIMIT = 4096  # module rows (projections + attention) run up to this T
RESULTS = Path(__file__).resolve().parent / "results"

METHODS = [
    "qkv auto", "qkv flash", "qkv math", "torch sdpa", "torch math", "naive",
    "nn.MHA w=True", "nn.MHA w=False", "qkv MHA",
]  # fmt: skip


def structure_kwargs(structure: str) -> dict:
    return {"full": {}, "causal": {"causal": True}, "window": {"causal": True, "window": WINDOW}}[
        structure
    ]


def dense_mask(structure: str, T: int) -> torch.Tensor | None:
    """The structure as a dense bool mask (True = may attend), for libraries without it."""
    if structure == "window":
        return masks.sliding_window(T, T, WINDOW, causal=True)
    return masks.causal(T, T) if structure == "causal" else None


def make_call(method: str, structure: str, T: int, dtype: torch.dtype, backward: bool):
    """A zero-argument callable running ``method`` once (forward, or forward+backward)."""
    g = torch.Generator().manual_seed(0)
    kw = structure_kwargs(structure)
    if "MHA" in method:
        x = torch.randn(B, T, H * D, generator=g).to(dtype).requires_grad_(backward)
        allowed = dense_mask(structure, T)
        if method == "qkv MHA":
            mod = qkv.MultiHeadAttention(H * D, H).to(dtype)
            run = lambda: mod(x, **kw)  # noqa: E731
        else:
            mod = nn.MultiheadAttention(H * D, H, batch_first=True).to(dtype)
            blocked = None if allowed is None else ~allowed  # PyTorch: True = blocked
            w = method.endswith("True")
            run = lambda: mod(x, x, x, attn_mask=blocked, need_weights=w)[0]  # noqa: E731
        mod.train(backward)
    else:
        q, k, v = (torch.randn(B, H, T, D, generator=g).to(dtype) for _ in range(3))
        for t in (q, k, v):
            t.requires_grad_(backward)
        allowed = dense_mask(structure, T)
        if method.startswith("qkv"):
            backend = method.split()[1]
            run = lambda: scaled_dot_product_attention(q, k, v, **kw, backend=backend)  # noqa: E731
        elif method == "torch sdpa" and structure == "window":
            run = lambda: TF.scaled_dot_product_attention(q, k, v, attn_mask=allowed)  # noqa: E731
        elif method == "torch sdpa":
            run = lambda: TF.scaled_dot_product_attention(q, k, v, is_causal=bool(kw))  # noqa: E731
        elif method == "torch math":

            def run():
                with sdpa_kernel(SDPBackend.MATH):
                    return TF.scaled_dot_product_attention(q, k, v, attn_mask=allowed)

        else:  # naive softmax(q kᵀ/√d) v

            def run():
                s = (q @ k.transpose(-2, -1)) / math.sqrt(D)
                if allowed is not None:
                    s = s.masked_fill(~allowed, float("-inf"))
                return torch.softmax(s, dim=-1) @ v

    if not backward:

        def fwd():
            with torch.no_grad():
                return run()

        return fwd
    grad = None

    def fwd_bwd():
        nonlocal grad
        out = run()
        grad = torch.randn_like(out) if grad is None else grad
        out.backward(grad)

    return fwd_bwd


def applicable(method: str, structure: str, T: int) -> bool:
    if method in ("qkv math", "torch math", "naive", "nn.MHA w=True") and T > DENSE_LIMIT:
        return False
    if "MHA" in method and T > MODULE_LIMIT:
        return False
    if structure == "window" and method in ("torch math", "nn.MHA w=True"):
        return False  # same dense work as "naive" / "nn.MHA w=False"
    return True


def repeats_for(T: int, quick: bool) -> tuple[int, int]:
    """(repeats, warmup): fewer at large T."""
    if quick:
        return 2, 1
    return (5, 1) if T <= 1024 else (2, 1) if T <= 4096 else (1, 1)


def measure_row(method, structure, T, dtype_name, peaks, args) -> dict:
    dtype = DTYPES[dtype_name]
    pairs = Structure(T, T, structure != "full", WINDOW if structure == "window" else None)
    n_pairs = pairs.visible_pairs()
    reps, warm = repeats_for(T, args.quick)
    reps = args.reps or reps
    row = {"structure": structure, "dtype": dtype_name, "T": T, "method": method}
    if method == "qkv auto":
        q = torch.empty(B, H, T, D, dtype=dtype)
        row["method"] = (
            f"qkv auto→{explain_dispatch(q, q, q, **structure_kwargs(structure)).backend}"
        )
    for phase, backward in (("fwd", False), ("fb", True)):
        if backward and args.no_backward:
            continue
        fn = make_call(method, structure, T, dtype, backward)
        seconds, mem = timed(fn, reps, warm)
        gflops = attention_flops(n_pairs, B, H, D, backward) / seconds / 1e9
        row[f"{phase}_ms"] = seconds * 1e3
        row[f"{phase}_gflops"] = gflops
        row[f"{phase}_peak_frac"] = gflops / peaks[dtype_name]
        row[f"{phase}_mib"] = mem
    return row


def format_table(rows: list[dict]) -> str:
    ref = {(r["structure"], r["dtype"], r["T"]): r for r in rows if r["method"] == "torch sdpa"}
    head = (
        "| structure | dtype | T | method | fwd ms | fwd GF/s | fwd %peak | fwd MiB | vs SDPA fwd "
        "| f+b ms | f+b GF/s | f+b MiB | vs SDPA f+b |"
    )
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        s = ref.get((r["structure"], r["dtype"], r["T"]), {})

        def ratio(phase, r=r, s=s):
            key = f"{phase}_ms"
            return f"{s[key] / r[key]:.2f}×" if key in s and key in r else "-"

        def num(key, fmt, r=r):
            return format(r[key], fmt) if key in r else "-"

        lines.append(
            f"| {r['structure']} | {r['dtype']} | {r['T']} | {r['method']} | {num('fwd_ms', '.1f')} "
            f"| {num('fwd_gflops', '.0f')} | {100 * r.get('fwd_peak_frac', float('nan')):.0f}% "
            f"| {num('fwd_mib', '.0f')} | {ratio('fwd')} | {num('fb_ms', '.1f')} "
            f"| {num('fb_gflops', '.0f')} | {num('fb_mib', '.0f')} | {ratio('fb')} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Forward time vs T, log-log: one panel per (dtype, structure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({r["dtype"] for r in rows})
    structures = [s for s in ("full", "causal", "window") if any(r["structure"] == s for r in rows)]
    methods = sorted({r["method"] for r in rows})
    style = {m: (f"C{i % 10}", "osv^D<>p*h"[i % 10]) for i, m in enumerate(methods)}
    fig, axes = plt.subplots(
        len(dtypes), len(structures), figsize=(5 * len(structures), 4 * len(dtypes)), squeeze=False
    )
    for axrow, dtype in zip(axes, dtypes):
        for ax, structure in zip(axrow, structures):
            sel = [r for r in rows if r["structure"] == structure and r["dtype"] == dtype]
            for method in sorted({r["method"] for r in sel}):
                pts = sorted((r["T"], r["fwd_ms"]) for r in sel if r["method"] == method)
                color, marker = style[method]
                ax.loglog(*zip(*pts), marker=marker, color=color, label=method)
            ax.set(title=f"{structure}, {dtype} (forward)", xlabel="T", ylabel="ms")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="T in {256, 1024}, 2 repeats")
    p.add_argument("--only", default="table,window,packed,mha,memory",
                   help="comma list of: table, window, packed, mha, memory")  # fmt: skip
    p.add_argument("--T", type=int, nargs="+", default=None)
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--structures", nargs="+", default=["full", "causal", "window"])
    p.add_argument("--methods", nargs="+", default=METHODS)
    p.add_argument("--no-backward", action="store_true", help="forward only")
    p.add_argument("--reps", type=int, default=None, help="timed runs per cell (default by T)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on the shared 2-core machine, 2 OpenMP threads "
                   "made every small op wait for a descheduled partner)")  # fmt: skip
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    only = set(args.only.split(","))
    Ts = args.T or ([256, 1024] if args.quick else [256, 1024, 4096, 8192, 16384])
    torch.manual_seed(0)
    peaks = {name: matmul_peak_gflops(dt) for name, dt in DTYPES.items()}
    print(f"matmul peak: fp32 {peaks['fp32']:.0f} GF/s, bf16 {peaks['bf16']:.0f} GF/s; "
          f"{threads_note()}; B={B} h={H} d={D} window={WINDOW}")  # fmt: skip
    print(machine_header())
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    if "table" in only:
        todo = [
            (m, s, T, dt)
            for s in args.structures
            for dt in args.dtypes
            for T in Ts
            for m in args.methods
            if applicable(m, s, T)
        ]
        for m, s, T, dt in tqdm(todo, desc="table", file=sys.stderr):
            rows.append(measure_row(m, s, T, dt, peaks, args))
        table = format_table(rows)
        print(table)
        suffix = "-quick" if args.quick else ""
        (args.out / f"attention{suffix}.md").write_text(
            f"matmul peak fp32 {peaks['fp32']:.0f} GF/s, bf16 {peaks['bf16']:.0f} GF/s; "
            f"{threads_note()}\n\n{table}\n"
        )
        with open(args.out / f"attention{suffix}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
            writer.writeheader()
            writer.writerows(rows)
        plot(rows, args.out / f"attention{suffix}.png")
    targets = run_targets(only, rows, peaks, quick=args.quick)
    if targets:
        print(targets)
        (args.out / ("targets-quick.md" if args.quick else "targets.md")).write_text(targets + "\n")


if __name__ == "__main__":
    main()
