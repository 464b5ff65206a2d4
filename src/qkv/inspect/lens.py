"""What each layer of a decoder predicts, and what each head writes toward the logits.

Two readings of one forward pass (:func:`lens`), for qkv's translators' decoder, qkv's
:class:`~qkv.models.CausalLM` and transformers decoder-only causal LMs (the parts are found
by :mod:`qkv.inspect.lens_parts`):

* **Logit lens** (nostalgebraist, 2020): the residual stream after the embeddings and after
  each block, put through the model's final norm and unembedding as if it were the last
  layer: per layer and position, the top-k next tokens and their probabilities. The last
  row is the model's own prediction.
* **Direct logit attribution** at one position: in a pre-LN model the final residual is the
  sum of what each part wrote into it: the embeddings, each head (its output through its
  slice of ``W_O``), each attention output bias, each MLP. Each write is put through the
  final norm's *linear part with the scale frozen* at the actual final residual (the
  standard approximation: the norm's division by σ(x) is shared by all writes, so it is
  treated as a constant) and the unembedding: its direct effect on every logit. The writes'
  effects, plus the norm's and unembedding's biases, sum to the model's logits (``check``).
  It is the *direct* effect only: what a head's write does through later layers is not in it.

Shapes: ``resid (L + 1, T, d_model)``; a head's write ``(d_model,)``; logits ``(V,)``.

>>> from qkv.models import CausalLM, TransformerConfig
>>> cfg = TransformerConfig(src_vocab_size=40, tgt_vocab_size=40, d_model=32, n_heads=4,
...                         n_decoder_layers=2, dropout=0.0)
>>> out = lens(CausalLM(cfg).eval(), torch.tensor([[1, 7, 9]]), top_k=3)
>>> out.top_ids.shape, len(out.heads), out.check < 1e-4
(torch.Size([3, 3, 3]), 8, True)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from qkv.inspect.lens_parts import DecoderParts, decoder_parts, frozen_norm, proj_weight

__all__ = ["Decomposition", "HeadAttribution", "Lens", "decompose", "lens"]

# relative size of a mismatch that says the residual stream is not the sum of the writes
# (post-LN, a norm after a sub-layer) rather than float rounding (more for bf16/fp16 models)
_SUM_TOL = 1e-3


def _tol(dtype: torch.dtype) -> float:
    return max(_SUM_TOL, 32 * torch.finfo(dtype).eps) if dtype.is_floating_point else _SUM_TOL


def _off(a: Tensor, b: Tensor, tol: float) -> bool:
    """Whether ``a`` and ``b`` differ by more than ``tol`` of their size (at least 1)."""
    return float((a - b).abs().max()) > tol * max(1.0, float(b.abs().max()))


@dataclass
class HeadAttribution:
    """One head's direct effect on the logits at the chosen position (logit units)."""

    layer: str  # the attention module, named as in the maps
    head: int
    target: float  # on the token the model predicts there
    up: list[tuple[int, float]]  # the top-k tokens it pushes up: (id, amount), largest first
    down: list[tuple[int, float]]  # the top-k it pushes down, most negative first


@dataclass
class Lens:
    """What :func:`lens` returns."""

    layers: list[str]  # the rows: "embeddings", then each block (residual after it)
    top_ids: Tensor  # (L + 1, T, k) the lens's top-k next tokens at each layer and position
    top_probs: Tensor  # (L + 1, T, k) their probabilities
    position: int  # the position of the attribution (0-based)
    target: int  # the token the model predicts there (argmax of its logits)
    logit: float  # the model's logit of ``target`` there
    heads: list[HeadAttribution] = field(default_factory=list)  # model order
    others: list[tuple[str, float]] = field(default_factory=list)  # other parts → target
    check: float | None = None  # max over the vocabulary |Σ effects + biases − logits|
    why_not: str | None = None  # why there is no attribution (then heads, others are empty)


