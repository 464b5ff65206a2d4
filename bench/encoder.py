"""Encoder speed: all-MiniLM-L6-v2 through qkv vs HuggingFace BertModel (eager and sdpa).

Two workloads, forward only, fp32, ``torch.inference_mode``:

* ``64 × ~16``: 64 sentences of 8–24 tokens (mean ≈ 16), padded to the longest;
* ``8 × 512``: 8 full-length sequences, no padding.

Every model runs the same weights on the same inputs (checked first); ``--reps`` timed runs
per model, interleaved round-robin so that a busy machine slows every model alike; the table
shows the best and the median. Ratios are ``best time(HF) / best time(qkv)`` (> 1 means qkv
is faster). Targets: ≥ 1.0× HF sdpa, ≥ 1.5× HF eager.

The column ``qkv+sdpa*`` is an experiment: the same qkv model with
``qkv.functional.scaled_dot_product_attention`` swapped, for this process only, for PyTorch's
fused SDPA (same mask convention: True = may attend). It shows what the encoder gains once
qkv's attention dispatches to a fast backend; nothing in ``src/`` is changed.

    PYTHONPATH=src python bench/encoder.py [--reps 5] [--device cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing downloads

import torch  # noqa: E402
import torch.nn.functional as TF  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from tqdm import tqdm  # noqa: E402

import qkv.functional  # noqa: E402
from _measure import machine_header  # noqa: E402
from qkv import pretrained  # noqa: E402


@contextlib.contextmanager
def torch_sdpa_inside():
    """Swap qkv's attention for PyTorch's fused SDPA while the block runs (weights: unchanged)."""
    original = qkv.functional.scaled_dot_product_attention

    def fused(q, k, v, *, mask=None, bias=None, return_weights=False, dropout_p=0.0, **kw):
        if return_weights or bias is not None or kw.get("window") or kw.get("softcap"):
            return original(q, k, v, mask=mask, bias=bias, dropout_p=dropout_p,
                            return_weights=return_weights, **kw)  # fmt: skip
        return TF.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=kw.get("causal", False),
            scale=kw.get("scale"),
        )  # fmt: skip

    qkv.functional.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        qkv.functional.scaled_dot_product_attention = original


def make_batch(B: int, lengths: list[int], device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random word-piece ids ``[CLS] ... [SEP]`` of the given lengths, padded with 0."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1996, 29000, (n,), generator=g)
        ids[i, 0], ids[i, n - 1] = 101, 102
        mask[i, :n] = 1
    tt = torch.zeros_like(ids)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device),
            "token_type_ids": tt.to(device)}  # fmt: skip


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="all-MiniLM-L6-v2")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import BertModel

    ours = pretrained.load(args.model, device=args.device)
    src = str(ours.source_dir)
    hf = {
        impl: BertModel.from_pretrained(src, attn_implementation=impl).to(args.device).eval()
        for impl in ("eager", "sdpa")
    }
    g = torch.Generator().manual_seed(0)
    short = torch.randint(8, 25, (64,), generator=g).tolist()
    workloads = {
        "64×~16 padded": make_batch(64, short, args.device),
        "8×512": make_batch(8, [512] * 8, args.device, seed=1),
    }
    runners = {
        "qkv": lambda b: ours(**b).last_hidden_state,
        "qkv+sdpa*": None,  # filled below: ours, inside torch_sdpa_inside()
        "HF eager": lambda b: hf["eager"](**b).last_hidden_state,
        "HF sdpa": lambda b: hf["sdpa"](**b).last_hidden_state,
    }

    def ours_sdpa(b):
        with torch_sdpa_inside():
            return ours(**b).last_hidden_state

    runners["qkv+sdpa*"] = ours_sdpa

    console = Console(width=150)
    console.print(machine_header(), highlight=False)
    console.print(
        f"device={args.device} threads={torch.get_num_threads()} "
        f"reps={args.reps} warmup={args.warmup}, model={src}"
    )
    table = Table(
        title="encoder forward: best ms (median ms); ratio = HF / qkv on best, > 1 = qkv faster"
    )
    for col in ("workload", *runners, "qkv/eager", "qkv/sdpa", "qkv+sdpa*/sdpa"):
        table.add_column(col, justify="right")
    with torch.inference_mode():
        for name, batch in workloads.items():
            real = batch["attention_mask"].bool()
            ref = runners["HF sdpa"](batch)
            for rname, run in runners.items():  # same numbers before timing anything
                err = (run(batch) - ref)[real].abs().max().item()
                assert err < 1e-3, f"{rname} differs from HF sdpa by {err} on {name}"
            times: dict[str, list[float]] = {r: [] for r in runners}
            for rep in tqdm(range(args.warmup + args.reps), desc=name, leave=False):
                for rname, run in runners.items():
                    sync(args.device)
                    t0 = time.perf_counter()
                    run(batch)
                    sync(args.device)
                    if rep >= args.warmup:
                        times[rname].append(time.perf_counter() - t0)
            best = {r: 1e3 * min(t) for r, t in times.items()}
            med = {r: 1e3 * statistics.median(t) for r, t in times.items()}
            table.add_row(
                name, *(f"{best[r]:.0f} ({med[r]:.0f})" for r in runners),
                f"{best['HF eager'] / best['qkv']:.2f}×", f"{best['HF sdpa'] / best['qkv']:.2f}×",
                f"{best['HF sdpa'] / best['qkv+sdpa*']:.2f}×",
            )  # fmt: skip
    console.print(table)
    console.print("* qkv+sdpa*: experiment, qkv's attention swapped for torch SDPA in this process")


if __name__ == "__main__":
    main()
