"""Attention variants on qkv's fused kernel against PyTorch's SDPA and FlexAttention.

    python bench/variants.py                       # both parts, 1 torch thread
    python bench/variants.py --part fused --T 1024 4096 --dtypes fp32 bf16
    python bench/variants.py --part blocks --T-blocks 16384

Part "fused": bias / ALiBi / relative table (T5) / soft-capping, causal, B=1 h=8 d=64, fused
flash vs SDPA given the equivalent float mask (bias + causal as one additive ``attn_mask``,
built once, not timed); SDPA has no soft-capping, so softcap is compared with SDPA's plain
causal call (what SDPA does without it). Forward (no_grad) and forward+backward. The ratio
is SDPA time / flash time (> 1: flash faster); peak memory of flash's ALiBi and softcap
forward shows O(T) growth (the float mask SDPA needs is h·T²·4 bytes).

Part "blocks": block masks at T=16384 (16 packed documents, prefix-LM, sink + window):
qkv's kernel with the block mask against (a) the same kernel on the same visited blocks with
every one treated as full (what those blocks cost densely, no masking), and (b) FlexAttention
compiled on CPU (``torch.compile(flex_attention)``, inference: it has no CPU backward);
compile time is reported apart, and the cost of building the block masks for both.

Every pair runs interleaved on the same inputs (machine load hits both alike); best of
``--reps``. Prints the CPU, the kernel's build flags and the ISA path.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as TF  # noqa: E402

from _measure import machine_header, peak_memory_mib, step  # noqa: E402
from qkv import masks  # noqa: E402
from qkv.block_mask import EMPTY, FULL, BlockMask  # noqa: E402
from qkv.kernels.flash import flash_attention, rel_dense  # noqa: E402

B, H, D = 1, 8, 64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def interleaved(fns: list, reps: int) -> list[float]:
    """Best time of each callable, run in turn ``reps`` times after one warm-up each."""
    for f in fns:
        f()
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, f in enumerate(fns):
            t = time.perf_counter()
            f()
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def _call(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` as a zero-argument callable (binds loop variables now)."""
    return lambda: fn(*args, **kwargs)


# --- part 1: fused variants vs SDPA with the float mask ------------------------------------


def fused_part(Ts: list[int], dtypes: list[str], reps: int) -> None:
    print("\n## bias / ALiBi / T5 table / softcap: fused flash vs SDPA + equivalent float mask")
    print("causal, B=1 h=8 d=64; ratio = SDPA / flash (> 1: flash faster)\n")
    print(f"{'T':>6} {'dtype':>5} {'variant':>8} {'mode':>8} {'flash ms':>9} {'SDPA ms':>9} "
          f"{'ratio':>6}")  # fmt: skip
    for T in Ts:
        causal = masks.causal(T)
        slopes = masks.alibi_slopes(H)
        g = torch.Generator().manual_seed(0)
        rel = torch.randn(H, 2 * T - 1, generator=g)
        dense = {
            "bias": torch.randn(1, H, T, T, generator=g),
            "alibi": masks.alibi_bias(H, T),
            "t5": rel_dense(rel, T, T),
        }
        for name in dtypes:
            dtype = DTYPES[name]
            q, k, v = (torch.randn(B, H, T, D, generator=g).to(dtype) for _ in range(3))
            for variant in ("bias", "alibi", "t5", "softcap"):
                if variant == "softcap":
                    fkw, am = dict(softcap=30.0), None
                else:
                    bias = dense["bias"].to(dtype)  # in the inputs' dtype, as SDPA's mask
                    fkw = {"bias": dict(bias=bias), "alibi": dict(alibi_slopes=slopes),
                           "t5": dict(rel_bias=rel)}[variant]  # fmt: skip
                    am = torch.where(causal, dense[variant], float("-inf")).to(dtype)
                for backward in (False, True):
                    for t in (q, k, v):
                        t.requires_grad_(backward)
                    flash_fn = _call(flash_attention, q, k, v, causal=True, **fkw)
                    sdpa_kw = dict(is_causal=True) if am is None else dict(attn_mask=am)
                    sdpa_fn = _call(TF.scaled_dot_product_attention, q, k, v, **sdpa_kw)
                    flash = step(flash_fn, (q, k, v), backward)
                    sdpa = step(sdpa_fn, (q, k, v), backward)
                    tf, ts = interleaved([flash, sdpa], reps)
                    mode = "fwd+bwd" if backward else "fwd"
                    print(f"{T:>6} {name:>5} {variant:>8} {mode:>8} {tf * 1e3:>9.1f} "
                          f"{ts * 1e3:>9.1f} {ts / tf:>6.2f}", flush=True)  # fmt: skip
                    for t in (q, k, v):
                        t.requires_grad_(False)
    print("\n## memory: peak RSS growth of one fused forward (fp32), vs the float mask SDPA needs")
    print(f"{'T':>6} {'ALiBi MiB':>10} {'softcap MiB':>12} {'out MiB':>8} {'h·T² mask MiB':>14}")
    for T in sorted(set(Ts) | {2 * max(Ts)}):
        q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
        slopes = masks.alibi_slopes(H)
        with torch.no_grad():
            m_a = peak_memory_mib(_call(flash_attention, q, k, v, causal=True, alibi_slopes=slopes))
            m_s = peak_memory_mib(_call(flash_attention, q, k, v, causal=True, softcap=30.0))
        out_mib = B * H * T * D * 4 / 2**20
        print(f"{T:>6} {m_a:>10.1f} {m_s:>12.1f} {out_mib:>8.1f} {H * T * T * 4 / 2**20:>14.0f}")


