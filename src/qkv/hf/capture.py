"""Exact per-head attention weights of any transformers model, computed through qkv.

Inside :func:`capture_attention`, every call of a chosen attention module runs qkv's fast path
and returns its log-sum-exp; the weights of the chosen heads are then recomputed from it
(``exp(s - lse)``, :func:`qkv.weights.weights_from_lse`), so asking for one head costs
one head's ``Tq×Tk``, never all of them. They equal the model's ``output_attentions=True``
under ``attn_implementation="eager"`` (rows of padded queries, which see no key, are zeros).

A call that qkv hands back to transformers' eager attention (see :mod:`qkv.hf.attention`)
is recorded from the weights eager computes; one handed to sdpa, which returns no weights,
from qkv's reference math on the same arguments (:func:`qkv.hf.steps.fallback_replay`). The model runs with ``attn_implementation="qkv"``
for the duration of the block (switched and restored when it was loaded with another one).
Each call of each chosen module is one :class:`HFRecord`, in call order: a ``generate`` gives
one record per module per step.

>>> with capture_attention(model, layers=[0], heads=[2]) as cap:     # doctest: +SKIP
...     model(input_ids)
>>> cap.records[0].weights.shape  # (B, 1 head, Tq, Tk)                # doctest: +SKIP
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from torch import Tensor, nn

from qkv.capture.maps import AttentionMaps, layer_labels, merge_steps
from qkv.capture.record import select_modules
from qkv.hf.registry import running_qkv

__all__ = [
    "HFCapture",
    "HFRecord",
    "active",
    "attention_modules",
    "capture_attention",
    "module_kind",
]

_ACTIVE: ContextVar[HFCapture | None] = ContextVar("qkv_hf_capture", default=None)
_CALLS_INTERFACE: dict[type, bool] = {}
_CROSS_NAMES = ("encoder_attn", "EncDecAttention", "crossattention", "cross_attn")


def active() -> HFCapture | None:
    """The capture open in this context, if any (read by the attention adapter)."""
    return _ACTIVE.get()


def _is_attention(cls: type) -> bool:
    """Whether ``cls.forward`` calls transformers' ``AttentionInterface`` (cached per class)."""
    if cls not in _CALLS_INTERFACE:
        try:
            src = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            src = ""
        _CALLS_INTERFACE[cls] = "ALL_ATTENTION_FUNCTIONS" in src
    return _CALLS_INTERFACE[cls]


def attention_modules(
    model: nn.Module, layers: Sequence[int | str] | None = None
) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the modules that call the attention function, in model order,
    optionally selected: ``layers`` items are indices into that list, exact names or glob
    patterns (as :func:`qkv.capture.attention_modules` takes them for qkv's own models)."""
    found = [(n, m) for n, m in model.named_modules() if _is_attention(type(m))]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no module calling transformers' AttentionInterface"
        )
    return select_modules(found, layers)


def module_kind(name: str, module: nn.Module) -> str:
    """``"cross"``, ``"causal"`` or ``"self"`` (bidirectional), as :class:`AttentionMaps` uses."""
    last = name.rsplit(".", 1)[-1]
    parent = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    if (getattr(module, "is_cross_attention", False) or "Cross" in type(module).__name__
            or last in _CROSS_NAMES or parent in _CROSS_NAMES):  # fmt: skip
        return "cross"
    return "causal" if getattr(module, "is_causal", True) else "self"


@dataclass
class HFRecord:
    """One call of one attention module: weights ``(B, H, Tq, Tk)`` of heads ``heads``."""

    name: str
    kind: str
    step: int  # the module's call count (decoding steps)
    q_offset: int  # query rows this module saw in earlier calls
    heads: list[int]
    weights: Tensor


