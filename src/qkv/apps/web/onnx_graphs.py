"""The page's model graphs, traced from qkv's own modules: no second copy of the math.

A model becomes ONNX graphs that ONNX Runtime Web runs in the page, made from a
:class:`Spec` (the model's attention modules by role and its own methods:
:func:`seq2seq_spec` for the shipped translators, :func:`tiny_seq2seq_spec` for the random
tiny seq2seq, :func:`encoder_spec` for MiniLM and the random tiny encoder):

* ``encoder``: ``src (1, S)`` → the memory (an encoder's hidden states), every encoder
  layer's weights and the intermediates of the step-by-step view, and for a translator every
  decoder layer's cross-attention keys and values (``cross_attn.project_kv(memory)``, as the
  cross cache holds them);
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

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.attention import MultiHeadAttention
from qkv.functional import attention_steps

__all__ = ["STEP_KEYS", "DecoderGraph", "EncoderGraph", "Spec", "TensorCache", "encoder_spec",
           "graph_io", "seq2seq_spec", "tiny_seq2seq_spec", "traced_attention"]

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


@dataclass
class Spec:
    """What the graphs need to know of a model: its attention modules by role, its sizes, and
    how to run it (the model's own methods; only the decoder's offset is passed explicitly,
    as a traced size)."""

    model: nn.Module
    encoder: list[tuple[str, MultiHeadAttention]]  # self-attention of the encoder (or encoder-only)
    decoder: list[nn.Module]  # decoder layers (each .self_attn, .cross_attn); [] for an encoder
    encode: Callable[[Tensor], Tensor]  # ids (1, S) → hidden/memory (1, S, d_model)
    # tgt (N, T), memory_mask, [(self cache, cross cache)] per layer, offset → logits (N, T, V)
    step: Callable[..., Tensor] | None = None

    @property
    def first(self) -> MultiHeadAttention:
        return self.encoder[0][1]

    def dims(self) -> dict:
        m = self.first
        return {"d_model": m.d_model, "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads,
                "d_k": m.d_k, "n_encoder_layers": len(self.encoder),
                "n_decoder_layers": len(self.decoder)}  # fmt: skip


def seq2seq_spec(model: nn.Module) -> Spec:
    """A :class:`~qkv.models.Seq2SeqTransformer` (the shipped translators)."""
    dec = model.decoder

    def step(tgt, memory_mask, caches, offset):  # Decoder.forward, the offset given
        x = dec.embed(tgt, offset)  # (N, T, d_model)
        for layer, (self_cache, cross_cache) in zip(dec.layers, caches):
            x = layer(x, _UNREAD, memory_mask, self_cache=self_cache, cross_cache=cross_cache)
        return dec.out(dec.norm(x))  # (N, T, V)

    enc = [(f"encoder.layers.{i}.self_attn", layer.self_attn)
           for i, layer in enumerate(model.encoder.layers)]  # fmt: skip
    return Spec(model, enc, list(dec.layers), lambda src: model.encode(src, model.src_mask(src)),
                step)  # fmt: skip


def tiny_seq2seq_spec(model: nn.Module) -> Spec:
    """The random tiny seq2seq (:class:`qkv.inspect.tiny.TinySeq2Seq`): no source mask."""

    def step(tgt, memory_mask, caches, offset):
        return model.decode(tgt, _UNREAD, caches=caches, offset=offset)  # (N, T, V)

    enc = [(f"encoder.layers.{i}.self_attn", layer.self_attn)
           for i, layer in enumerate(model.encoder.layers)]  # fmt: skip
    return Spec(model, enc, list(model.decoder.layers), model.encode, step)


def encoder_spec(model: nn.Module, encode: Callable[[Tensor], Tensor]) -> Spec:
    """An encoder alone (MiniLM, the random tiny encoder): ``encode(ids)`` → hidden."""
    from qkv.capture.record import attention_modules

    return Spec(model, attention_modules(model), [], encode)


# a filled cross cache: the decoder's layers never read the memory itself
_UNREAD = torch.zeros(1)


class EncoderGraph(nn.Module):
    """``src (1, S)``, ``head_mask (L_enc, h)`` → ``memory (1, S, d_model)`` (an encoder-only
    model: its hidden states), ``x (L_enc, 1, S, d_model)`` (each self-attention's input),
    the step tensors (:data:`STEP_KEYS`, ``(L_enc, 1, h, S, ·)``), and for a seq2seq model
    ``memory_k``/``memory_v`` ``(L_dec, 1, h_kv, S, d_k)``."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        self.model = spec.model  # its parameters are the graph's

    def forward(self, src: Tensor, head_mask: Tensor) -> tuple[Tensor, ...]:
        spec = self.spec
        names = [n for n, _ in spec.encoder]
        inputs: list[Tensor] = []
        grab = [m.register_forward_pre_hook(lambda _m, a: inputs.append(a[0]))
                for _, m in spec.encoder]  # fmt: skip
        try:
            with traced_attention(spec.encoder, head_mask) as found:
                memory = spec.encode(src)  # (1, S, d_model)
        finally:
            for g in grab:
                g.remove()
        out = (memory, torch.stack(inputs), *(_stack(found, names, k) for k in STEP_KEYS))
        if not spec.decoder:
            return out
        cross = [layer.cross_attn.project_kv(memory) for layer in spec.decoder]
        return (*out, torch.stack([k for k, _ in cross]), torch.stack([v for _, v in cross]))


class DecoderGraph(nn.Module):
    """``tgt (N, T)``, ``memory_mask (N, 1, 1, S)`` (bool, True = may attend),
    ``past_k``/``past_v`` ``(L, N, h_kv, P, d_k)``, ``memory_k``/``memory_v``
    ``(L, N, h_kv, S, d_k)`` (the cross caches: the memory itself is not read),
    ``head_mask (2·L, h)`` (each layer's self, then cross) → ``logits (N, V)`` of the last
    position, ``next_k``/``next_v`` ``(L, N, h_kv, P + T, d_k)``, then for self- and
    cross-attention: ``x (L, N, T, d_model)`` and the step tensors."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        self.model = spec.model
        n = len(spec.decoder)
        self.self_names = [f"decoder.layers.{i}.self_attn" for i in range(n)]
        self.cross_names = [f"decoder.layers.{i}.cross_attn" for i in range(n)]
        self.mods = [(nm, m) for i, layer in enumerate(spec.decoder)
                     for nm, m in ((self.self_names[i], layer.self_attn),
                                   (self.cross_names[i], layer.cross_attn))]  # fmt: skip

    def forward(self, tgt: Tensor, memory_mask: Tensor, past_k: Tensor, past_v: Tensor,
                memory_k: Tensor, memory_v: Tensor, head_mask: Tensor) -> tuple[Tensor, ...]:
        L = len(self.self_names)
        caches = [(TensorCache(past_k[i], past_v[i]), TensorCache(memory_k[i], memory_v[i]))
                  for i in range(L)]  # fmt: skip
        inputs: dict[str, Tensor] = {}
        grab = [m.register_forward_pre_hook(lambda _m, a, n=n: inputs.__setitem__(n, a[0]))
                for n, m in self.mods]  # fmt: skip
        try:
            with traced_attention(self.mods, head_mask) as found:
                # the offset a traced size: the model's len(cache) would be a constant
                logits = self.spec.step(tgt, memory_mask, caches, past_k.shape[3])  # (N, T, V)
        finally:
            for g in grab:
                g.remove()
        out = [logits[:, -1], torch.stack([c.k for c, _ in caches]),
               torch.stack([c.v for c, _ in caches])]
        for names in (self.self_names, self.cross_names):
            out.append(torch.stack([inputs[n] for n in names]))
            out += [_stack(found, names, k) for k in STEP_KEYS]
        return tuple(out)


def graph_io(kind: str, spec: Spec) -> tuple[tuple, list[str], list[str], dict]:
    """Example arguments, input and output names and dynamic axes of graph ``kind``
    (``"encoder"`` or ``"decoder"``) of ``spec``'s model, for ``torch.onnx.export``."""
    d = spec.dims()
    h, kv, d_k = d["n_heads"], d["n_kv_heads"], d["d_k"]
    L_enc, L_dec, S = d["n_encoder_layers"], d["n_decoder_layers"], 5
    steps = list(STEP_KEYS)
    if kind == "encoder":
        args = (torch.tensor([[5] * S]), torch.ones(L_enc, h))
        cross = ["memory_k", "memory_v"] if L_dec else []
        return args, ["src", "head_mask"], ["memory", "x", *steps, *cross], {"src": {1: "S"}}
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