# --- part 2: block masks -------------------------------------------------------------------


def _dense_blocks(bm: BlockMask) -> BlockMask:
    """The same visited blocks, each treated as full: what they cost without any masking."""
    idx = torch.where(bm.index == EMPTY, EMPTY, FULL).to(torch.int32)
    tiles = torch.zeros(0, *bm.block_size, dtype=torch.bool)
    return BlockMask(bm.B, bm.H, bm.Tq, bm.Tk, bm.block_size, idx, tiles)


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def block_part(T: int, reps: int, dtypes: list[str], flex: bool) -> None:
    print(f"\n## block masks, T={T}, B=1 h=8 d=64, inference (FlexAttention has no CPU backward)")
    n_docs, window, sinks, prefix = 16, 1024, 4, T // 4
    g = torch.Generator().manual_seed(0)
    cuts = torch.sort(torch.randperm(T - 1, generator=g)[: n_docs - 1] + 1).values
    doc = torch.zeros(T, dtype=torch.long)
    doc[cuts] = 1
    doc = doc.cumsum(0)  # 16 documents of random lengths
    patterns = {
        "documents": (
            lambda: masks.document_mask(doc),
            lambda b, h, q, kv: (doc[q] == doc[kv]) & (kv <= q),
        ),
        "prefix-LM": (
            lambda: masks.prefix_lm_mask(prefix, T),
            lambda b, h, q, kv: (kv <= q) | (kv < prefix),
        ),
        "sink+window": (
            lambda: masks.sliding_window_mask(T, window, sinks=sinks),
            lambda b, h, q, kv: (kv <= q) & ((q - kv < window) | (kv < sinks)),
        ),
    }
    print(f"16 documents (random lengths); prefix {prefix}; window {window} + {sinks} sinks\n")
    print("### building the block mask (ms)")
    print("(qkv mask_fn: best / worst of 3 builds; Flex: its second build, the first may compile)")
    print(f"{'pattern':>12} {'qkv shortcut':>13} {'qkv mask_fn':>12} {'Flex create':>12}  blocks")
    built = {}
    flex_mods = _flex() if flex else None
    for name, (shortcut, fn) in patterns.items():
        bm, t_short = min((_timed(shortcut) for _ in range(3)), key=lambda x: x[1])
        fn_runs = [_timed(_call(masks.create_block_mask, fn, None, None, T, T)) for _ in range(3)]
        bm2 = fn_runs[0][0]
        t_fn_best, t_fn_worst = min(r[1] for r in fn_runs), max(r[1] for r in fn_runs)
        assert torch.equal(bm.index != EMPTY, bm2.index != EMPTY)
        t_flex = float("nan")
        fbm = None
        if flex_mods is not None and not isinstance(flex_mods, str):
            try:
                make = _call(flex_mods[1], fn, None, None, T, T, device="cpu")
                fbm, t_flex = _timed(make)
                _, t_flex = _timed(make)  # the second build (the first may compile)
            except Exception as e:  # noqa: BLE001 (a peer failing is reported, not fatal)
                flex_mods = f"create_block_mask failed: {type(e).__name__}: {e}"[:200]
        built[name] = (bm, fbm, fn)
        c = bm.counts()
        fn_ms = f"{t_fn_best * 1e3:.0f} / {t_fn_worst * 1e3:.0f}"
        print(f"{name:>12} {t_short * 1e3:>13.1f} {fn_ms:>12} {t_flex * 1e3:>12.0f}  "
              f"{c['empty']} empty / {c['full']} full / {c['partial']} partial")  # fmt: skip
    if isinstance(flex_mods, str) or flex_mods is None:
        print(f"\nFlexAttention skipped: {flex_mods or 'not requested (--no-flex)'}")
    compiled = None
    for dname in dtypes:
        dtype = DTYPES[dname]
        q, k, v = (torch.randn(B, H, T, D, generator=g).to(dtype) for _ in range(3))
        print(f"\n### attention, {dname} (ms); ratios: > 1 = qkv's block mask faster")
        print(f"{'pattern':>12} {'qkv':>8} {'same blocks dense':>18} {'dense/qkv':>10} "
              f"{'Flex':>8} {'Flex/qkv':>9}")  # fmt: skip
        for name, (bm, fbm, _fn) in built.items():
            dense_bm = _dense_blocks(bm)
            fns = [
                step(_call(flash_attention, q, k, v, mask=bm), (), False),
                step(_call(flash_attention, q, k, v, mask=dense_bm), (), False),
            ]
            flex_note = ""
            if fbm is not None and not isinstance(flex_mods, str):
                try:
                    if compiled is None:
                        compiled = torch.compile(flex_mods[0], dynamic=False)
                    flex_fn = _call(compiled, q, k, v, block_mask=fbm)
                    with torch.no_grad():
                        _, t_c = _timed(flex_fn)
                    flex_note = f"(first Flex call, compiling: {t_c:.1f} s)"
                    fns.append(step(flex_fn, (), False))
                except Exception as e:  # noqa: BLE001
                    flex_mods = f"flex_attention failed: {type(e).__name__}: {e}"[:200]
                    flex_note = f"Flex skipped: {flex_mods}"
            times = interleaved(fns, reps)
            tq, td = times[0], times[1]
            tflex = times[2] if len(times) > 2 else float("nan")
            print(f"{name:>12} {tq * 1e3:>8.1f} {td * 1e3:>18.1f} {td / tq:>10.2f} "
                  f"{tflex * 1e3:>8.1f} {tflex / tq:>9.2f}  {flex_note}", flush=True)  # fmt: skip