class HFCapture:
    """Collects :class:`HFRecord` s of the chosen modules; made by :func:`capture_attention`."""

    def __init__(self, chosen: list[tuple[str, nn.Module]], heads: Sequence[int] | None) -> None:
        self.names = {id(m): n for n, m in chosen}
        self.kinds = {id(m): module_kind(n, m) for n, m in chosen}
        self.heads = None if heads is None else [int(h) for h in heads]
        self.records: list[HFRecord] = []
        self._calls: dict[int, tuple[int, int]] = {}

    def heads_for(self, module: nn.Module, n_heads: int) -> list[int] | None:
        """The head indices to record for this module's call, or ``None`` (not chosen)."""
        if id(module) not in self.names:
            return None
        heads = list(range(n_heads)) if self.heads is None else self.heads
        bad = [h for h in heads if not 0 <= h < n_heads]
        if bad:
            raise ValueError(f"heads {bad} out of range for {self.names[id(module)]!r} "
                             f"with {n_heads} heads")  # fmt: skip
        return heads

    def record(self, module: nn.Module, weights: Tensor, heads: list[int], causal: bool) -> None:
        """Store ``weights (B, len(heads), Tq, Tk)`` of one call of ``module``."""
        key = id(module)
        calls, seen = self._calls.get(key, (0, 0))
        self._calls[key] = (calls + 1, seen + weights.shape[-2])
        kind = self.kinds[key]
        if kind != "cross":
            kind = "causal" if causal else "self"
        self.records.append(HFRecord(self.names[key], kind, calls, seen, list(heads),
                                     weights.detach()))  # fmt: skip

    def weights(self, kind: str | None = None) -> list[Tensor]:
        """The recorded weights in call order, optionally only those of one ``kind``."""
        return [r.weights for r in self.records if kind is None or r.kind == kind]

    def maps(
        self,
        *,
        tokens: Sequence[str] | None = None,
        source_tokens: Sequence[str] | None = None,
        batch_index: int = 0,
    ) -> AttentionMaps:
        """Whole-sequence :class:`~qkv.capture.AttentionMaps` of one batch row (float32, CPU).

        ``tokens`` label the queries and the causal/self keys; ``source_tokens`` (seq2seq)
        label the encoder's rows and columns and the cross-attention keys. Decoding steps are
        merged (:func:`~qkv.capture.maps.merge_steps`).
        """
        if not self.records:
            raise RuntimeError("no attention call was captured in the chosen layers")
        steps = []
        for s in range(1 + max(r.step for r in self.records)):
            recs = [r for r in self.records if r.step == s]
            if not 0 <= batch_index < recs[0].weights.shape[0]:
                raise IndexError(f"batch_index {batch_index} out of range for batch size "
                                 f"{recs[0].weights.shape[0]}")  # fmt: skip
            labels = [layer_labels(r.kind, r.q_offset, *r.weights.shape[-2:], tokens,
                                   source_tokens) for r in recs]  # fmt: skip
            q_tok, k_tok = [q for q, _ in labels], [k for _, k in labels]
            steps.append(AttentionMaps(
                [r.weights[batch_index].float().cpu() for r in recs], [r.name for r in recs],
                [r.kind for r in recs], [r.heads for r in recs], q_tok, k_tok,
                [r.q_offset for r in recs], s,
            ))  # fmt: skip
        return steps[0] if len(steps) == 1 else merge_steps(steps)


@contextmanager
def capture_attention(
    model: nn.Module,
    layers: Sequence[int | str] | None = None,
    heads: Sequence[int] | None = None,
) -> Iterator[HFCapture]:
    """Record the per-head attention weights of ``model``'s attention modules in this block.

    Args:
        model: a transformers ``PreTrainedModel`` (any ``attn_implementation``; it runs with
            "qkv" inside the block).
        layers: indices into :func:`attention_modules` (model order: encoder, then decoder
            self/cross interleaved), exact module names or glob patterns; all when None.
        heads: query-head indices to keep in every chosen layer; all when None. Only these
            heads' weights are ever computed.

    Yields the :class:`HFCapture`; read ``.records`` / ``.weights()`` / ``.maps()`` after the
    model ran. Weights carry no gradient.
    """
    chosen = attention_modules(model, layers)
    cap = HFCapture(chosen, heads)
    with running_qkv(model):
        token = _ACTIVE.set(cap)
        try:
            yield cap
        finally:
            _ACTIVE.reset(token)
