"""Token-by-token decoding of a :class:`~qkv.models.CausalLM` with prepared weights.

The same math as ``lm(ids, cache=caches)`` for one new token per sequence, without the
module tree: per layer, one fused ``W_q, W_k, W_v`` product, RoPE from a table, the new
keys/values written into the caches in place, attention through the path
:func:`qkv.functional.scaled_dot_product_attention` would choose (resolved once per key-length
range, not per step), ``W_O``, the feed-forward; each linear stored the way a few rows
multiply fastest. At long contexts a step is a read of the weights and the caches, so what
this removes is the per-step cost around those reads: Python, module calls, small ops.

The caches are the model's own (:meth:`CausalLM.new_cache`): fill them with ``lm(prompt,
cache=caches)`` (prefill, any number of tokens), then :meth:`LMDecoder.step` continues them.

Shapes: ``tokens (B,)`` → logits ``(B, V)``; caches ``(B, h_kv, T, d_k)`` per layer.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qkv.cache import KVCache
from qkv.models.decode_state import DecodeState
from qkv.models.prepared_steps import PreparedSteps, _unprepared
from qkv.models.prepared_weights import _EncoderLayer
from qkv.positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding

__all__ = ["LMDecoder"]


class LMDecoder(PreparedSteps):
    """A :class:`~qkv.models.CausalLM` prepared for token-by-token use.

    >>> dec = LMDecoder.for_model(lm)  # doctest: +SKIP
    >>> caches = lm.new_cache(capacity=T + new); lm(prompt, cache=caches)  # doctest: +SKIP
    >>> state = dec.start(caches)  # doctest: +SKIP
    >>> logits = dec.step(state, next_tokens)  # (B, V)  # doctest: +SKIP
    """

    def __init__(self, lm: nn.Module) -> None:
        why = self.unsupported(lm)
        if why is not None:  # for_model() returns None instead
            raise ValueError(f"LMDecoder cannot run this model: {why}")
        self._prepare_ends(lm.cfg, lm.embed, lm.norm, lm.out)
        self.layers = [_EncoderLayer(layer, lm.cfg.activation) for layer in lm.layers]

    @staticmethod
    def unsupported(lm: nn.Module, attention: list | None = None,
                    modules: list | None = None) -> str | None:  # fmt: skip
        """Why :class:`LMDecoder` cannot run ``lm`` (``None``: it can)."""
        from qkv.models.causal_lm import CausalLM

        if not isinstance(lm, CausalLM):
            return f"not a CausalLM ({type(lm).__name__})"
        return _unprepared(lm, lm.embed.embedding.weight, attention, modules)

    def start(self, caches: list[KVCache], max_len: int | None = None) -> DecodeState:
        """State continuing ``caches`` (one per layer, all of the same length: the prompt's).

        ``max_len``: the most positions the sequence will reach (sizes the position table of
        sinusoidal/learned positions; default: the caches' capacity)."""
        if len(caches) != len(self.layers):
            raise ValueError(f"caches must hold one KVCache per layer ({len(self.layers)}), "
                             f"got {len(caches)}")  # fmt: skip
        lengths = {len(c) for c in caches}
        if len(lengths) != 1:
            raise ValueError(f"caches must all hold the same length, got {sorted(lengths)}")
        state = DecodeState(caches, [], None, 1)
        state.t = state.t0 = lengths.pop()
        n = max_len or max(c.capacity for c in caches) or state.t + 1
        w = self.embedding
        if isinstance(self.position, SinusoidalPositionalEncoding):
            state.positions = self.position.table(n, device=w.device, dtype=w.dtype)
        elif isinstance(self.position, LearnedPositionalEmbedding):
            state.positions = self.position.embedding.weight.detach()
        return state

    def step(self, state: DecodeState, tokens: Tensor) -> Tensor:
        """Feed one token per sequence ``tokens (B,)``; return next-token logits ``(B, V)``."""
        B, t, d = tokens.shape[0], state.t, self.d
        x = torch.nn.functional.embedding(tokens, self.embedding)  # (B, d), scaled by √d_model
        if state.positions is not None:
            if t >= state.positions.shape[0]:
                raise ValueError(f"position {t} is past the model's {state.positions.shape[0]}")
            x = x.add_(state.positions[t])
        kv_w = self.h_kv * self.d_k
        for i, L in enumerate(self.layers):
            h = self._sub_in(x, L.norms[0])
            qkv = L.qkv(h)  # (B, (h + 2·h_kv)·d_k)
            q = qkv[:, :d].view(B, self.h, 1, self.d_k)  # (B, h, 1, d_k)
            k = qkv[:, d : d + kv_w].view(B, self.h_kv, 1, self.d_k)  # (B, h_kv, 1, d_k)
            v = qkv[:, d + kv_w :].view(B, self.h_kv, 1, self.d_k)
            if L.rope is not None:
                q, k = L.rope.rotate(q, t), L.rope.rotate(k, t)
            k_all, v_all = state.caches[i].update(k, v, check=t == state.t0)  # (B, h_kv, t+1, d_k)
            a = self._attend("self", L.backend, q, k_all, v_all, None, state)  # (B, h, 1, d_k)
            x = self._sub_out(x, L.o(a.reshape(B, d)), L.norms[0])
            h = self._sub_in(x, L.norms[1])
            x = self._sub_out(x, L.w2(L.w1(h)), L.norms[1])
        if self.final_norm is not None:
            x = torch.layer_norm(x, (d,), *self.final_norm)
        state.t = t + 1
        return self.out(x)  # (B, V)