@dataclass
class Decomposition:
    """The final residual at one position as a sum of writes, and the map to logits.

    ``attribution()`` is ``(N, V)``: each write's direct effect; its column sums plus
    ``constant`` are the model's ``logits`` (up to float rounding) in a pre-LN model.
    """

    position: int
    names: list[str]  # one per write: "embeddings", "<attn> head <h>", "<attn> bias", "<block> mlp"
    writes: Tensor  # (N, d_model)
    resid: Tensor  # (d_model,) the final residual (the sum of the writes)
    unembed: Tensor  # (V, d_model)
    constant: Tensor  # (V,) the final norm's bias and the unembedding's bias, unembedded
    logits: Tensor  # (V,) the model's own logits at the position
    norm: nn.Module | None = None

    def linear(self, c: Tensor) -> Tensor:
        """The final norm's linear part, scale frozen at ``resid``: ``(…, d) → (…, d)``."""
        return frozen_norm(self.norm, self.resid)[0](c)

    def attribution(self, writes: Tensor | None = None) -> Tensor:
        """Direct effects ``(N, V)`` of ``writes`` (default: all of them) on the logits."""
        w = self.writes if writes is None else writes
        return self.linear(w) @ self.unembed.t()


@dataclass
class _Record:
    """What one forward pass left in the hooks (batch row 0, every position)."""

    resid: list[Tensor] = field(default_factory=list)  # (T, d) each: embeddings, after each block
    z: dict[str, Tensor] = field(default_factory=dict)  # attention name → W_O's input (T, h·d_h)
    attn: dict[str, Tensor] = field(default_factory=dict)  # attention name → its output (T, d)
    mlp: dict[str, Tensor] = field(default_factory=dict)  # block name → its MLP's output (T, d)


def _first(out) -> Tensor:
    return out[0] if isinstance(out, tuple | list) else out


