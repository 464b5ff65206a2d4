"""Switch heads of a transformers model off: their output is zeroed before the output projection.

The same operation as qkv's own ``MultiHeadAttention.head_mask`` (and
:func:`qkv.inspect.heads_off`): inside :func:`heads_off`, the attention adapter
(:func:`qkv.hf.qkv_attention_forward`) multiplies the chosen heads' outputs ``(B, Tq, h, d)``
by 0 before transformers merges the heads and applies ``o_proj``. Their weights are unchanged
(a captured map still shows where the head looked). The model runs with
``attn_implementation="qkv"`` inside the block.

>>> with heads_off(model, {"model.layers.0.self_attn": [1, 3]}):     # doctest: +SKIP
...     logits = model(ids).logits
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor, nn

from qkv.capture.record import select_modules
from qkv.hf.capture import attention_modules
from qkv.hf.registry import running_qkv

__all__ = ["head_count", "heads_off", "zero_heads"]

_OFF: ContextVar[dict[int, set[int]] | None] = ContextVar("qkv_hf_heads_off", default=None)


def head_count(module: nn.Module) -> int:
    """Query heads of a transformers attention module (from its attributes or its config)."""
    for attr in ("num_heads", "num_attention_heads", "n_heads"):
        v = getattr(module, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    v = getattr(getattr(module, "config", None), "num_attention_heads", None)
    if isinstance(v, int) and v > 0:
        return v
    raise ValueError(f"cannot tell how many heads {type(module).__name__} has")


def zero_heads(module: nn.Module, out: Tensor) -> Tensor:
    """``out (B, Tq, h, d)`` with the heads switched off for ``module`` zeroed (else as is)."""
    off = _OFF.get()
    hs = None if off is None else off.get(id(module))
    if not hs:
        return out
    keep = torch.ones(out.shape[2], 1, dtype=out.dtype, device=out.device)  # (h, 1)
    keep[sorted(hs)] = 0.0
    return out * keep


@contextmanager
def heads_off(model: nn.Module, heads: Mapping[int | str, Iterable[int]]) -> Iterator[nn.Module]:
    """Within the block, the given heads of the given attention modules output zeros.

    ``heads`` maps a layer (index into :func:`qkv.hf.attention_modules`, module name or glob
    pattern) to query-head indices. Nested blocks add up; everything is restored on exit.
    """
    found = attention_modules(model)
    spec: dict[int, set[int]] = {k: set(v) for k, v in (_OFF.get() or {}).items()}
    for layer, hs in heads.items():
        for name, m in select_modules(found, [layer]):
            hs = [int(h) for h in hs]
            n = head_count(m)
            bad = [h for h in hs if not 0 <= h < n]
            if bad:
                raise ValueError(f"heads {bad} out of range for layer {name!r} with {n} heads")
            spec.setdefault(id(m), set()).update(hs)
    with running_qkv(model):
        token = _OFF.set(spec)
        try:
            yield model
        finally:
            _OFF.reset(token)