def shortcut_costs(T: int) -> None:
    """Building the shortcut block masks at a long T (best of 3, ms)."""
    g = torch.Generator().manual_seed(1)
    cuts = torch.sort(torch.randperm(T - 1, generator=g)[:15] + 1).values
    doc = torch.zeros(T, dtype=torch.long)
    doc[cuts] = 1
    doc = doc.cumsum(0)
    print(f"\n## shortcut block masks at T={T} (ms, best of 3)")
    for name, make in (
        ("documents (16)", _call(masks.document_mask, doc)),
        ("prefix-LM", _call(masks.prefix_lm_mask, T // 4, T)),
        ("sink+window", _call(masks.sliding_window_mask, T, 1024, sinks=4)),
    ):
        best = min(_timed(make)[1] for _ in range(3))
        print(f"{name:>15} {best * 1e3:8.1f}")


def _flex():
    """(flex_attention, create_block_mask) or the reason they cannot run here."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception as e:  # noqa: BLE001
        return f"import failed: {type(e).__name__}: {e}"
    return flex_attention, create_block_mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["fused", "blocks", "shortcuts", "both"], default="both")
    ap.add_argument("--T-shortcuts", type=int, default=65536)
    ap.add_argument("--T", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--T-blocks", type=int, default=16384)
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["fp32", "bf16"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_header())
    if args.part in ("fused", "both"):
        fused_part(args.T, args.dtypes, args.reps)
    if args.part in ("blocks", "both"):
        block_part(args.T_blocks, args.reps, args.dtypes, not args.no_flex)
    if args.part in ("shortcuts", "blocks", "both"):
        shortcut_costs(args.T_shortcuts)


if __name__ == "__main__":
    main()
