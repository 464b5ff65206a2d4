"""The Lens view's graph for a translator: :func:`qkv.inspect.lens.lens` traced.

``/api/lens`` (:mod:`qkv.apps.serve.compute_lens`) runs the translator teacher-forced on its
translation and reads the decoder: the logit lens of every layer at every position, and the
direct logit attribution of every head at one position. :class:`LensGraph` runs the same
functions of :mod:`qkv.inspect.lens` (``_run``, ``_lens_table``, ``_decompose``,
``Decomposition.attribution``) on graph inputs and returns their tensors; only the loop that
gathers each head's effects into ``Lens.heads`` is restated here, as tensors.

Inputs: ``src (1, S)``, ``tgt (1, T)`` (``<s>``, y₁, …), ``position ()`` (0-based),
``head_mask (L_all, h)`` (every attention module, model order). Outputs, with ``k`` =
:data:`TOP_K` (a request's ``top_k`` takes the first ones): ``lens_ids``, ``lens_probs``
``(L + 1, T, k)``; ``target ()``, ``logit ()``; per head (``n`` = every decoder head, block
by block, self then cross): ``head_target (n,)``, ``up_ids``, ``up``, ``down_ids``, ``down``
``(n, k)``; ``others (m,)`` (the embeddings, attention biases, MLPs, then the final norm's
and unembedding's biases, :func:`lens_names`); ``check ()``.

The lens's checks that the writes add up are taken when the graph is traced: the shipped
translators are pre-LN, so they pass, and the export's parity check compares the graph with
:func:`qkv.inspect.lens.lens` itself.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qkv.apps.web.onnx_graphs import traced_attention
from qkv.capture.record import attention_modules
from qkv.inspect import lens as L
from qkv.inspect.lens_parts import decoder_parts

__all__ = ["TOP_K", "LensGraph", "lens_io", "lens_names"]

TOP_K = 10  # qkv.apps.serve.compute_lens.MAX_TOP_K


def lens_names(model: nn.Module) -> dict:
    """The rows of the lens (``layers``), the heads in output order (``[layer, head]``) and
    the names of ``others``, as :func:`qkv.inspect.lens.lens` names them."""
    parts = decoder_parts(model)
    heads = [[a.name, j] for b in parts.blocks for a in b.attention for j in range(a.n_heads)]
    others = ["embeddings"]
    for b in parts.blocks:
        others += [f"{a.name} bias" for a in b.attention if a.proj.bias is not None]
        others.append(f"{b.name} mlp")
    others.append("final norm and unembedding biases")
    return {"layers": ["embeddings", *(b.name for b in parts.blocks)], "heads": heads,
            "others": others}  # fmt: skip


class LensGraph(nn.Module):
    """See the module docstring."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.modules_ = attention_modules(model)

    def forward(self, src: Tensor, tgt: Tensor, position: Tensor,
                head_mask: Tensor) -> tuple[Tensor, ...]:  # fmt: skip
        with traced_attention(self.modules_, head_mask):
            parts, rec, logits = L._run(self.model, (src, tgt), {})  # logits (T, V)
        ids, probs = L._lens_table(parts, rec, logits, TOP_K)  # (L + 1, T, k)
        p = position
        d, why = L._decompose(parts, rec, logits, p)
        if d is None:
            raise ValueError(f"the lens cannot attribute this model's heads: {why}")
        target = logits[p].argmax()
        heads, i = [], 1
        for b in parts.blocks:  # as lens(): each module's heads, its bias, then the MLP
            for a in b.attention:
                heads.append(d.attribution(d.writes[i : i + a.n_heads]))  # (h, V)
                i += a.n_heads + (d.names[i + a.n_heads] == f"{a.name} bias")
            i += 1
        eff = torch.cat(heads)  # (n, V)
        up, up_ids = eff.topk(TOP_K, dim=-1)  # (n, k)
        down, down_ids = (-eff).topk(TOP_K, dim=-1)
        others_idx = [j for j, n in enumerate(d.names) if " head " not in n]
        others = d.attribution(d.writes[others_idx])  # (m, V)
        total = d.constant.double() + eff.double().sum(0) + others.double().sum(0)  # (V,)
        check = (total - logits[p].double()).abs().max()
        return (ids, probs, target, logits[p, target], eff[:, target], up_ids, up, down_ids,
                -down, torch.cat([others[:, target], d.constant[target][None]]), check)


def lens_io(model: nn.Module) -> tuple[tuple, list[str], list[str], dict]:
    """Example arguments, names and dynamic axes of the lens graph for ``torch.onnx.export``."""
    mods = attention_modules(model)
    h = mods[0][1].n_heads
    args = (torch.tensor([[5, 6, 7, 2]]), torch.tensor([[1, 8, 9]]), torch.tensor(1),
            torch.ones(len(mods), h))  # fmt: skip
    outputs = ["lens_ids", "lens_probs", "target", "logit", "head_target", "up_ids", "up",
               "down_ids", "down", "others", "check"]  # fmt: skip
    return args, ["src", "tgt", "position", "head_mask"], outputs, {"src": {1: "S"}, "tgt": {1: "T"}}