@contextmanager
def _hooks(parts: DecoderParts) -> Iterator[_Record]:
    rec = _Record()
    handles = []

    def keep(t: Tensor) -> Tensor:
        return t[0].detach().clone()  # (T, …): batch row 0, safe from later in-place updates

    def embed_hook(_m, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        if rec.resid:
            raise RuntimeError("the lens needs one forward pass over the whole sequence")
        rec.resid.append(keep(x))

    def add(module: nn.Module, hook, *, pre: bool = False) -> None:
        if pre:
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        else:
            handles.append(module.register_forward_hook(hook))

    add(parts.blocks[0].module, embed_hook, pre=True)
    for b in parts.blocks:
        add(b.module, lambda _m, _a, out: rec.resid.append(keep(_first(out))))
        if b.mlp is not None:
            add(b.mlp, lambda _m, _a, out, n=b.name: rec.mlp.__setitem__(n, keep(_first(out))))
        for a in b.attention:
            add(a.proj, lambda _m, args, _k, n=a.name: rec.z.__setitem__(n, keep(args[0])),
                pre=True)  # fmt: skip
            add(a.module, lambda _m, _a, out, n=a.name: rec.attn.__setitem__(n, keep(_first(out))))
    try:
        yield rec
    finally:
        for h in handles:
            h.remove()


def _run(model: nn.Module, inputs: tuple, kwargs: dict) -> tuple[DecoderParts, _Record, Tensor]:
    """One forward pass in eval mode with the hooks on: parts, records, logits ``(T, V)``."""
    parts = decoder_parts(model)
    if not parts.blocks:
        raise ValueError("the model has no decoder blocks to read")
    was = model.training
    model.eval()  # dropout off: the writes must add up
    try:
        with torch.no_grad(), _hooks(parts) as rec:
            logits = parts.logits(model(*inputs, **kwargs))  # (B, T, V)
    finally:
        model.train(was)
    if logits.shape[0] != 1:
        raise ValueError(f"the lens reads one sequence (batch size 1), got {logits.shape[0]}")
    if len(rec.resid) != len(parts.blocks) + 1:
        raise RuntimeError(f"expected {len(parts.blocks) + 1} residual readings, got "
                           f"{len(rec.resid)}")  # fmt: skip
    return parts, rec, logits[0].float()


def _position(position: int, T: int) -> int:
    if isinstance(position, bool) or not isinstance(position, int) or not -T <= position < T:
        raise ValueError(f"position must be an int in [{-T}, {T - 1}], got {position!r}")
    return position % T


def _unembed(parts: DecoderParts) -> tuple[Tensor, Tensor | None]:
    w, b = proj_weight(parts.unembed)  # (d, V)
    return w.t().float(), None if b is None else b.float()  # (V, d), (V,)


def _decompose(parts: DecoderParts, rec: _Record, logits: Tensor, p: int
               ) -> tuple[Decomposition | None, str | None]:  # fmt: skip
    """The writes at position ``p`` and the checks that they add up (else why not)."""
    names, writes = ["embeddings"], [rec.resid[0][p].float()]
    tol = _tol(rec.resid[0].dtype)
    for i, b in enumerate(parts.blocks):
        if b.mlp is None:
            return None, f"{b.name}: no MLP module found, so its write cannot be told apart"
        for a in b.attention:
            w, bias = proj_weight(a.proj)  # (h·d_h, d)
            z = rec.z[a.name][p].float()  # (h·d_h,)
            h = a.n_heads
            if z.shape[0] % h:
                return None, f"{a.name}: W_O's input ({z.shape[0]}) does not split into {h} heads"
            per = torch.einsum("hk,hkd->hd", z.view(h, -1), w.float().reshape(h, -1, w.shape[1]))
            names += [f"{a.name} head {j}" for j in range(h)]
            writes += list(per)  # (h, d): head j's output through its slice of W_O
            total = per.sum(0)  # (d,)
            if bias is not None:
                names.append(f"{a.name} bias")
                writes.append(bias.float())
                total = total + writes[-1]
            if _off(total, rec.attn[a.name][p].float(), tol):
                return None, f"{a.name}: its heads' writes do not add up to its output"
        names.append(f"{b.name} mlp")
        writes.append(rec.mlp[b.name][p].float())
        before, after = rec.resid[i][p].float(), rec.resid[i + 1][p].float()
        added = sum(rec.attn[a.name][p].float() for a in b.attention) + writes[-1]
        if _off(before + added, after, tol):
            return None, (f"{b.name}: the block's output is not its input plus its attention "
                          f"and MLP writes (a norm after a sub-layer, as in post-LN models), so "
                          f"no write reaches the logits unchanged")  # fmt: skip
    resid = rec.resid[-1][p].float()
    try:
        _, beta = frozen_norm(parts.final_norm, resid)
    except ValueError as err:
        return None, str(err)
    W_U, b_U = _unembed(parts)
    constant = W_U @ beta + (0 if b_U is None else b_U)  # (V,)
    return Decomposition(p, names, torch.stack(writes), resid, W_U, constant, logits[p],
                         parts.final_norm), None  # fmt: skip


def decompose(model: nn.Module, *inputs, position: int = -1, **kwargs) -> Decomposition:
    """Run ``model(*inputs, **kwargs)`` once and write its final residual at ``position`` as
    the sum of what each part wrote (see the module docstring); ``ValueError`` when the
    writes do not add up (post-LN models) or the model is not a decoder the lens reads.

    >>> d = decompose(lm, ids, position=-1)                                # doctest: +SKIP
    >>> (d.attribution().sum(0) + d.constant - d.logits).abs().max()       # doctest: +SKIP
    tensor(1.9e-06)
    """
    parts, rec, logits = _run(model, inputs, kwargs)
    d, why = _decompose(parts, rec, logits, _position(position, logits.shape[0]))
    if d is None:
        raise ValueError(why)
    return d


# positions unembedded at a time by the lens table: a long text's (T, V) logits per layer
# would be 0.4 GB for GPT-2 at 2,048 positions; a block of them is a few MB
_BLOCK = 256


def _lens_table(parts: DecoderParts, rec: _Record, logits: Tensor, k: int
                ) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Top-k ids and probabilities ``(L + 1, T, k)`` of each layer's residual, unembedded
    (:data:`_BLOCK` positions at a time)."""
    ids, probs = [], []
    scale = max(1.0, float(logits.abs().max()))
    for i, x in enumerate(rec.resid):  # (T, d)
        js, ps = [], []
        for a in range(0, x.shape[0], _BLOCK):
            xb = x[a : a + _BLOCK]  # (B, d)
            with torch.no_grad():
                h = xb if parts.final_norm is None else parts.final_norm(xb[None])[0]
                lg = parts.unembed(h).float()  # (B, V)
            if i == len(rec.resid) - 1:  # the last layer's lens is the model's own output
                gap = float((lg - logits[a : a + _BLOCK]).abs().max())
                if gap > _tol(x.dtype) * scale:
                    raise ValueError(f"the final norm and unembedding found do not give the "
                                     f"model's logits (off by {gap:.3g}); the lens cannot read "
                                     f"this model")  # fmt: skip
            p, j = lg.softmax(-1).topk(k, dim=-1)  # (B, k)
            js.append(j)
            ps.append(p)
        ids.append(torch.cat(js))
        probs.append(torch.cat(ps))
    return torch.stack(ids), torch.stack(probs)


def lens(model: nn.Module, *inputs, position: int = -1, top_k: int = 5, **kwargs) -> Lens:
    """The logit lens over every layer and position, and the direct logit attribution of
    every head at ``position``, from one run of ``model(*inputs, **kwargs)`` (batch size 1,
    in eval mode for the run).

    Args:
        model: a qkv :class:`~qkv.models.Seq2SeqTransformer` (``inputs``: ``src (1, S)``,
            ``tgt (1, T)``: the decoder's inputs), a qkv :class:`~qkv.models.CausalLM`
            (``ids (1, T)``) or a transformers ``*ForCausalLM`` (``input_ids=``, …).
        position: the position whose prediction is attributed (negative: from the end).
        top_k: tokens kept per layer and position, and pushed up/down per head.

    The attribution uses the final norm with its scale frozen at the actual final residual
    (the standard approximation; see the module docstring). A model whose writes do not add
    up (post-LN) gets the lens only: ``heads`` empty and ``why_not`` saying why.

    >>> out = lens(model, src, tgt, position=-1)                   # doctest: +SKIP
    >>> out.top_ids[-1, -1, 0] == out.target                        # doctest: +SKIP
    tensor(True)
    """
    parts, rec, logits = _run(model, inputs, kwargs)
    T, V = logits.shape
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= V:
        raise ValueError(f"top_k must be an int in [1, {V}], got {top_k!r}")
    p = _position(position, T)
    ids, probs = _lens_table(parts, rec, logits, top_k)
    target = int(logits[p].argmax())
    out = Lens(["embeddings", *(b.name for b in parts.blocks)], ids, probs, p, target,
               float(logits[p, target]))  # fmt: skip
    d, out.why_not = _decompose(parts, rec, logits, p)
    if d is None:
        return out
    total = d.constant.double().clone()  # (V,)
    i = 1  # the writes after the embeddings: per block, each module's heads (and bias), the MLP
    for b in parts.blocks:  # a module's heads at a time: (h, V), never all writes × V at once
        for a in b.attention:
            eff = d.attribution(d.writes[i : i + a.n_heads])  # (h, V)
            total += eff.double().sum(0)
            for j in range(a.n_heads):
                u, ui = eff[j].topk(top_k)
                n, ni = (-eff[j]).topk(top_k)
                out.heads.append(HeadAttribution(
                    a.name, j, float(eff[j, target]), list(zip(ui.tolist(), u.tolist())),
                    list(zip(ni.tolist(), (-n).tolist()))))  # fmt: skip
            i += a.n_heads + (d.names[i + a.n_heads] == f"{a.name} bias")
        i += 1  # the block's MLP
    others = [i for i, n in enumerate(d.names) if " head " not in n]
    effects = d.attribution(d.writes[others])  # (n_others, V)
    total += effects.double().sum(0)
    out.others = [(d.names[i], float(e[target])) for i, e in zip(others, effects, strict=True)]
    out.others.append(("final norm and unembedding biases", float(d.constant[target])))
    out.check = float((total - logits[p].double()).abs().max())
    return out
