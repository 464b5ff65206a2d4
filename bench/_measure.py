"""Timing, peak memory and FLOP counting for bench/attention.py.

Peak memory is the growth of the process's resident set during one (separate, untimed)
call: ``malloc_trim(0)`` first hands memory freed by earlier calls back to the OS, then the
kernel's high-water mark (``VmHWM``) is reset through ``/proc/self/clear_refs``; after the
call the peak is ``VmHWM`` minus the resident set before it. (Forcing every allocation
through ``mmap`` instead would make the numbers exact but slows allocation-heavy code 10-50×,
so timings and memory are taken in separate calls with the ordinary allocator.)
"""

from __future__ import annotations

import ctypes
import gc
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc: no trimming, numbers may undercount reused memory
    _LIBC = None


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_memory_mib(fn: Callable[[], object]) -> float:
    """Peak growth of the resident set (MiB) while ``fn()`` runs (its result is dropped)."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        return float("nan")
    before = _status_kib("VmRSS")
    out = fn()
    peak = _status_kib("VmHWM")
    del out
    gc.collect()
    return (peak - before) / 1024


def time_call(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Best wall time (s) of ``fn()`` over ``repeats`` runs after ``warmup`` runs.

    The minimum, not the median: the 2-core machine is shared, and the fastest run is the
    one least disturbed by other processes (the same rule for every method).
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def step(fn: Callable[[], torch.Tensor], inputs, backward: bool) -> Callable[[], object]:
    """One timed step: ``fn()`` under no_grad, or ``fn()`` and its backward (grads of
    ``inputs`` cleared after each run so they never accumulate)."""

    def run():
        if not backward:
            with torch.no_grad():
                return fn()
        out = fn()
        out.backward(torch.ones_like(out))
        for t in inputs:
            t.grad = None

    return run


def matmul_peak_gflops(
    dtype: torch.dtype,
    n: int = 2048,
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """This machine's measured ``n×n`` matmul throughput (best of ``repeats``), GFLOP/s.

    ``clock``: ``time.thread_time`` measures this thread's CPU time (1 torch thread).
    """
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = clock()
        a @ b
        best = min(best, clock() - t)
    return 2 * n**3 / best / 1e9


def attention_flops(pairs: int, B: int, h: int, d: int, backward: bool) -> float:
    """Useful FLOPs: ``4·pairs·d`` per head forward (q kᵀ and p v); backward 2.5× that."""
    fwd = 4.0 * pairs * d * B * h
    return fwd * 3.5 if backward else fwd


def threads_note() -> str:
    return f"torch threads={torch.get_num_threads()}, cpus={os.cpu_count()}"


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), for the header of every benchmark."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def vector_features() -> str:
    """The CPU's vector features that pick qkv's kernel level (AVX, FMA, AMX, NEON, SVE)."""
    from qkv.kernels._levels import cpu_features

    vec = sorted(f for f in cpu_features() if f.startswith(("avx", "fma", "amx", "asimd", "sve")))
    return " ".join(vec) or "none of avx/amx/asimd/sve"


def machine_header() -> str:
    """The lines every benchmark starts with: the CPU, its vector features, torch and its
    threads, and the level and paths of qkv's kernels that ran (loading them if need be)."""
    from qkv.kernels._native import native_status

    return (
        f"CPU: {cpu_name()}; vector features: {vector_features()}\n"
        f"torch {torch.__version__} (ATen CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} thread(s)\n"
        f"qkv kernels: {native_status()}"
    )


def written(huge: bool, nbytes: int = 2**30) -> torch.Tensor:
    """``nbytes`` of fp32 that have been written (a fresh mapping reads the kernel's shared zero
    page, about twice the true speed): on 2 MiB pages where Linux offers them (``huge``, as
    a ``qkv.KVCache`` holds its buffers) or on plain 4 KiB pages."""
    from qkv import _pages

    x = _pages.empty((nbytes // 4,), torch.float32, "cpu") if huge else torch.empty(nbytes // 4)
    x.fill_(1.0)
    return x


def peak_reader() -> Callable[[torch.Tensor], float] | str:
    """``read(x)``: a prefetching fp32 read loop (bench/read_peak.cpp, built here once), the
    machine's streaming read limit as a plain loop reaches it; or why it could not be built."""
    try:
        from torch.utils import cpp_extension

        from qkv.kernels import _levels

        # the flags of the level this CPU runs (not -march=native): the level is in the name,
        # so a build cache shared with another CPU never loads this one
        build, _ = _levels.select_level("")
        flags = ["-O3", "-fopenmp", *_levels.level_named(build).flags]
        module = cpp_extension.load(
            name=f"qkv_bench_read_peak_{build}",
            sources=[str(Path(__file__).with_name("read_peak.cpp"))],
            extra_cflags=flags,
            verbose=False,
        )
    except Exception as e:  # no compiler: the benchmark goes on without this column
        return f"not built: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
    return module.read_sum


def with_bf16_matmul(fn, path: str | None):
    """``fn`` run with ``QKV_BF16_MATMUL=path`` (read by the kernel on each call); None: as
    set."""
    if path is None:
        return fn

    def run():
        old = os.environ.get("QKV_BF16_MATMUL")
        os.environ["QKV_BF16_MATMUL"] = path
        try:
            return fn()
        finally:
            if old is None:
                os.environ.pop("QKV_BF16_MATMUL", None)
            else:
                os.environ["QKV_BF16_MATMUL"] = old

    return run


def fwd_bwd(run, inputs):
    """``run()``'s output backpropagated (ones as the gradient), the inputs' grads cleared."""

    def fn():
        out = run()
        out.backward(torch.ones_like(out))
        for t in inputs:
            t.grad = None

    return fn
