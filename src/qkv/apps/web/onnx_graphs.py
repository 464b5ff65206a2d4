"""The page's model graphs, traced from qkv's own modules: no second copy of the math.

A shipped translator (:class:`~qkv.models.Seq2SeqTransformer`) becomes two ONNX graphs that
ONNX Runtime Web runs in the page:

* ``encoder``: ``src (1, S)`` → the memory, every encoder layer's weights and the
  intermediates of the step-by-step view, and every decoder layer's cross-attention keys
  and values (``cross_attn.project_kv(memory)``, as the cross cache holds them);
* ``decoder``: ``tgt (N, T)`` new tokens over self-attention caches of ``P`` positions →
  the logits of the last position, the grown caches, every layer's weights and
  intermediates. ``T = 1`` is one decoding step (greedy, beam: ``N`` hypotheses); ``P = 0``
  with the whole target is the teacher-forced replay the step view shows, as
  :func:`qkv.apps.serve.compute.step_detail` replays it.

Both run the real ``forward`` of the model's modules: each
:class:`~qkv.attention.MultiHeadAttention` on its reference path (``backend="math"``,
:func:`qkv.functional.attention_steps`), its ``head_mask`` a graph input (heads switched
off), its caches a :class:`TensorCache` (a :class:`~qkv.cache.KVCache` made of the graph's
tensors). A forward hook recomputes the step view's matrices from each call's inputs, as
``step_detail`` does; ONNX Runtime merges the repeated projections (common subexpression
elimination).

Shapes: ``L`` layers, ``h`` heads, ``d_k`` per head; stacked per layer ``(L, N, h, ...)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from qkv.attention import MultiHeadAttention
from qkv.functional import attention_steps
from qkv.models.decoder import DecoderCache

__all__ = ["STEP_KEYS", "DecoderGraph", "EncoderGraph", "TensorCache", "graph_io",
           "traced_attention"]

# the step view's matrices each attention call gives (qkv.apps.serve.answer.STEPS, less the
# inputs x/context which the graphs give once per layer): all (N, h, Tq, ·) but concat and wo
STEP_KEYS = ("q", "k", "v", "scores", "scaled", "mask", "masked", "weights", "output", "concat",
             "wo", "real")  # fmt: skip


class TensorCache:
    """A :class:`~qkv.cache.KVCache` over plain tensors, for tracing: ``update`` concatenates
    (a graph op, where ``KVCache`` writes into a buffer), ``len`` is the keys' length."""

    def __init__(self, k: Tensor, v: Tensor) -> None:
        self.k, self.v = k, v  # (N, h_kv, P, d_k)

    def __len__(self) -> int:
        return self.k.shape[2]

    def claim(self, layer: object) -> None:  # one cache per layer by construction
        pass

    @property
    def is_empty(self) -> bool:
        return False  # a cross cache comes filled; a self cache is always appended to

    @property
    def batch_size(self) -> int:
        return self.k.shape[0]

    @property
    def keys(self) -> Tensor:
        return self.k

    @property
    def values(self) -> Tensor:
        return self.v

    def update(self, k: Tensor, v: Tensor, **_) -> tuple[Tensor, Tensor]:
        self.k = torch.cat([self.k, k], dim=2)  # (N, h_kv, P + T, d_k)
        self.v = torch.cat([self.v, v], dim=2)
        return self.k, self.v


def _steps(module: MultiHeadAttention, args: tuple, kwargs: dict, real: Tensor) -> dict:
    """The step view's tensors of one call of ``module`` (what ``step_detail`` recomputes)."""
    x = args[0]  # (N, Tq, d_model)
    context = args[1] if len(args) > 1 else kwargs.get("context")
    cache = kwargs.get("cache")
    q = module.split_heads(module.w_q(x), module.n_heads)  # (N, h, Tq, d_k)
    if cache is not None:  # the keys the call attended to: the (grown) cache
        k, v = cache.keys, cache.values  # (N, h_kv, Tk, d_k)
    else:
        k, v = module.project_kv(x if context is None else context)
    s = attention_steps(q, k, v, mask=kwargs.get("mask"), causal=bool(kwargs.get("causal")))
    out = s.output * module._head_scale(s.output)  # (N, h, Tq, d_k), switched-off heads: 0
    concat = module.merge_heads(out)  # (N, Tq, h·d_k)
    mask = s.mask if s.mask is not None else torch.ones_like(s.scores, dtype=torch.bool)
    return {"q": s.q, "k": s.k, "v": s.v, "scores": s.scores, "scaled": s.scaled,
            "mask": mask.expand(s.scores.shape).float(), "masked": s.masked,
            "weights": s.weights, "output": out, "concat": concat, "wo": module.w_o(concat),
            "real": real}  # fmt: skip


