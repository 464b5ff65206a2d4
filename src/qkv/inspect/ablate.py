"""Switch heads off and measure what changes.

A head is switched off by zeroing its output ``(B, Tq, d_k)`` before the heads are
concatenated and projected by ``W_O`` (``MultiHeadAttention.head_mask``; 0 = off).

>>> from qkv.inspect.tiny import TinyEncoder
>>> enc = TinyEncoder()
>>> _, ids = enc.tokenize("a b c")
>>> r = ablate(enc, {"encoder.layers.0.self_attn": [1]}, lambda m: float(m(ids).norm()))
>>> r.delta == r.ablated - r.baseline
True
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from qkv.capture.record import attention_modules

__all__ = ["AblationResult", "ablate", "ablation_scan", "heads_off", "parse_heads"]

HeadSpec = Mapping[int | str, Iterable[int]]


@contextmanager
def heads_off(model: nn.Module, heads: HeadSpec) -> Iterator[nn.Module]:
    """Within the block, the given heads of the given attention modules output zeros.

    ``heads`` maps a layer (index into the model's attention modules, name or glob pattern)
    to head indices. Previous head masks are multiplied in and restored on exit. A
    transformers model is handled by :func:`qkv.hf.heads_off` (same operation).
    """
    if _is_hf(model):
        from qkv.hf import heads_off as hf_heads_off

        with hf_heads_off(model, heads):
            yield model
        return
    saved = []
    try:
        for layer, hs in heads.items():
            for _, m in attention_modules(model, [layer]):
                hs = [int(h) for h in hs]
                bad = [h for h in hs if not 0 <= h < m.n_heads]
                if bad:
                    raise ValueError(f"heads {bad} out of range for layer {layer!r} "
                                     f"with {m.n_heads} heads")  # fmt: skip
                saved.append((m, m.head_mask))
                mask = torch.ones(m.n_heads) if m.head_mask is None else m.head_mask.clone()
                mask[hs] = 0.0
                m.head_mask = mask
        yield model
    finally:
        for m, prev in reversed(saved):
            m.head_mask = prev


@dataclass
class AblationResult:
    """``metric`` with all heads on (``baseline``), with the heads off, and the difference."""

    heads: dict
    baseline: float
    ablated: float

    @property
    def delta(self) -> float:
        return self.ablated - self.baseline


def ablate(
    model: nn.Module, heads: HeadSpec, metric_fn: Callable[[nn.Module], float]
) -> AblationResult:
    """``metric_fn(model)`` with every head on, then with ``heads`` off (under no_grad).

    ``metric_fn`` is e.g. a loss on a batch, a BLEU score, or a similarity between two
    tokens' representations.
    """
    with torch.no_grad():
        base = float(metric_fn(model))
        with heads_off(model, heads):
            off = float(metric_fn(model))
    return AblationResult({k: list(v) for k, v in heads.items()}, base, off)


def ablation_scan(
    model: nn.Module,
    metric_fn: Callable[[nn.Module], float],
    layers: Sequence[int | str] | None = None,
) -> list[AblationResult]:
    """Each head of each chosen layer off on its own; sorted by ``|delta|``, largest first."""
    with torch.no_grad():
        base = float(metric_fn(model))
        out = []
        for name, n_heads in _layers(model, layers):
            for h in range(n_heads):
                with heads_off(model, {name: [h]}):
                    out.append(AblationResult({name: [h]}, base, float(metric_fn(model))))
    return sorted(out, key=lambda r: -abs(r.delta))


def _is_hf(model: nn.Module) -> bool:
    """A transformers model (its attention is not made of qkv modules)."""
    return type(model).__module__.startswith("transformers.")


def _layers(model: nn.Module, layers: Sequence[int | str] | None) -> list[tuple[str, int]]:
    """``(name, heads)`` of the chosen attention modules (qkv's own, or a transformers model's)."""
    if _is_hf(model):
        from qkv.hf import attention_modules as hf_modules
        from qkv.hf import head_count

        return [(n, head_count(m)) for n, m in hf_modules(model, layers)]
    return [(n, m.n_heads) for n, m in attention_modules(model, layers)]


def parse_heads(specs: Iterable[str]) -> dict[str, list[int]]:
    """``["encoder.layers.0.self_attn:1,3", "2:0"]`` → ``{"encoder.layers.0.self_attn": [1, 3], "2": [0]}``."""
    out: dict = {}
    for spec in specs:
        layer, sep, hs = spec.rpartition(":")
        if not sep or not layer or not hs:
            raise ValueError(f"head spec must be LAYER:HEAD[,HEAD...], got {spec!r}")
        key = int(layer) if layer.lstrip("-").isdigit() else layer
        out.setdefault(key, []).extend(int(h) for h in hs.split(","))
    return out
