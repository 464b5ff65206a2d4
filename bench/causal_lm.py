"""End to end: a decoder-only LM generating after long prompts, against its memory-bound limit.

    PYTHONPATH=src python bench/causal_lm.py                  # prompts 1k, 8k, 32k (slow)
    PYTHONPATH=src python bench/causal_lm.py --quick          # prompts 1k, 8k; 32 new tokens
    PYTHONPATH=src python bench/causal_lm.py --prompts 4096 --threads 1 --cache-dtype bf16
    PYTHONPATH=src python bench/causal_lm.py --prompts 32768 --random-cache   # decode only

The model: :class:`qkv.models.CausalLM`, 12 layers, d_model 768, 12 query heads over 4
key/value heads (GQA), RoPE, d_ff 3072, vocab 32000, random weights (speed only). For each
prompt length: prefill (in chunks of ``--chunk`` tokens, over the KV cache), then
``--new`` greedy tokens one at a time, as :func:`qkv.generate.generate` makes them: through
the prepared decoder (:class:`qkv.models.lm_decoder.LMDecoder`; ``--module-forward`` calls
the model's own forward per token instead). Each runs twice: attention through qkv
(``backend="auto"``) and through torch SDPA (``backend="torch"``, PyTorch's fused kernel with
``enable_gqa``), the rest of the model identical: its linear layers packed for few-row
inputs (:func:`qkv.kernels.packed.pack_linears`; ``--no-pack`` keeps ``nn.Linear``).

Printed per row: prefill seconds; decode tokens/s (from the median step); the share of
decode time spent inside attention (timed around each attention call); and the decode
speed as a fraction of its memory-bound limit: every step must read all the weights
plus the whole KV cache once, so the limit is ``1 ÷ (weight bytes ÷ read bandwidth + mean
KV bytes per step ÷ read bandwidth on the cache's pages)``: the weights sit on 4 KiB pages,
the cache's buffers on 2 MiB pages where Linux offers them (``qkv._pages``), and each kind
is read at its own speed. The bandwidths are measured before and after each round, the
higher reading taken, over 1 GiB written first (reading fresh ``torch.empty`` memory hits
the kernel's shared zero page and reports about twice the truth): by torch's ``sum``
("of limit"), and by the prefetching read loop of ``bench/read_peak.cpp`` ("of peak", the
stricter figure: a plain loop's best).
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import torch

import qkv.functional as qf
from _measure import machine_header, peak_reader, written
from qkv.kernels.packed import pack_linears
from qkv.models import CausalLM, TransformerConfig
from qkv.models.incremental import PreparedSteps
from qkv.models.lm_decoder import LMDecoder


def read_bandwidth(x: torch.Tensor, read=torch.sum, repeats: int = 3) -> float:
    """Bytes/s of a streaming read of ``x`` (``read``: torch's sum, or the prefetching loop)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        read(x)
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def bandwidths(buffers: dict[bool, torch.Tensor], peak) -> dict[tuple[str, bool], float]:
    """{(reader, on 2 MiB pages): bytes/s}: torch's sum, and the prefetching loop if built,
    over 1 GiB written first on each kind of page (``buffers``)."""
    readers = {"sum": torch.sum} | ({"peak": peak} if peak is not None else {})
    return {(name, huge): read_bandwidth(x, read)
            for name, read in readers.items() for huge, x in buffers.items()}  # fmt: skip


class AttentionTimer:
    """Wall time spent inside attention: ``qkv.functional.scaled_dot_product_attention``
    (the model's forward) and the prepared decoders' attention step."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextmanager
    def active(self):
        patched = [(qf, "scaled_dot_product_attention"), (PreparedSteps, "_attend")]
        originals = [getattr(owner, name) for owner, name in patched]
        for (owner, name), orig in zip(patched, originals):

            def timed(*args, orig=orig, **kwargs):
                t0 = time.perf_counter()
                out = orig(*args, **kwargs)
                self.seconds += time.perf_counter() - t0
                return out

            setattr(owner, name, timed)
        try:
            yield self
        finally:
            for (owner, name), orig in zip(patched, originals):
                setattr(owner, name, orig)


def build(vocab: int, layers: int) -> CausalLM:
    torch.manual_seed(0)
    cfg = TransformerConfig(src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=768,
                            n_heads=12, n_kv_heads=4, d_ff=3072, n_decoder_layers=layers,
                            n_encoder_layers=0, positional="rope", dropout=0.0,
                            max_len=1 << 20)  # fmt: skip
    return CausalLM(cfg).eval()


def set_backend(lm: CausalLM, backend: str) -> None:
    for layer in lm.layers:
        layer.self_attn.backend = backend


@torch.inference_mode()
def run(lm: CausalLM, prompt: torch.Tensor, new: int, chunk: int, cache_dtype,
        random_cache: bool = False, module_forward: bool = False):  # fmt: skip
    """(prefill seconds, median seconds per decode step, share of decode time inside
    attention, mean KV bytes per step). The median step, not the mean: this shared VM's
    speed drifts within a run, and one slow stretch should not stand for the decoder.

    random_cache: no prefill (nan seconds); the cache holds random keys and values of the
    prompt's length instead (decode reads them all the same; its speed does not depend on
    their values)."""
    T = prompt.shape[1]
    cache = lm.new_cache(capacity=T + new, dtype=cache_dtype)
    t0 = time.perf_counter()
    if random_cache:
        attn = lm.layers[0].self_attn
        shape = (1, attn.n_kv_heads, T, attn.d_k)  # (B, h_kv, T, d_k)
        for c in cache:
            c.update(torch.randn(shape), torch.randn(shape))
        tok, prefill = prompt[:, -1:], float("nan")
    else:
        for s in range(0, T, chunk):
            logits = lm(prompt[:, s : s + chunk], cache=cache)[:, -1]
        prefill = time.perf_counter() - t0
        tok = logits.argmax(-1, keepdim=True)  # (1, 1)
    timer = AttentionTimer()
    kv_bytes = 0
    dec = None if module_forward else LMDecoder.for_model(lm)  # what generate() decodes with
    steps = []
    with timer.active():
        state = dec.start(cache) if dec is not None else None
        for _ in range(new):
            kv_bytes += sum(c.keys.nbytes + c.values.nbytes for c in cache)
            t0 = time.perf_counter()
            if dec is not None:
                tok = dec.step(state, tok.view(-1)).argmax(-1, keepdim=True)  # (1, 1)
            else:
                tok = lm(tok, cache=cache)[:, -1].argmax(-1, keepdim=True)
            steps.append(time.perf_counter() - t0)
    return prefill, statistics.median(steps), timer.seconds / sum(steps), kv_bytes / new


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", type=int, nargs="+", default=None)
    p.add_argument("--new", type=int, default=None, help="tokens generated (default 128)")
    p.add_argument("--quick", action="store_true", help="prompts 1k and 8k, 32 new tokens")
    p.add_argument("--threads", type=int, nargs="+", default=[2])
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--cache-dtype", choices=["fp32", "bf16", "int8"], default="fp32",
                   help="int8: rows of int8 values and a scale (qkv.cache); torch SDPA then "
                   "reads them widened to fp32 every step")  # fmt: skip
    p.add_argument("--random-cache", action="store_true",
                   help="skip the prefill: random K/V of the prompt's length (decode only)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds per prompt, each with its own bandwidth reading")  # fmt: skip
    p.add_argument("--module-forward", action="store_true",
                   help="decode through the model's forward, not the prepared decoder")  # fmt: skip
    p.add_argument("--no-pack", action="store_true",
                   help="keep nn.Linear (default: qkv.kernels.packed.pack_linears, both rows)")  # fmt: skip
    args = p.parse_args()
    prompts = args.prompts or ([1024, 8192] if args.quick else [1024, 8192, 32768])
    new = args.new or (32 if args.quick else 128)
    cache_dtype = {"fp32": None, "bf16": torch.bfloat16, "int8": torch.int8}[args.cache_dtype]
    lm = build(args.vocab, args.layers)
    if not args.no_pack:  # the linears of both rows: only the attention differs between them
        lm = pack_linears(lm)
    weight_bytes = sum(p.numel() * p.element_size() for p in lm.parameters())  # tied: once
    print(machine_header())
    print(f"CausalLM {args.layers} layers, d_model 768, 12/4 heads (GQA), RoPE, "
          f"{weight_bytes / 1e6:.0f} MB of weights | KV cache {args.cache_dtype} | "
          f"linears {'nn.Linear' if args.no_pack else 'packed panels'} | decode through "
          f"{'the module forward' if args.module_forward else 'LMDecoder'} | {new} new tokens")  # fmt: skip
    buffers = {huge: written(huge) for huge in (False, True)}  # the weights' pages, the cache's
    peak = peak_reader()
    if isinstance(peak, str):
        print(f"prefetching read loop {peak}")
        peak = None
    print(f"{'threads':>7} {'prompt':>6} {'attention':>10} {'prefill s':>9} {'tok/s':>7} "
          f"{'attn %':>6} {'limit tok/s':>11} {'of limit':>8} {'of peak':>7}")  # fmt: skip
    run(lm, torch.randint(3, args.vocab, (1, 64)), 2, args.chunk, cache_dtype,
        module_forward=args.module_forward)  # warm-up
    for threads in args.threads:
        torch.set_num_threads(threads)
        for T in prompts:
            prompt = torch.randint(
                3, args.vocab, (1, T), generator=torch.Generator().manual_seed(T)
            )
            for _ in range(args.rounds):  # the bandwidth is read again in every round
                before = bandwidths(buffers, peak)
                rows = []
                for label, backend in (("qkv auto", "auto"), ("torch SDPA", "torch")):
                    set_backend(lm, backend)
                    t_start = time.perf_counter()
                    prefill, step, attn, kv = run(lm, prompt, new, args.chunk, cache_dtype,
                                                  args.random_cache, args.module_forward)  # fmt: skip
                    rows.append((label, prefill, step, attn, kv, time.perf_counter() - t_start))
                # this VM's bandwidth drifts within minutes: the higher of the readings
                # before and after the round (the stricter limit)
                after = bandwidths(buffers, peak)
                bw = {key: max(before[key], after[key]) for key in before}
                for label, prefill, step, attn, kv, seconds in rows:
                    limit = {how: 1 / (weight_bytes / bw[how, False] + kv / bw[how, True])
                             for how in ("sum", "peak") if (how, True) in bw}  # fmt: skip
                    speed = 1 / step  # limits: tokens/s if each byte is read once at that speed
                    of_peak = f"{speed / limit['peak']:>7.0%}" if "peak" in limit else "      —"
                    print(f"{threads:>7} {T:>6} {label:>10} {prefill:>9.2f} {speed:>7.2f} "
                          f"{100 * attn:>5.0f}% {limit['sum']:>11.2f} {speed / limit['sum']:>7.0%} "
                          f"{of_peak}   (sum {bw['sum', False] / 1e9:.1f} GB/s, cache pages "
                          f"{bw['sum', True] / 1e9:.1f}; prefetching loop "
                          + (f"{bw['peak', False] / 1e9:.1f} / {bw['peak', True] / 1e9:.1f}"
                             if ("peak", True) in bw else "not built")
                          + f"; {seconds:.0f} s)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
