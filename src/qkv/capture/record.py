"""Record the per-head attention weights of every :class:`~qkv.MultiHeadAttention` in a model.

Mechanism: :func:`recording` attaches a ``recorder`` callback to each chosen attention module
(the hook in ``MultiHeadAttention.forward``: it computes the weights and hands them over without
changing the return value). Every call is recorded, so incremental decoding over a KV cache
gives one record per step; :func:`capture` returns whole-sequence maps, :func:`capture_steps`
one :class:`AttentionMaps` per decoding step.

Only what is asked is kept: the record is sliced to the chosen heads and batch row *before*
being stored (``(B, h, Tq, Tk)`` → ``(H, Tq, Tk)``).

>>> from qkv.inspect.tiny import TinyEncoder
>>> enc = TinyEncoder()
>>> toks, ids = enc.tokenize("The boy trains the puppy.")
>>> maps = capture(enc, ids, tokens=toks, heads=[0, 1])
>>> maps.layers, maps.weights[0].shape
(['encoder.layers.0.self_attn', 'encoder.layers.1.self_attn'], torch.Size([2, 8, 8]))
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.attention import MultiHeadAttention
from qkv.capture.maps import AttentionMaps, layer_labels, merge_steps

__all__ = [
    "Heads",
    "Record",
    "Recorder",
    "attention_modules",
    "capture",
    "capture_steps",
    "recording",
    "select_modules",
]

Heads = Sequence[int] | dict[str, Sequence[int]] | None


def attention_modules(
    model: nn.Module, layers: Sequence[int | str] | None = None
) -> list[tuple[str, MultiHeadAttention]]:
    """``(name, module)`` of the model's attention modules, in order, optionally selected.

    ``layers`` items are indices into that list, exact names, or glob patterns (``"decoder.*"``).
    """
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, MultiHeadAttention)]
    if not found:
        raise ValueError(f"{type(model).__name__} contains no qkv.MultiHeadAttention module")
    return select_modules(found, layers)


def select_modules(found: list[tuple[str, nn.Module]], layers: Sequence[int | str] | None
                   ) -> list[tuple[str, nn.Module]]:  # fmt: skip
    """The ``(name, module)`` pairs that ``layers`` picks: indices, exact names or globs."""
    if layers is None:
        return found
    keep: set[int] = set()
    for sel in layers:
        if isinstance(sel, int):
            if not -len(found) <= sel < len(found):
                raise IndexError(
                    f"layer index {sel} out of range for {len(found)} attention modules"
                )
            keep.add(sel % len(found))
            continue
        hits = [i for i, (n, _) in enumerate(found) if fnmatch.fnmatchcase(n, sel)]
        if not hits:
            raise KeyError(f"no attention module matches {sel!r}; have {[n for n, _ in found]}")
        keep.update(hits)
    return [found[i] for i in sorted(keep)]


@dataclass
class Record:
    """One forward call of one attention module: weights ``(H, Tq, Tk)`` of the kept heads."""

    name: str
    kind: str
    step: int  # the module's call count: 0 for the first call, 1 for the next decoding step...
    q_offset: int  # query positions this module had already seen in earlier calls
    heads: list[int]
    weights: Tensor


class Recorder:
    """Collects :class:`Record` s; made by :func:`recording`."""

    def __init__(self, heads: Heads = None, batch_index: int = 0) -> None:
        self.heads, self.batch_index = heads, batch_index
        self.records: list[Record] = []
        self._calls: dict[str, tuple[int, int]] = {}  # name -> (calls so far, queries so far)

    def _heads_for(self, name: str, n_heads: int) -> list[int]:
        sel = self.heads.get(name) if isinstance(self.heads, dict) else self.heads
        sel = list(range(n_heads)) if sel is None else [int(h) for h in sel]
        bad = [h for h in sel if not 0 <= h < n_heads]
        if bad:
            raise ValueError(f"heads {bad} out of range for {name!r} with {n_heads} heads")
        return sel

    def hook(self, name: str, n_heads: int) -> Callable[[Tensor, str], None]:
        """The callback for ``MultiHeadAttention.recorder`` of module ``name``."""
        heads = self._heads_for(name, n_heads)
        index = torch.tensor(heads)

        def record(weights: Tensor, kind: str) -> None:  # weights (B, h, Tq, Tk)
            if not 0 <= self.batch_index < weights.shape[0]:
                raise IndexError(f"batch_index {self.batch_index} out of range for batch "
                                 f"size {weights.shape[0]}")  # fmt: skip
            w = weights[self.batch_index].index_select(0, index.to(weights.device))
            calls, seen = self._calls.get(name, (0, 0))
            self._calls[name] = (calls + 1, seen + w.shape[1])
            rec = Record(name, kind, calls, seen, heads, w.detach().float().cpu())
            self.records.append(rec)  # (H, Tq, Tk)

        return record

    def steps(
        self, tokens: Sequence[str] | None = None, source_tokens: Sequence[str] | None = None
    ) -> list[AttentionMaps]:
        """One :class:`AttentionMaps` per step (step ``s`` = every module's ``s``-th call).

        Tokens: ``tokens`` label the queries everywhere and the keys of causal/self layers;
        ``source_tokens`` (seq2seq) label the keys of cross layers and both sides of the
        non-causal self layers (the encoder). Missing labels fall back to positions.
        """
        n_steps = 1 + max((r.step for r in self.records), default=-1)
        out = []
        for s in range(n_steps):
            recs = [r for r in self.records if r.step == s]
            labels = [layer_labels(r.kind, r.q_offset, *r.weights.shape[1:], tokens, source_tokens)
                      for r in recs]  # fmt: skip
            q_tok, k_tok = [q for q, _ in labels], [k for _, k in labels]
            out.append(
                AttentionMaps(
                    [r.weights for r in recs],
                    [r.name for r in recs],
                    [r.kind for r in recs],
                    [r.heads for r in recs],
                    q_tok,
                    k_tok,
                    [r.q_offset for r in recs],
                    s,
                )  # fmt: skip
            )
        return out


@contextmanager
def recording(
    model: nn.Module,
    layers: Sequence[int | str] | None = None,
    heads: Heads = None,
    *,
    batch_index: int = 0,
) -> Iterator[Recorder]:
    """Attach a recorder to the chosen attention modules for the duration of the block.

    >>> with recording(model, layers=["decoder.*"]) as rec:   # doctest: +SKIP
    ...     model.greedy(src)
    >>> steps = rec.steps(tokens=target_tokens, source_tokens=source_tokens)  # doctest: +SKIP
    """
    rec = Recorder(heads, batch_index)
    chosen = attention_modules(model, layers)
    previous = [m.recorder for _, m in chosen]
    try:
        for name, m in chosen:
            m.recorder = rec.hook(name, m.n_heads)
        yield rec
    finally:
        for (_, m), prev in zip(chosen, previous):
            m.recorder = prev


def capture_steps(
    model: nn.Module,
    *inputs,
    layers: Sequence[int | str] | None = None,
    heads: Heads = None,
    tokens: Sequence[str] | None = None,
    source_tokens: Sequence[str] | None = None,
    batch_index: int = 0,
    run: Callable | None = None,
    **kwargs,
) -> list[AttentionMaps]:
    """Run ``run(*inputs, **kwargs)`` (default ``model``) under no_grad; maps per decoding step.

    For a model called once, the list has one element. For ``run=model.greedy`` over a KV
    cache, step 0 holds the encoder and the first decoder call, step ``s`` the ``s``-th token.
    """
    with torch.no_grad(), recording(model, layers, heads, batch_index=batch_index) as rec:
        (run or model)(*inputs, **kwargs)
    return rec.steps(tokens, source_tokens)


def capture(
    model: nn.Module,
    *inputs,
    layers: Sequence[int | str] | None = None,
    heads: Heads = None,
    tokens: Sequence[str] | None = None,
    source_tokens: Sequence[str] | None = None,
    batch_index: int = 0,
    run: Callable | None = None,
    **kwargs,
) -> AttentionMaps:
    """Attention maps of one run of the model: layer × head × Tq × Tk, with tokens and kinds.

    Args:
        model: any ``nn.Module`` containing :class:`~qkv.MultiHeadAttention` modules.
        inputs, kwargs: passed to ``run`` (default: ``model`` itself).
        layers: indices, names or glob patterns of the attention modules to keep (all if None).
        heads: head indices to keep, for every layer or as ``{layer_name: [heads]}``.
        tokens, source_tokens: labels (see :meth:`Recorder.steps`).
        batch_index: which batch row to keep.
        run: what to call instead of ``model`` (e.g. ``model.greedy``); decoding steps are
            merged into whole-sequence maps (see :func:`~qkv.capture.maps.merge_steps`).
    """
    steps = capture_steps(
        model, *inputs, layers=layers, heads=heads, tokens=tokens, source_tokens=source_tokens,
        batch_index=batch_index, run=run, **kwargs,
    )  # fmt: skip
    if not steps:
        raise RuntimeError("the run made no attention call in the chosen layers")
    return steps[0] if len(steps) == 1 else merge_steps(steps)
