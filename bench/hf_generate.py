"""Hugging Face ``generate`` on a Llama-shaped model: ``attn_implementation="sdpa"`` vs "qkv".

    python bench/hf_generate.py            # 12 layers, d_model 768, GQA 12/4; prefill 1k, 8k
    python bench/hf_generate.py --small    # 4 layers, d_model 256, GQA 4/2; prefill 256, 1k
    python bench/hf_generate.py --prefill 1024 --decode 64 --threads 1

One model with random weights (fp32, CPU), run with both attention implementations side by
side, interleaved so that both see the same machine load. Prints, per prompt length, the
prefill time (one forward over the prompt filling the KV cache, logits of the last token
only) and the decode speed of ``generate`` (greedy, tokens/s, over the cache), and the
ratio qkv/sdpa (> 1: qkv faster). The generated tokens are checked equal. Timings are the
best of ``--repeats`` runs after one warm-up; on a machine shared with other work, read the
ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import qkv.hf  # noqa: E402, F401  (registers "qkv")
from _measure import machine_header  # noqa: E402

IMPLS = ("sdpa", "qkv")


def build(args: argparse.Namespace) -> transformers.LlamaForCausalLM:
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=args.d_ff,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.prefill) + args.decode + 8,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


class StepClock(transformers.LogitsProcessor):
    """Called by ``generate`` once per new token: the time of each call."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def measure(model, ids: torch.Tensor, n_decode: int, repeats: int) -> dict[str, dict]:
    """Prefill time (s), decode tokens/s and generated tokens per implementation.

    Decode speed is read inside one ``generate`` call: the time between the first new token
    (right after the prefill) and the last, over ``n_decode`` steps on the cache. Each
    quantity is the best of ``repeats`` runs after one warm-up; the two implementations
    alternate run by run, so a burst of load on the machine hits both.
    """
    B = ids.shape[0]
    t_pre = {i: float("inf") for i in IMPLS}
    tps = {i: 0.0 for i in IMPLS}
    tokens = {}
    with torch.no_grad():
        for rep in range(repeats + 1):
            for impl in IMPLS:
                model.set_attn_implementation(impl)
                t = time.perf_counter()
                model(input_ids=ids, use_cache=True, logits_to_keep=1)
                pre = time.perf_counter() - t
                clock = StepClock()
                tokens[impl] = model.generate(
                    input_ids=ids, max_new_tokens=n_decode + 1, min_new_tokens=n_decode + 1,
                    do_sample=False, pad_token_id=0,
                    logits_processor=transformers.LogitsProcessorList([clock]),
                )  # fmt: skip
                if rep:  # rep 0 is the warm-up
                    t_pre[impl] = min(t_pre[impl], pre)
                    rate = B * n_decode / max(clock.times[-1] - clock.times[0], 1e-9)
                    tps[impl] = max(tps[impl], rate)
    return {"prefill": t_pre, "tps": tps, "tokens": tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--small", action="store_true", help="a quick run on a smaller model")
    p.add_argument("--prefill", type=int, nargs="+", default=None, help="prompt lengths")
    p.add_argument("--decode", type=int, default=None, help="generated tokens per run")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    small = args.small
    args.prefill = args.prefill or ([256, 1024] if small else [1024, 8192])
    args.decode = args.decode or (16 if small else 32)
    args.layers = args.layers or (4 if small else 12)
    args.d_model = args.d_model or (256 if small else 768)
    if small and args.heads == 12:
        args.heads, args.kv_heads = 4, 2  # head dim 64, as in the full model
    args.d_ff = int(8 * args.d_model / 3 // 64 * 64)
    for name in ("decode", "batch", "layers", "d_model", "heads", "kv_heads", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.d_model % args.heads or args.heads % args.kv_heads:
        p.error(f"--d-model ({args.d_model}) must divide by --heads ({args.heads}) and --heads by "
                f"--kv-heads ({args.kv_heads})")  # fmt: skip
    if min(args.prefill) < 1:
        p.error(f"--prefill lengths must be >= 1, got {args.prefill}")
    if args.threads:
        torch.set_num_threads(args.threads)

    model = build(args)
    n_params = sum(p.numel() for p in model.parameters()) / 1e6
    print(machine_header())
    print(f"cpus={os.cpu_count()}; transformers {transformers.__version__}")  # fmt: skip
    print(f"Llama-shaped, random weights, fp32: {args.layers} layers, d_model {args.d_model}, "
          f"heads {args.heads} (kv {args.kv_heads}), d_ff {args.d_ff}, vocab {args.vocab} "
          f"({n_params:.0f}M params); batch {args.batch}; best of {args.repeats}")  # fmt: skip
    print(f"{'prompt':>7} {'what':<22} {'sdpa':>10} {'qkv':>10} {'qkv/sdpa':>9}")
    g = torch.Generator().manual_seed(1)
    for T in args.prefill:
        ids = torch.randint(3, args.vocab, (args.batch, T), generator=g)
        r = measure(model, ids, args.decode, args.repeats)
        prefill, tps, tokens = r["prefill"], r["tps"], r["tokens"]
        same = torch.equal(tokens["sdpa"], tokens["qkv"])
        p_ratio = prefill["sdpa"] / prefill["qkv"]
        d_ratio = tps["qkv"] / tps["sdpa"]
        print(f"{T:>7} {'prefill (s)':<22} {prefill['sdpa']:>10.3f} {prefill['qkv']:>10.3f} "
              f"{p_ratio:>8.2f}×")  # fmt: skip
        print(f"{T:>7} {f'decode {args.decode} tok (tok/s)':<22} {tps['sdpa']:>10.1f} "
              f"{tps['qkv']:>10.1f} {d_ratio:>8.2f}×  tokens equal: {same}")  # fmt: skip
        if not same:
            sys.exit("qkv and sdpa generated different tokens")
    model.set_attn_implementation("sdpa")


if __name__ == "__main__":
    main()