@contextmanager
def traced_attention(
    modules: list[tuple[str, MultiHeadAttention]], head_mask: Tensor
) -> Iterator[dict[str, dict]]:
    """Run ``modules`` on the reference path with ``head_mask (len(modules), h)`` and collect,
    by module name, the step tensors of its (one) call."""
    found: dict[str, dict] = {}
    saved = [(m, m.backend, m.head_mask, m.recorder) for _, m in modules]
    handles = []
    for i, (name, m) in enumerate(modules):
        # a recorder keeps the call on the reference path with its weights (the path without
        # them asks a compiled kernel whether the values are finite: no graph op)
        m.backend, m.head_mask, m.recorder = "math", head_mask[i], lambda _w, _kind: None

        def hook(mod, args, kwargs, out, name=name):
            found[name] = _steps(mod, args, kwargs, out)

        handles.append(m.register_forward_hook(hook, with_kwargs=True))
    try:
        yield found
    finally:
        for h in handles:
            h.remove()
        for m, backend, hm, rec in saved:
            m.backend, m.head_mask, m.recorder = backend, hm, rec


def _stack(found: dict[str, dict], names: list[str], key: str) -> Tensor:
    return torch.stack([found[n][key] for n in names])  # (L, ...)


class EncoderGraph(nn.Module):
    """``src (1, S)``, ``head_mask (L_enc, h)`` → ``memory (1, S, d_model)``,
    ``x (L_enc, 1, S, d_model)`` (each self-attention's input), the step tensors
    (:data:`STEP_KEYS`, ``(L_enc, 1, h, S, ·)``), ``cross_k``/``cross_v``
    ``(L_dec, 1, h_kv, S, d_k)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.enc = [(f"encoder.layers.{i}.self_attn", layer.self_attn)
                    for i, layer in enumerate(model.encoder.layers)]  # fmt: skip

    def forward(self, src: Tensor, head_mask: Tensor) -> tuple[Tensor, ...]:
        names = [n for n, _ in self.enc]
        inputs: list[Tensor] = []
        grab = [m.register_forward_pre_hook(lambda _m, a: inputs.append(a[0])) for _, m in self.enc]
        try:
            with traced_attention(self.enc, head_mask) as found:
                memory = self.model.encode(src, self.model.src_mask(src))  # (1, S, d_model)
        finally:
            for g in grab:
                g.remove()
        cross = [layer.cross_attn.project_kv(memory) for layer in self.model.decoder.layers]
        return (memory, torch.stack(inputs), *(_stack(found, names, k) for k in STEP_KEYS),
                torch.stack([k for k, _ in cross]), torch.stack([v for _, v in cross]))


class DecoderGraph(nn.Module):
    """``tgt (N, T)``, ``memory_mask (N, 1, 1, S)`` (bool, True = may attend),
    ``past_k``/``past_v`` ``(L, N, h_kv, P, d_k)``, ``memory_k``/``memory_v``
    ``(L, N, h_kv, S, d_k)`` (the cross caches: the memory itself is not read), ``head_mask (2·L, h)`` (each layer's self, then cross) →
    ``logits (N, V)`` of the last position, ``next_k``/``next_v`` ``(L, N, h_kv, P + T, d_k)``,
    then for self- and cross-attention: ``x (L, N, T, d_model)`` and the step tensors."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        layers = model.decoder.layers
        self.self_names = [f"decoder.layers.{i}.self_attn" for i in range(len(layers))]
        self.cross_names = [f"decoder.layers.{i}.cross_attn" for i in range(len(layers))]
        self.mods = [(n, m) for i, layer in enumerate(layers)
                     for n, m in ((self.self_names[i], layer.self_attn),
                                  (self.cross_names[i], layer.cross_attn))]  # fmt: skip

    def forward(self, tgt: Tensor, memory_mask: Tensor, past_k: Tensor, past_v: Tensor,
                memory_k: Tensor, memory_v: Tensor, head_mask: Tensor) -> tuple[Tensor, ...]:
        L = len(self.self_names)
        cache = DecoderCache(0)
        cache.self_attn = [TensorCache(past_k[i], past_v[i]) for i in range(L)]
        cache.cross_attn = [TensorCache(memory_k[i], memory_v[i]) for i in range(L)]
        unread = torch.zeros(1)  # a filled cross cache: the layers never read the memory
        inputs: dict[str, Tensor] = {}
        grab = [m.register_forward_pre_hook(lambda _m, a, n=n: inputs.__setitem__(n, a[0]))
                for n, m in self.mods]  # fmt: skip
        dec = self.model.decoder
        try:
            with traced_attention(self.mods, head_mask) as found:
                # Decoder.forward with the offset a traced size: len(cache) would be a constant
                x = dec.embed(tgt, past_k.shape[3])  # (N, T, d_model)
                for i, layer in enumerate(dec.layers):
                    x = layer(x, unread, memory_mask, self_cache=cache.self_attn[i],
                              cross_cache=cache.cross_attn[i])  # fmt: skip
                logits = dec.out(dec.norm(x))  # (N, T, V)
        finally:
            for g in grab:
                g.remove()
        out = [logits[:, -1], torch.stack([c.k for c in cache.self_attn]),
               torch.stack([c.v for c in cache.self_attn])]
        for names in (self.self_names, self.cross_names):
            out.append(torch.stack([inputs[n] for n in names]))
            out += [_stack(found, names, k) for k in STEP_KEYS]
        return tuple(out)


def graph_io(kind: str, model: nn.Module) -> tuple[tuple, list[str], list[str], dict]:
    """Example arguments, input and output names and dynamic axes of graph ``kind``
    (``"encoder"`` or ``"decoder"``) of ``model``, for ``torch.onnx.export``."""
    cfg = model.cfg
    h, kv, d_k = cfg.n_heads, cfg.kv_heads, cfg.d_k
    L_enc, L_dec, S = cfg.n_encoder_layers, cfg.n_decoder_layers, 5
    steps = list(STEP_KEYS)
    if kind == "encoder":
        args = (torch.tensor([[5] * (S - 1) + [cfg.eos_id]]), torch.ones(L_enc, h))
        outputs = ["memory", "x", *steps, "memory_k", "memory_v"]
        return args, ["src", "head_mask"], outputs, {"src": {1: "S"}}
    N, P, T = 2, 3, 1  # sizes to trace with (every one dynamic)
    args = (torch.full((N, T), 5), torch.ones(N, 1, 1, S, dtype=torch.bool),
            torch.randn(L_dec, N, kv, P, d_k), torch.randn(L_dec, N, kv, P, d_k),
            torch.randn(L_dec, N, kv, S, d_k), torch.randn(L_dec, N, kv, S, d_k),
            torch.ones(2 * L_dec, h))  # fmt: skip
    inputs = ["tgt", "memory_mask", "past_k", "past_v", "memory_k", "memory_v", "head_mask"]
    outputs = ["logits", "next_k", "next_v",
               *(f"{p}.{k}" for p in ("self", "cross") for k in ("x", *steps))]  # fmt: skip
    cache = {1: "N", 3: "P"}
    dynamic = {"tgt": {0: "N", 1: "T"}, "memory_mask": {0: "N", 3: "S"}, "past_k": cache,
               "past_v": cache, "memory_k": {1: "N", 3: "S"}, "memory_v": {1: "N", 3: "S"}}  # fmt: skip
    return args, inputs, outputs, dynamic
