"""The issue's specific targets for bench/attention.py, each measured side by side."""

from __future__ import annotations

import torch
import torch.nn.functional as TF
from torch import nn

import qkv
from _measure import fwd_bwd, peak_memory_mib, time_call
from qkv import masks
from qkv.functional import scaled_dot_product_attention
from qkv.varlen import packed_mask, varlen_attention

H, D = 8, 64


def timed(fn, reps: int, warm: int) -> tuple[float, float]:
    """(seconds, peak MiB) of ``fn``."""
    seconds = time_call(fn, reps, warm)
    return seconds, peak_memory_mib(fn)


def _pair(name: str, ours, theirs, reps: int, warm: int, goal: str) -> list[str]:
    t_o, m_o = timed(ours, reps, warm)
    t_t, m_t = timed(theirs, reps, warm)
    return [
        f"| {name} | {t_o * 1e3:.0f} ms, {m_o:.0f} MiB | {t_t * 1e3:.0f} ms, {m_t:.0f} MiB "
        f"| **{t_t / t_o:.1f}×** faster, {m_t / max(m_o, 1e-9):.1f}× less memory | {goal} |"
    ]


def window_target(quick: bool) -> list[str]:
    T, w = (4096 if quick else 16384), 256
    q, k, v = (torch.randn(1, H, T, D) for _ in range(3))
    allowed = masks.sliding_window(T, T, w, causal=True)  # (T, T) dense, True = may attend
    lines = []
    with torch.no_grad():
        lines += _pair(
            f"window w={w}, T={T}, fp32 fwd (mask {allowed.numel() / 2**20:.0f} MiB prebuilt)",
            lambda: scaled_dot_product_attention(q, k, v, causal=True, window=w),
            lambda: TF.scaled_dot_product_attention(q, k, v, attn_mask=allowed),
            1, 1, "≥10× faster, ≥10× less memory",
        )  # fmt: skip
    for t in (q, k, v):
        t.requires_grad_()
    lines += _pair(
        f"window w={w}, T={T}, fp32 fwd+bwd",
        fwd_bwd(lambda: scaled_dot_product_attention(q, k, v, causal=True, window=w), (q, k, v)),
        fwd_bwd(lambda: TF.scaled_dot_product_attention(q, k, v, attn_mask=allowed), (q, k, v)),
        1, 0, "≥10× faster, ≥10× less memory",
    )  # fmt: skip
    return lines


def packed_target(quick: bool) -> list[str]:
    n, L = (4, 1024) if quick else (16, 1024)
    cu = torch.arange(n + 1) * L
    q, k, v = (torch.randn(n * L, H, D) for _ in range(3))  # packed (total, h, d)
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, h, total, d)
    allowed = packed_mask(cu)  # (total, total) block-diagonal
    lines = []
    with torch.no_grad():
        lines += _pair(
            f"packed {n}×{L}, fp32 fwd",
            lambda: varlen_attention(q, k, v, cu),
            lambda: TF.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed),
            1, 1, "≥3× faster",
        )  # fmt: skip
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    qg, kg, vg = (t.transpose(0, 1).unsqueeze(0).detach().requires_grad_() for t in (q, k, v))
    lines += _pair(
        f"packed {n}×{L}, fp32 fwd+bwd",
        fwd_bwd(lambda: varlen_attention(ql, kl, vl, cu), (ql, kl, vl)),
        fwd_bwd(lambda: TF.scaled_dot_product_attention(qg, kg, vg, attn_mask=allowed), (qg, kg, vg)),
        1, 0, "≥3× faster",
    )  # fmt: skip
    return lines


def mha_target(quick: bool) -> list[str]:
    T = 1024 if quick else 4096
    theirs = nn.MultiheadAttention(H * D, H, batch_first=True).eval()
    ours = qkv.MultiHeadAttention.from_torch(theirs).eval()
    x = torch.randn(1, T, H * D)
    blocked = ~masks.causal(T, T)  # PyTorch's convention: True = blocked
    lines = []
    with torch.no_grad():
        for w in (True, False):
            lines += _pair(
                f"MHA causal inference T={T} vs nn.MultiheadAttention(attn_mask, need_weights={w})",
                lambda: ours(x, causal=True),
                lambda w=w: theirs(x, x, x, attn_mask=blocked, need_weights=w)[0],
                3, 1, "≥3×",
            )  # fmt: skip
    return lines


def memory_target() -> list[str]:
    """Computed (not run) memory for T=65536, h=8, d=64, fp32, forward+backward."""
    T, f32 = 65536, 4
    act = H * T * D * f32  # one (1, h, T, d) tensor
    N, bq, bk = H, 256, 512
    blocks = 4 * N * bq * bk * f32  # s/p, dp/ds, tanh and a cast copy at most, per block
    # q, k, v, out, dout, dq/dk/dv accumulators, dq·c copy, q·c copy; lse and D (h, T)
    flash = 10 * act + blocks + 2 * H * T * f32
    scores = H * T * T * f32
    math_path = 3 * scores  # autograd keeps scores, scaled (or masked) and weights
    return [
        f"| memory T={T}, h={H}, d={D}, fp32 fwd+bwd (computed) | flash ≈ {flash / 2**30:.2f} GiB "
        f"| math ≥ {math_path / 2**30:.0f} GiB (each (h,T,T) fp32 tensor is "
        f"{scores / 2**30:.0f} GiB; autograd keeps scores, scaled, weights, ...) "
        f"| flash {'<' if flash < 4 * 2**30 else '≥'} 4 GiB | <4 GiB vs >100 GiB |"
    ]


def summary(rows: list[dict]) -> list[str]:
    """Dense/causal/bf16 ratios from the main table."""
    ref = {(r["structure"], r["dtype"], r["T"]): r for r in rows if r["method"] == "torch sdpa"}
    out = []
    for prefix, Tmin, goal in (("qkv auto", 0, "≥1.0×"), ("qkv flash", 1024, "≥0.8× (fp32)")):
        for dtype in ("fp32", "bf16"):
            ratios = [
                s["fwd_ms"] / r["fwd_ms"]
                for r in rows
                if r["method"].startswith(prefix) and r["dtype"] == dtype
                and r["structure"] in ("full", "causal") and r["T"] >= Tmin
                and (s := ref.get((r["structure"], r["dtype"], r["T"])))
            ]  # fmt: skip
            if ratios:
                out.append(
                    f"| {prefix} vs torch SDPA, {dtype}, full+causal, T≥{Tmin} (fwd) | min "
                    f"{min(ratios):.2f}× | max {max(ratios):.2f}× | {len(ratios)} cases "
                    f"| {goal if dtype == 'fp32' or prefix == 'qkv auto' else '≥1.3× at T≥4096'} |"
                )
    return out


def run_targets(only: set[str], rows: list[dict], peaks: dict, quick: bool) -> str:
    lines = []
    if rows:
        lines += summary(rows)
    if "window" in only:
        lines += window_target(quick)
    if "packed" in only:
        lines += packed_target(quick)
    if "mha" in only:
        lines += mha_target(quick)
    if "memory" in only:
        lines += memory_target()
    if not lines:
        return ""
    head = "| target | qkv | PyTorch | ratio | goal |\n|---|---|---|---|---|"
    return "Targets (issue 3)\n\n" + head + "\n" + "\n".join(lines)
