"""Continuation of prompts of a :class:`~qkv.models.CausalLM`, greedy or sampled: the prompt
fills the caches in chunks, then one token per step on the prepared
:class:`~qkv.models.lm_decoder.LMDecoder` (the model's forward where it does not apply).

Shapes: ``prompt (B, T)`` → new ids ``(B, n)``, ``n <= max_new_tokens``; logits ``(B, V)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.generate._common import _argmax, _evaluating

__all__ = ["generate"]


@torch.inference_mode()
def generate(
    lm,
    prompt: Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    cache_dtype: torch.dtype | None = None,
    prefill_chunk: int = 512,
) -> Tensor:
    """Continue each prompt of a :class:`~qkv.models.CausalLM`: ``prompt (B, T)`` → new ids
    ``(B, n)``, ``n <= max_new_tokens``.

    The prompt fills the KV caches in chunks of ``prefill_chunk`` tokens (the model's own
    forward); the new tokens come one per step from the prepared decoder
    (:class:`~qkv.models.lm_decoder.LMDecoder`; the model's forward where it does not apply,
    e.g. with an inspection hook set). ``temperature=0`` is greedy; above 0 tokens are
    sampled from ``softmax(logits / temperature)``, over the ``top_k`` most likely if given
    (``generator`` makes it reproducible). With ``eos_id`` a sequence ends at that token
    (then ``pad_id``), and generation stops when all have ended. ``cache_dtype``: storage
    dtype of the caches (``torch.bfloat16`` halves what each step reads).

    >>> out = generate(lm, torch.tensor([[5, 6, 7]]), max_new_tokens=8)  # doctest: +SKIP
    """
    from qkv.models.lm_decoder import LMDecoder

    if not isinstance(prompt, Tensor) or prompt.dim() != 2 or prompt.dtype not in (
        torch.int64, torch.int32) or prompt.shape[1] == 0:  # fmt: skip
        shape = tuple(prompt.shape) if isinstance(prompt, Tensor) else type(prompt).__name__
        raise TypeError(f"prompt must be an integer tensor (B, T) with T >= 1, got {shape}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an int >= 1 or None, got {top_k!r}")
    if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be an int >= 1, got {prefill_chunk!r}")
    cfg = lm.cfg
    B, T = prompt.shape
    if cfg.positional != "rope" and T + max_new_tokens > cfg.max_len:
        raise ValueError(f"prompt ({T}) + max_new_tokens ({max_new_tokens}) > the model's "
                         f"max_len={cfg.max_len} positions")  # fmt: skip

    def pick(logits: Tensor) -> Tensor:  # (B, V) -> (B,)
        if temperature == 0:
            return _argmax(logits, -1)
        logits = logits.float() / temperature
        if top_k is not None and top_k < logits.shape[-1]:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]

    with _evaluating(lm):
        caches = lm.new_cache(capacity=T + max_new_tokens, dtype=cache_dtype)
        for s in range(0, T, prefill_chunk):
            logits = lm(prompt[:, s : s + prefill_chunk], cache=caches)[:, -1]  # (B, V)
        fast = LMDecoder.for_model(lm)
        state = fast.start(caches) if fast is not None else None
        out = torch.full((B, max_new_tokens), cfg.pad_id, dtype=torch.long, device=prompt.device)
        done = torch.zeros(B, dtype=torch.bool, device=prompt.device)
        n = 0
        for n in range(1, max_new_tokens + 1):
            tok = pick(logits).masked_fill(done, cfg.pad_id)  # (B,)
            out[:, n - 1] = tok
            if eos_id is not None:
                done |= tok == eos_id
                if bool(done.all()):
                    break
            if n == max_new_tokens:
                break
            if fast is not None:
                logits = fast.step(state, tok)
            else:
                logits = lm(tok[:, None], cache=caches)[:, -1]
    return out[:, :n]
