"""Two or more builds of qkv side by side: the same kernel calls timed in alternating processes.

    python bench/builds_ab.py --build old=/tmp/old/src --build new=src --build new-avx2=src:avx2

A build is ``NAME=SRC[:LEVEL]``: the ``src`` folder of a qkv checkout (another commit's, say)
and optionally the kernel level it is forced to (``QKV_ISA``). Each round runs every
build in a fresh process, one after the other, each timing all the cases; the table keeps
each build's best time and its ratio to the first build (above 1: faster than the first).
Each process also times torch SDPA on the same inputs where there is one, so every build gets
a ratio to torch measured beside it. The header names the CPU, its vector features and each
build's kernel status (level, prebuilt or compiled on first use).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve()

# name: what it times (the worker below builds each case's inputs and calls)
CASES = {
    "flash-fp32-causal-4096": "flash fwd, fp32, causal, (1, 8, 4096, 64)",
    "flash-fp32-full-1024": "flash fwd, fp32, full, (1, 8, 1024, 64)",
    "flash-bf16-causal-4096": "flash fwd, bf16, causal, (1, 8, 4096, 64)",
    "flash-bf16-full-1024": "flash fwd, bf16, full, (1, 8, 1024, 64)",
    "flash-bf16-causal-1024-bwd": "flash fwd+bwd, bf16, causal, (1, 8, 1024, 64)",
    "flash-fp32-causal-2048-bwd": "flash fwd+bwd, fp32, causal, (1, 8, 2048, 64)",
    "flash-bf16-causal-2048-bwd": "flash fwd+bwd, bf16, causal, (1, 8, 2048, 64)",
    "decode-fp32": "decode, fp32 cache, q (1, 32, 1, 128) over (1, 8, 16384, 128)",
    "decode-bf16": "decode, bf16 cache, same shapes",
    "decode-int8": "decode, int8 cache, same shapes",
    "decode-fp32-tq8": "decode, fp32 cache, q (1, 32, 8, 128) over (1, 8, 4096, 128), causal",
    # the same at a short and a long cache (keys: the suffix)
    **{f"decode-{dt}-{n}": f"decode, {dt} cache, q (1, 32, 1, 128) over (1, 8, {keys}, 128)"
       for n, keys in (("4k", 4096), ("64k", 65536)) for dt in ("fp32", "bf16", "int8")},
    "int8-linear-32": "int8 linear, (32, 1024) x (4096, 1024)ᵀ",
    "greedy-32": "shipped fr-en, greedy, 32 sentences of 14 tokens, 16 new tokens",
}

_KEYS = {"4k": 4096, "64k": 65536}  # decode cases: the cache's keys by the name's suffix


def best_ms(fn, budget: float = 1.0, least: int = 3) -> float:
    fn()  # warm-up (plans, packing, first-touch)
    best, n, t0 = float("inf"), 0, time.perf_counter()
    while n < least or time.perf_counter() - t0 < budget:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        n += 1
    return best * 1e3


def worker(case: str) -> dict:
    """Times one case with the qkv on ``sys.path`` (and torch SDPA beside it where fitting)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    out = {}
    kind, dt = case.split("-")[:2]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}.get(dt)
    if kind == "flash":
        from qkv.kernels.flash import flash_attention

        T, grad = (4096 if "4096" in case else 2048 if "2048" in case else 1024), "bwd" in case
        causal = "causal" in case
        q, k, v = (torch.randn(1, 8, T, 64, dtype=dtype, requires_grad=grad) for _ in "qkv")

        def run(f):
            def go():
                with torch.set_grad_enabled(grad):
                    o = f(q, k, v, causal=causal)
                    if grad:
                        o.sum().backward()
                        q.grad = k.grad = v.grad = None
            return go

        out["qkv"] = best_ms(run(flash_attention))
        out["torch"] = best_ms(run(lambda q, k, v, causal: F.scaled_dot_product_attention(
            q, k, v, is_causal=causal)))
    elif kind == "decode":
        from qkv.cache import KVCache
        from qkv.kernels.decode import decode_attention

        Tq, Tk = (8, 4096) if case.endswith("tq8") else (1, _KEYS.get(case.split("-")[-1], 16384))
        kf, vf = torch.randn(1, 8, Tk, 128), torch.randn(1, 8, Tk, 128)
        cache = KVCache(capacity=Tk, dtype=dtype)
        k, v = cache.update(kf if dtype == torch.int8 else kf.to(dtype),
                            vf if dtype == torch.int8 else vf.to(dtype))
        q = torch.randn(1, 32, Tq, 128, dtype=torch.float32 if dtype == torch.int8 else dtype)
        causal = Tq > 1
        with torch.no_grad():
            out["qkv"] = best_ms(lambda: decode_attention(q, k, v, causal=causal))
            if dtype != torch.int8:  # torch reads the same cache (its own GQA)
                m = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq) if causal else None
                out["torch"] = best_ms(lambda: F.scaled_dot_product_attention(
                    q, k, v, attn_mask=m, enable_gqa=True))
    elif kind == "int8":
        from qkv.kernels.int8 import int8_linear, quantize_weight

        w, x = torch.randn(4096, 1024), torch.randn(32, 1024)
        pw = quantize_weight(w)
        with torch.no_grad():
            out["qkv"] = best_ms(lambda: int8_linear(x, pw))
            out["torch"] = best_ms(lambda: F.linear(x, w))  # fp32, what int8 replaces
    elif kind == "greedy":
        from qkv.generate import greedy_search
        from qkv.translate import load_translator

        model, _ = load_translator("fr-en")
        model.eval()
        g = torch.Generator().manual_seed(102)
        src = torch.randint(4, model.cfg.src_vocab_size, (32, 14), generator=g)
        out["qkv"] = best_ms(lambda: greedy_search(model, src, max_new_tokens=16,
                                                   min_new_tokens=16), budget=3.0)
    else:
        raise SystemExit(f"--worker: unknown case {case!r}")
    return out


