"""Small helpers the searches share: argument checks, each sentence's length limit, eval mode
for the length of a call, and the argmax of a step's logits (the compiled kernel on the CPU).

Shapes: ``src (B, S)``; logits ``(N, V)``, one row per hypothesis.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from qkv.kernels._native import decode_ops


def _limits(model, src: Tensor, max_new_tokens: int | None) -> Tensor:
    """Tokens each sentence may generate ``(B,)``: ``max_new_tokens``, or by default
    ``2·len(source) + 10`` (its own length, not the padded one, so batching changes nothing)."""
    if max_new_tokens is not None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        return torch.full((src.shape[0],), max_new_tokens, device=src.device)
    lengths = (src != model.cfg.pad_id).sum(1)
    return (2 * lengths + 10).clamp(max=model.cfg.max_len - 1)


@contextlib.contextmanager
def _evaluating(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode (no dropout) for the call, then the caller's modes back: generating must not
    leave a model that is being trained in eval mode. A model already in eval mode is left
    as it is (switching walks every submodule twice: ~1 ms per call for a translator)."""
    training = [m for m in model.modules() if m.training]
    if training:
        model.eval()
    try:
        yield
    finally:
        for m in training:
            m.train()


def _check_src(src: Tensor) -> None:
    if not isinstance(src, Tensor) or src.dim() != 2 or src.dtype not in (torch.int64, torch.int32):
        shape = tuple(src.shape) if isinstance(src, Tensor) else type(src).__name__
        raise TypeError(f"src must be an integer tensor (B, S), got {shape}")


def _check_min(min_new_tokens: int) -> None:
    if not isinstance(min_new_tokens, int) or min_new_tokens < 0:
        raise ValueError(f"min_new_tokens must be an int >= 0, got {min_new_tokens!r}")


def _argmax(logits: Tensor, block: int) -> Tensor:
    """The most likely token of each row of ``logits (N, V)``, token ``block`` (if >= 0) never
    chosen unless every token is ``-inf``: ``argmax`` after ``logits[:, block] = -inf``. On the
    CPU one pass of the compiled kernel (torch's argmax is ~10x slower over a vocabulary)."""
    fp32_cpu = logits.device.type == "cpu" and logits.dtype == torch.float32
    if fp32_cpu and (ops := decode_ops()) is not None:
        return ops.argmax_rows(logits.contiguous(), block)
    if block >= 0:
        logits = logits.clone()
        logits[:, block] = float("-inf")
    return logits.argmax(-1)
