"""Translation of sentences (strings in, strings out) with a
:class:`~qkv.models.Seq2SeqTransformer` and its tokenizer: tokenised, batched by length,
searched greedily or with beams, decoded back to text. :class:`qkv.translate.Translator`
builds on it (splitting long lines, warnings, loading a shipped model).

Shapes: each batch ``src (B, S)`` (padded to its longest sentence) → ids ``(B, T)``.
"""

from __future__ import annotations

import warnings

import torch

from qkv.generate._common import _evaluating
from qkv.generate._repeat import RepeatGuard
from qkv.generate.beam import beam_search
from qkv.generate.greedy import greedy_search

__all__ = ["translate"]


@torch.inference_mode()
def translate(
    model,
    tokenizer,
    sentences: list[str],
    *,
    beam_size: int = 1,
    length_penalty: float = 1.0,
    max_tokens: int = 4000,
    progress: bool = False,
    cache_dtype: torch.dtype | None = None,
    no_repeat_ngram: int = 0,
    repeat_guard: bool = False,
) -> list[str]:
    """Translate ``sentences`` (batched by length, in order). ``beam_size=1`` is greedy;
    ``cache_dtype`` and ``no_repeat_ngram`` as :func:`greedy_search`'s; ``repeat_guard=True``:
    the tokenizer's :class:`~qkv.generate.RepeatGuard` (no stutter such as "gigigi"). Each
    output has at most ``2·len(source) + 10`` tokens."""
    from tqdm import tqdm

    if isinstance(sentences, str):
        raise TypeError("sentences must be a list of str, not a single str")
    dev = next(model.parameters()).device
    limit = model.cfg.max_len // 2 - 1  # source tokens before </s>; the output fits the rest
    ids = tokenizer.encode_batch(list(sentences))
    if any(len(s) > limit for s in ids):  # qkv.translate.Translator splits such text instead
        n = sum(len(s) > limit for s in ids)
        warnings.warn(f"{n} sentence(s) longer than {limit} tokens were cut to {limit}",
                      stacklevel=2)  # fmt: skip
    ids = [s[:limit] + [tokenizer.eos_id] for s in ids]
    guard = RepeatGuard.for_tokenizer(tokenizer) if repeat_guard else None
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: list[str] = [""] * len(ids)
    batches, cur = [], []
    for i in order:
        if cur and len(ids[i]) * (len(cur) + 1) * max(beam_size, 1) > max_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    with _evaluating(model):
        for batch in tqdm(batches, desc="translate", disable=not progress, leave=False):
            S = max(len(ids[i]) for i in batch)
            src = torch.full((len(batch), S), model.cfg.pad_id, dtype=torch.long)
            for r, i in enumerate(batch):
                src[r, : len(ids[i])] = torch.tensor(ids[i])
            src = src.to(dev)
            if beam_size == 1:
                hyp = greedy_search(model, src, cache_dtype=cache_dtype,
                                    no_repeat_ngram=no_repeat_ngram, repeat_guard=guard)  # fmt: skip
            else:
                hyp = beam_search(model, src, beam_size=beam_size, length_penalty=length_penalty,
                                  cache_dtype=cache_dtype, no_repeat_ngram=no_repeat_ngram,
                                  repeat_guard=guard)  # fmt: skip
            for r, i in enumerate(batch):
                out[i] = tokenizer.decode(hyp[r].tolist())
    return out
