"""``AttentionMaps``: the per-head attention weights of some layers, with their tokens.

Shapes: each layer holds ``(H, Tq, Tk)`` (the kept heads, query rows, key columns). Layers
may differ in ``Tq``/``Tk`` (encoder self vs. cross-attention, decoding steps), so they are
kept as a list; :attr:`AttentionMaps.tensor` stacks them ``(L, H, Tq, Tk)`` when they agree.

>>> m = AttentionMaps([torch.eye(3)[None]], ["enc.0"], ["self"], [[0]], [list("abc")],
...                   [list("abc")], [0])
>>> m.select("enc.0", 0)[1].tolist()
[0.0, 1.0, 0.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["KINDS", "AttentionMaps", "layer_labels", "merge_steps", "token_labels"]

KINDS = ("self", "causal", "cross")


@dataclass
class AttentionMaps:
    """Attention weights per layer ``(H, Tq, Tk)`` and what they are about.

    Attributes:
        weights: one float32 CPU tensor ``(H, Tq, Tk)`` per layer; rows sum to 1 (0 if masked).
        layers: module names (``model.named_modules()`` order).
        kinds: ``"self"``, ``"causal"`` or ``"cross"`` per layer.
        heads: the original head indices kept, per layer (``weights[l][i]`` is head ``heads[l][i]``).
        q_tokens, k_tokens: token strings of the rows and columns, per layer.
        q_offsets: position of the first query row in its sequence (> 0 for decoding steps).
        step: which decoding step these maps come from (``None`` for a whole forward pass).
    """

    weights: list[Tensor]
    layers: list[str]
    kinds: list[str]
    heads: list[list[int]]
    q_tokens: list[list[str]]
    k_tokens: list[list[str]]
    q_offsets: list[int] = field(default_factory=list)
    step: int | None = None

    def __post_init__(self) -> None:
        n = len(self.weights)
        if not self.q_offsets:
            self.q_offsets = [0] * n
        for name in ("layers", "kinds", "heads", "q_tokens", "k_tokens", "q_offsets"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} must have one entry per layer ({n}), got "
                                 f"{len(getattr(self, name))}")  # fmt: skip
        for i, w in enumerate(self.weights):
            if w.dim() != 3 or w.shape[0] != len(self.heads[i]):
                raise ValueError(
                    f"weights[{i}] must be (H={len(self.heads[i])}, Tq, Tk), got {tuple(w.shape)}"
                )
            if self.kinds[i] not in KINDS:
                raise ValueError(f"kinds[{i}] must be one of {KINDS}, got {self.kinds[i]!r}")

    def __len__(self) -> int:
        return len(self.weights)

    def index(self, layer: int | str) -> int:
        """Position of ``layer`` (an index or a module name) in :attr:`layers`."""
        if isinstance(layer, int):
            if not -len(self) <= layer < len(self):
                raise IndexError(f"layer index {layer} out of range for {len(self)} layers")
            return layer % len(self)
        if layer not in self.layers:
            raise KeyError(f"no layer named {layer!r}; have {self.layers}")
        return self.layers.index(layer)

    def select(self, layer: int | str, head: int) -> Tensor:
        """Weights ``(Tq, Tk)`` of original head ``head`` of ``layer``."""
        i = self.index(layer)
        if head not in self.heads[i]:
            raise KeyError(f"head {head} of layer {self.layers[i]!r} not captured: {self.heads[i]}")
        return self.weights[i][self.heads[i].index(head)]

    def filter(self, *, kind: str | None = None, layers: list[int | str] | None = None):
        """A new ``AttentionMaps`` with only the layers of ``kind`` and/or in ``layers``."""
        keep = range(len(self)) if layers is None else sorted({self.index(x) for x in layers})
        keep = [i for i in keep if kind is None or self.kinds[i] == kind]
        pick = lambda xs: [xs[i] for i in keep]  # noqa: E731
        return AttentionMaps(
            pick(self.weights), pick(self.layers), pick(self.kinds), pick(self.heads),
            pick(self.q_tokens), pick(self.k_tokens), pick(self.q_offsets), self.step,
        )  # fmt: skip

    @property
    def tensor(self) -> Tensor:
        """All layers stacked ``(L, H, Tq, Tk)``; needs equal shapes (e.g. ``filter(kind=...)``)."""
        shapes = {tuple(w.shape) for w in self.weights}
        if len(shapes) != 1:
            raise ValueError(f"layers have different shapes {sorted(shapes)}; filter first")
        return torch.stack(self.weights)

    def _repr_html_(self) -> str:
        """The explorer inline in Jupyter (self-contained; maps cut to the server's limit)."""
        from qkv.capture.page import notebook_html

        return notebook_html(self)

    # One head's map as a file (qkv.capture.export: bounded, the explorer's download format)
    def to_svg(self, layer: int | str = 0, head: int | None = None) -> str:
        """``layer``/``head`` (default: its first) as an SVG picture with token labels."""
        from qkv.capture.export import head_map, to_svg

        return to_svg(head_map(self, layer, head))

    def to_json(self, layer: int | str = 0, head: int | None = None) -> str:
        """``layer``/``head`` as JSON: tokens, layer, head and the ``[Tq][Tk]`` weights."""
        from qkv.capture.export import head_map, to_json

        return to_json(head_map(self, layer, head))

    def to_csv(self, layer: int | str = 0, head: int | None = None) -> str:
        """``layer``/``head`` as CSV: key tokens across, one row per query token."""
        from qkv.capture.export import head_map, to_csv

        return to_csv(head_map(self, layer, head))

    def to_dict(self, decimals: int = 4) -> dict[str, Any]:
        """JSON-ready: ``{"step", "layers": [{"name", "kind", "heads", "q_tokens", ...}]}``."""
        return {
            "step": self.step,
            "layers": [
                {
                    "name": self.layers[i],
                    "kind": self.kinds[i],
                    "heads": self.heads[i],
                    "q_tokens": self.q_tokens[i],
                    "k_tokens": self.k_tokens[i],
                    "q_offset": self.q_offsets[i],
                    "weights": self.weights[i].round(decimals=decimals).tolist(),
                }  # fmt: skip
                for i in range(len(self))
            ],
        }


def token_labels(tokens: Sequence[str] | None, start: int, n: int) -> list[str]:
    """Labels of ``n`` rows or columns from position ``start``: ``tokens[i]``, or the position
    ``str(i)`` where ``tokens`` has none (how both recorders label their maps).

    >>> token_labels(["a", "b"], 1, 3)
    ['b', '2', '3']
    """
    toks = list(tokens or [])
    return [toks[i] if i < len(toks) else str(i) for i in range(start, start + n)]


def layer_labels(
    kind: str,
    q_offset: int,
    Tq: int,
    Tk: int,
    tokens: Sequence[str] | None = None,
    source_tokens: Sequence[str] | None = None,
) -> tuple[list[str], list[str]]:
    """``(q_tokens, k_tokens)`` of one recorded call of a layer of ``kind``.

    ``tokens`` label the queries everywhere and the keys of causal/self layers;
    ``source_tokens`` (seq2seq) label the keys of cross layers and both sides of the
    non-causal self layers (the encoder). Missing labels fall back to positions.
    """
    enc = source_tokens is not None and kind == "self"
    q_src = source_tokens if enc else tokens
    k_src = source_tokens if (enc or kind == "cross") else tokens
    return token_labels(q_src, q_offset, Tq), token_labels(k_src, 0, Tk)


def merge_steps(steps: list[AttentionMaps]) -> AttentionMaps:
    """Stack decoding steps into whole-sequence maps: rows concatenated, keys zero-padded.

    A layer seen at several steps (the decoder's) gets ``(H, ΣTq, max Tk)``: for causal
    self-attention over a KV cache this equals the full causal map of the final sequence.
    A layer seen once (the encoder's) is kept as is.
    """
    if not steps:
        raise ValueError("steps must hold at least one AttentionMaps")
    order: list[str] = []
    parts: dict[str, list[tuple[AttentionMaps, int]]] = {}
    for m in steps:
        for i, name in enumerate(m.layers):
            if name not in parts:
                order.append(name)
                parts[name] = []
            parts[name].append((m, i))
    out: dict[str, list] = {k: [] for k in ("w", "kind", "heads", "q", "k", "off")}
    for name in order:
        seq = sorted(parts[name], key=lambda p: p[0].q_offsets[p[1]])
        Tk = max(m.weights[i].shape[-1] for m, i in seq)
        rows = [
            torch.nn.functional.pad(m.weights[i], (0, Tk - m.weights[i].shape[-1])) for m, i in seq
        ]  # each (H, Tq_step, Tk)
        first, last = seq[0], max(seq, key=lambda p: p[0].weights[p[1]].shape[-1])
        out["w"].append(torch.cat(rows, dim=1))  # (H, ΣTq, Tk)
        out["kind"].append(first[0].kinds[first[1]])
        out["heads"].append(first[0].heads[first[1]])
        out["q"].append([t for m, i in seq for t in m.q_tokens[i]])
        out["k"].append(last[0].k_tokens[last[1]])
        out["off"].append(first[0].q_offsets[first[1]])
    return AttentionMaps(
        out["w"], order, out["kind"], out["heads"], out["q"], out["k"], out["off"], None
    )
