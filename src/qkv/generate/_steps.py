"""Next-token logits step by step for greedy and beam search, whichever way the model runs.

A :class:`~qkv.models.Seq2SeqTransformer` in eval mode runs through
:class:`~qkv.models.incremental.IncrementalDecoder` (fused projections, the memory's keys and
values computed once per sentence, caches preallocated and written in place, beams reordered
by index); any other model through ``model.decode(..., cache=model.new_cache())``.

Shapes: ``src (B, S)``; ``tokens (N,)`` → logits ``(N, V)`` with ``N = B·beams``
(sentence-major, beams inner).
"""

from __future__ import annotations

from torch import Tensor

from qkv.models.incremental import IncrementalDecoder, hypothesis_rows


class _Steps:
    """Next-token logits ``(N, V)`` step by step, for ``N = B·beams`` hypotheses: the
    incremental decoder where it runs the model, else ``model.decode`` with its cache."""

    def __init__(self, model, src: Tensor, beams: int, max_steps: int, cache_dtype=None):
        self.model, self.beams = model, beams
        mask = model.src_mask(src)  # (B, 1, 1, S), True = may attend
        self.fast = IncrementalDecoder.for_model(model)
        if self.fast is not None:
            memory = self.fast.encode(src, mask)  # (B, S, d_model)
            # every beam starts from the same <s>: the first step runs one row per sentence
            self.state = self.fast.start(memory, mask, beams=1, max_steps=max_steps,
                                         cache_dtype=cache_dtype)  # fmt: skip
        else:  # the general path: one row per hypothesis
            memory = model.encode(src, mask)  # (B, S, d_model)
            self.memory = memory.repeat_interleave(beams, dim=0)  # (B·beams, S, d_model)
            self.mask = mask.repeat_interleave(beams, dim=0)
            self.cache = model.new_cache()

    def __call__(self, tokens: Tensor) -> Tensor:
        """``tokens (N,)`` → logits ``(N, V)``."""
        if self.fast is not None:
            K = self.beams
            if K > 1 and self.state.t == 0:  # identical rows: decode one, then copy
                logits = self.fast.step(self.state, tokens[::K])  # (B, V)
                self.state.expand(K)
                return logits.repeat_interleave(K, dim=0)  # (B·K, V)
            return self.fast.step(self.state, tokens)
        return self.model.decode(tokens[:, None], self.memory, self.mask, cache=self.cache)[:, -1]

    def reorder(self, rows: Tensor) -> None:
        if self.fast is not None:
            self.state.reorder(rows)
        else:
            self.cache.reorder(rows)

    def close(self) -> None:
        """The search is over: the incremental decoder's caches go back to its pool."""
        if self.fast is not None:
            self.state.release()

    def keep(self, sentences: Tensor) -> None:
        """Only the sentences ``sentences (B',)`` still run, with all their beams."""
        if self.fast is not None:
            self.state.keep(sentences)
        else:
            rows = hypothesis_rows(sentences, self.beams)
            self.cache.reorder(rows)
            self.memory, self.mask = self.memory[rows], self.mask[rows]