def worker_all(cases: list[str]) -> dict:
    from qkv.kernels._native import native_status

    res = {"status": native_status()}
    for case in cases:
        if case == "status":
            continue
        try:
            res[case] = worker(case)
        except Exception as e:  # one case's failure (an API the older build lacks) is shown
            res[case] = {"error": f"{type(e).__name__}: {e}"[:160]}
    return res


def run_build(build: tuple[str, str, str | None], cases: list[str], threads: int) -> dict:
    """All ``cases`` in one fresh process of ``build`` (its kernel status under "status")."""
    name, src, level = build
    env = {k: v for k, v in os.environ.items() if k not in ("QKV_ISA", "PYTHONPATH")}
    env.update(PYTHONPATH=src, OMP_NUM_THREADS=str(threads))
    if level:
        env["QKV_ISA"] = level
    p = subprocess.run([sys.executable, str(HERE), "--worker", *cases, "--threads", str(threads)],
                       env=env, capture_output=True, text=True, timeout=1800)
    if p.returncode:
        err = (p.stderr.strip().splitlines() or ["?"])[-1][:160]
        return {"status": f"failed: {err}", **{c: {"error": err} for c in cases}}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", action="append", default=[], metavar="NAME=SRC[:LEVEL]")
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker:
        print(json.dumps(worker_all(args.worker)))
        return
    if len(args.build) < 2:
        p.error(f"--build: expected at least two builds, got {len(args.build)}")
    builds = []
    for b in args.build:
        name, _, rest = b.partition("=")
        src, _, level = rest.partition(":")
        if not name or not Path(src, "qkv").is_dir():
            p.error(f"--build: expected NAME=SRC[:LEVEL] with SRC/qkv a folder, got {b!r}")
        builds.append((name, str(Path(src).resolve()), level or None))

    sys.path.insert(0, str(HERE.parents[1] / "src"))
    from _measure import cpu_name, vector_features

    print(f"- CPU: {cpu_name()}; vector features: {vector_features()}")
    print(f"- torch {torch.__version__}, {args.threads} thread(s), best of {args.rounds} rounds")
    for b in builds:  # also builds a level compiled on first use, outside the timings
        print(f"- {b[0]} ({b[1]}{', QKV_ISA=' + b[2] if b[2] else ''}): "
              f"{run_build(b, ['status'], args.threads)['status']}", flush=True)
    best: dict = {}
    for r in range(args.rounds):
        for b in builds:
            res_all = run_build(b, args.cases, args.threads)
            for case in args.cases:
                res = res_all[case]
                for key in ("qkv", "torch", "error"):
                    if key in res:
                        old = best.get((case, b[0], key), 1e18)
                        best[case, b[0], key] = res[key] if key == "error" else min(old, res[key])
        print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    first = builds[0][0]
    head = " | ".join(f"{n} ms | {n} vs {first} | {n} vs torch" for n, _, _ in builds)
    print(f"\n| case | {head} |\n|---|" + "---|" * (3 * len(builds)))
    for case in args.cases:
        cells = []
        for n, _, _ in builds:
            ms, ref, tm = (best.get((case, n, "qkv")), best.get((case, first, "qkv")),
                           best.get((case, n, "torch")))
            if ms is None:
                cells.append(f"{best.get((case, n, 'error'), '—')} | | ")
                continue
            vs = f"**{ref / ms:.2f}×**" if ref else "—"
            cells.append(f"{ms:.2f} | {vs} | {f'{tm / ms:.2f}×' if tm else '—'}")
        print(f"| {CASES[case]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
