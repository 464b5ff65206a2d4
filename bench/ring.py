"""Ring attention: per-rank peak memory and time, P = 2 processes vs one process (CPU, gloo).

    PYTHONPATH=src python bench/ring.py                      # T = 32768 and 65536
    PYTHONPATH=src python bench/ring.py --T 8192 --P 2 4 --no-backward   # quick look

Every measurement runs in a fresh spawned process (one torch thread each) so that its peak
resident memory is its own. Rows:

* ``torch sdpa, 1 proc``: PyTorch's ``scaled_dot_product_attention`` (its fused CPU
  kernel) on the whole sequence — the reference point for speed;
* ``flash, 1 proc``: ``qkv.kernels.flash.flash_attention`` on the whole sequence (the fused
  C++ kernel that the ring's blocks run too);
* ``ring, 1 proc``: ``qkv.distributed.ring_attention`` with no process group (the same block
  code, the whole sequence on one process);
* ``ring, P proc``: the sequence zigzag-sharded over P gloo processes; the worst rank.

``peak MiB`` is the rise of the process's peak RSS over its baseline (after imports and a
warm-up call on a short sequence), inputs and gradients included. ``wait`` is the time ranks sat waiting on the network (communication not hidden
behind computation); ``comm`` is the time of the same P-1 K/V hops done alone (no compute),
so ``comm / time`` is the share of the time the transfers would cost if not overlapped.
``cpu s`` is the worst rank's process CPU time (all its threads, gloo's included): on a
machine whose cores are busy with other work, it is what the wall time would be on free
cores, less any waiting; the ``vs`` columns compare wall times and, in brackets, CPU times.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as TF
from tqdm import tqdm

from qkv.distributed import record_ring_stats, ring_attention
from qkv.distributed.ring import _make_ring
from qkv.kernels.flash import flash_attention


def _status_mib(field: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (peak resident) of this process, in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    """Reset this process's peak RSS to its current RSS (Linux >= 4.0: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _worker(rank: int, world: int, port: int, cfg: dict, out_dir: str) -> None:
    torch.set_num_threads(1)
    if cfg["impl"] == "ring" and world > 1:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=timedelta(seconds=1800),
        )  # fmt: skip
    B, h, d, T = cfg["B"], cfg["h"], cfg["d"], cfg["T"]

    def attend(q, k, v, T):
        if cfg["impl"] == "sdpa":
            return TF.scaled_dot_product_attention(q, k, v, is_causal=True)
        if cfg["impl"] == "flash":
            return flash_attention(q, k, v, causal=True)
        return ring_attention(q, k, v, causal=True, layout="zigzag", seq_len=T)

    # warm up on a short sequence first: the first calls page in library code and thread
    # pools (tens of MiB of RSS that have nothing to do with the sequence length)
    small = [torch.randn(B, h, 256 // world, d, requires_grad=True) for _ in range(3)]
    attend(*small, 256).sum().backward()
    del small
    T_local = T // world  # T is a multiple of 2·world here: equal zigzag shards
    _reset_peak()
    base = _status_mib("VmRSS")
    q, k, v = (torch.randn(B, h, T_local, d, requires_grad=True) for _ in range(3))
    res = {"rank": rank}
    t0, c0 = time.perf_counter(), time.process_time()
    with record_ring_stats() as stats:
        out = attend(q, k, v, T)
        res["fwd_s"] = time.perf_counter() - t0
        if cfg["backward"]:
            t1 = time.perf_counter()
            out.backward(torch.ones_like(out))
            res["bwd_s"] = time.perf_counter() - t1
    res["time_s"] = time.perf_counter() - t0
    res["cpu_s"] = time.process_time() - c0
    res["peak_mib"] = _status_mib("VmHWM") - base
    res["wait_s"] = stats.wait_s
    if cfg["impl"] == "ring" and world > 1:  # the same K/V hops alone: the transfer cost
        ring = _make_ring(T_local, None, "zigzag", None, T)
        kv = [k.detach(), v.detach()]  # (B, h, T_local, d) each
        hops = (world - 1) * (3 if cfg["backward"] else 1)  # bwd: K/V again + dK/dV
        dist.barrier()
        t2 = time.perf_counter()
        for step in range(hops):
            nxt = [torch.empty_like(t) for t in kv]
            ring.wait(ring.exchange(kv, nxt), "benchmark block", step)
            kv = nxt
        res["comm_s"] = time.perf_counter() - t2
        dist.destroy_process_group()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def run(cfg: dict, world: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _worker, args=(world, port, cfg, out_dir), nprocs=world, start_method="spawn"
        )
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, nargs="+", default=[32768, 65536])
    p.add_argument("--P", type=int, nargs="+", default=[2], help="processes for the ring")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--h", type=int, default=2)
    p.add_argument("--d", type=int, default=32)
    p.add_argument("--no-backward", dest="backward", action="store_false")
    p.add_argument("--skip-sdpa", action="store_true")
    args = p.parse_args()

    # big buffers come from mmap and go back to the OS when freed, so that peak RSS follows
    # the live tensors rather than what glibc's heap keeps cached (children inherit this)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(256 * 1024))
    plans = []
    for T in args.T:
        if any(T % (2 * P) for P in args.P):
            raise SystemExit(f"--T {T} must be a multiple of 2·P for every P in {args.P}")
        if not args.skip_sdpa:
            plans.append((T, "sdpa", 1))
        plans += [(T, "flash", 1), (T, "ring", 1)] + [(T, "ring", P) for P in args.P]
    rows = []
    for T, impl, world in tqdm(plans, desc="bench/ring.py", unit="run"):
        cfg = dict(T=T, impl=impl, B=args.B, h=args.h, d=args.d, backward=args.backward)
        res = run(cfg, world)
        worst = max(res, key=lambda r: r["time_s"])
        label = {"sdpa": "torch sdpa", "flash": "flash"}.get(impl, "ring")
        rows.append((T, f"{label}, {world} proc", worst, res))

    from _measure import machine_header

    what = "forward+backward" if args.backward else "forward"
    print("\n" + machine_header())
    print(
        f"\ncausal attention {what}, fp32, B={args.B} h={args.h} d={args.d}, zigzag shards, "
        f"1 torch thread per process, load average {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} CPUs"
    )
    print(
        f"{'T':>6}  {'run':<18} {'time s':>8} {'cpu s':>7} {'fwd s':>7} {'peak MiB/rank':>14} "
        f"{'wait s':>7} {'comm s':>7} {'comm/time':>9} {'time vs 1 proc':>15} "
        f"{'mem vs 1 proc':>14} {'vs flash':>14} {'vs sdpa':>14}"
    )
    one, ref = {}, {}
    for T, name, worst, res in rows:
        if name in ("flash, 1 proc", "torch sdpa, 1 proc"):
            ref[(T, name.split(",")[0])] = (worst["time_s"], max(r["cpu_s"] for r in res))
    for T, name, worst, res in rows:
        peak = max(r["peak_mib"] for r in res)
        cpu = max(r["cpu_s"] for r in res)
        if name == "ring, 1 proc":
            one[T] = (worst["time_s"], peak)
        comm = worst.get("comm_s")
        t_ratio = m_ratio = ""
        if name.startswith("ring") and T in one:
            t_ratio = f"{worst['time_s'] / one[T][0]:.2f}x"
            m_ratio = f"{peak / one[T][1]:.2f}x"
        vs = []
        for other in ("flash", "torch sdpa"):  # time / other's time (> 1: slower)
            wall, c = ref.get((T, other), (None, None))
            vs.append(f"{worst['time_s'] / wall:.2f}x ({cpu / c:.2f}x)" if wall else "")
        print(
            f"{T:>6}  {name:<18} {worst['time_s']:>8.2f} {cpu:>7.2f} {worst['fwd_s']:>7.2f} "
            f"{peak:>14.0f} {worst['wait_s']:>7.3f} "
            f"{comm if comm is not None else float('nan'):>7.3f} "
            f"{(comm / worst['time_s']) if comm else float('nan'):>9.1%} {t_ratio:>15} "
            f"{m_ratio:>14} {vs[0]:>14} {vs[1]:>14}"
        )

    # what grows with T: the fixed part (BLAS buffers, score tiles) cancels in the difference
    Ts = sorted({T for T, *_ in rows})
    if len(Ts) >= 2:
        lo_T, hi_T = Ts[0], Ts[-1]
        print(f"\npeak MiB/rank that grows with T (peak at T={hi_T} minus peak at T={lo_T}):")
        grow = {}
        for name in dict.fromkeys(n for _, n, *_ in rows):
            peaks = {T: max(r["peak_mib"] for r in res) for T, n, _, res in rows if n == name}
            grow[name] = peaks[hi_T] - peaks[lo_T]
        for name, g in grow.items():
            ratio = g / grow["ring, 1 proc"] if grow.get("ring, 1 proc") else float("nan")
            print(f"  {name:<18} {g:>7.0f} MiB   ({ratio:.2f}x ring, 1 proc)")


if __name__ == "__main__":
    main()
