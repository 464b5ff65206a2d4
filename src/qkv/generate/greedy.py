"""Greedy search for a :class:`~qkv.models.Seq2SeqTransformer`: the most likely token at every
step, sentences batched; a sentence that finished leaves the batch.

Shapes: ``src (B, S)`` → generated ids ``(B, T)`` (after ``<s>``; ``</s>`` then ``<pad>``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.generate._common import _argmax, _check_min, _check_src, _limits
from qkv.generate._ngram import _check_ngram
from qkv.generate._repeat import RepeatGuard, banned_tokens
from qkv.generate._steps import _Steps
from qkv.kernels._native import native_module

__all__ = ["greedy_search"]


@torch.inference_mode()
def greedy_search(
    model,
    src: Tensor,
    *,
    max_new_tokens: int | None = None,
    min_new_tokens: int = 0,
    use_cache: bool = True,
    ignore_eos: bool = False,
    cache_dtype: torch.dtype | None = None,
    no_repeat_ngram: int = 0,
    repeat_guard: RepeatGuard | None = None,
) -> Tensor:
    """Most likely next token at every step. Returns ids ``(B, T)``, pad after ``</s>``.

    ``min_new_tokens``: ``</s>`` cannot be chosen before that many tokens (the next most
    likely token is). ``ignore_eos`` keeps going for exactly ``max_new_tokens``, ``</s>`` or
    not (benchmarks). ``cache_dtype``: storage dtype of the self-attention caches (e.g.
    ``torch.bfloat16`` for an fp32 model, or ``torch.int8``: rows of int8 values and a scale,
    see :mod:`qkv.cache`; the default keeps the model's dtype). ``no_repeat_ngram=n`` (>= 2):
    no n-gram of tokens is written twice (the next most likely token is); 0: off.
    ``repeat_guard``: a :class:`~qkv.generate.RepeatGuard`, no pattern of 1–4 tokens (or of
    1–4 letters inside a word) written three times in a row; ``None``: off.

    >>> out = greedy_search(model, torch.tensor([[5, 6, 2]]))  # doctest: +SKIP
    """
    _check_src(src)
    _check_min(min_new_tokens)
    _check_ngram(no_repeat_ngram)
    cfg = model.cfg
    limits = _limits(model, src, max_new_tokens)  # (B,)
    T_max = int(limits.max())
    if use_cache:
        return _greedy_cached(model, src, limits, T_max, min_new_tokens, ignore_eos, cache_dtype,
                              no_repeat_ngram, repeat_guard)  # fmt: skip
    B, dev = src.shape[0], src.device
    ys = torch.full((B, T_max + 1), cfg.pad_id, dtype=torch.long, device=dev)
    ys[:, 0] = cfg.bos_id
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    mask = model.src_mask(src)
    memory = model.encode(src, mask)  # (B, S, d_model)
    n = 0
    for t in range(T_max):
        logits = model.decode(ys[:, : t + 1], memory, mask)[:, -1]
        if banned := banned_tokens(ys[:, 1 : t + 1], no_repeat_ngram, repeat_guard):
            logits[banned] = float("-inf")
        nxt = _argmax(logits, cfg.eos_id if t < min_new_tokens else -1)  # (B,)
        n = t + 1
        if ignore_eos:
            ys[:, n] = nxt
            continue
        nxt = nxt.masked_fill(done, cfg.pad_id)
        done |= (nxt == cfg.eos_id) | (n >= limits)
        ys[:, n] = nxt
        if bool(done.all()):
            break
    return ys[:, 1 : n + 1]


def _greedy_cached(model, src: Tensor, limits: Tensor, T_max: int, min_new_tokens: int,
                   ignore_eos: bool, cache_dtype, no_repeat_ngram: int = 0,
                   repeat_guard: RepeatGuard | None = None) -> Tensor:  # fmt: skip
    """greedy_search with the cache: a sentence that finished leaves the batch (later steps
    skip its rows). The tokens are kept step-major, so each step's are one contiguous row
    that the next step reads as it is."""
    cfg = model.cfg
    B, dev = src.shape[0], src.device
    eos = -1 if ignore_eos else cfg.eos_id
    out = torch.full((T_max + 1, B), cfg.pad_id, dtype=torch.long, device=dev)
    out[0] = cfg.bos_id
    module = native_module() if dev.type == "cpu" else None
    steps = _Steps(model, src, 1, T_max, cache_dtype)
    # the sentences still running (None: all), their limits, their next input
    alive, lim, tokens = None, limits, out[0]
    lim_min = int(lim.min())
    n = 0
    try:
        for t in range(T_max):
            logits = steps(tokens)  # (B_alive, V)
            if (no_repeat_ngram and t >= no_repeat_ngram) or (repeat_guard is not None and t):
                written = out[1 : t + 1] if alive is None else out[1 : t + 1, alive]  # (t, B_alive)
                if banned := banned_tokens(written.t(), no_repeat_ngram, repeat_guard):
                    logits[banned] = float("-inf")  # this step's output: the next rewrites it
            n = t + 1
            block = cfg.eos_id if t < min_new_tokens else -1
            if alive is None and module is not None and logits.dtype == torch.float32:
                tokens = out[n]  # written in place; ended: how many chose </s>
                ended = module.greedy_pick(logits.contiguous(), block, eos, tokens)
            else:
                tokens = _argmax(logits, block)  # (B_alive,)
                out[n, slice(None) if alive is None else alive] = tokens
                ended = int((tokens == eos).sum()) if eos >= 0 else 0
            if ignore_eos or (not ended and n < lim_min):
                continue
            fin = tokens == eos
            if n >= lim_min:
                fin |= n >= lim
            if bool(fin.all()):
                break
            if bool(fin.any()):
                keep = (~fin).nonzero().flatten()
                steps.keep(keep)
                alive = keep if alive is None else alive[keep]
                lim, tokens = lim[keep], tokens[keep]
                lim_min = int(lim.min())
    finally:
        steps.close()
    return out[1 : n + 1].t().contiguous()
