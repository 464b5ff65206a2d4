"""Where a decoder's parts are, for :mod:`qkv.inspect.lens`, and its final norm made linear.

:func:`decoder_parts` finds, by structure, what the lens reads: the blocks (their input is
the embeddings, their outputs the residual stream after each), each block's attention
modules with their output projection (``W_O``) and head count, its MLP, the final norm and
the unembedding. It knows three kinds of model:

==========================================  =============================================
model                                       parts
==========================================  =============================================
qkv :class:`~qkv.models.Seq2SeqTransformer`  ``decoder.layers.i`` (self- and cross-attention,
(the translators)                           ``ffn``), ``decoder.norm``, ``decoder.out``
qkv :class:`~qkv.models.CausalLM`           ``layers.i`` (``self_attn``, ``ffn``), ``norm``, ``out``
transformers decoder-only causal LM         the parents of the attention modules
(GPT-2, Llama, Mistral, Qwen…)              (:func:`qkv.hf.attention_modules`), their ``mlp``,
                                            the base model's final norm, ``lm_head``
==========================================  =============================================

:func:`frozen_norm` writes the final norm at one residual vector ``x`` as ``f(c) + β``
with ``f`` linear: LayerNorm ``γ ⊙ (c − mean c) / σ(x)``, RMSNorm ``γ ⊙ c / rms(x)``
(``(1 + γ)`` for Gemma's), the scale ``σ(x)`` frozen at ``x``. Which formula applies is
decided by trying them against the module's own output at ``x``, not by class names alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["Attention", "Block", "DecoderParts", "decoder_parts", "frozen_norm", "proj_weight"]

# child names of a transformers attention module's output projection, of a block's MLP, and
# of a base model's final norm (GPT-2, Llama/Mistral/Qwen/Gemma, GPT-NeoX/Falcon/Phi, GPT-J…)
_PROJ = ("o_proj", "c_proj", "out_proj", "dense", "wo", "o")
_MLP = ("mlp", "feed_forward", "ffn")
_NORM = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "norm_f")


@dataclass
class Attention:
    """One attention module of a block: its name (as in the maps), output projection, heads."""

    name: str
    module: nn.Module
    proj: nn.Module  # W_O: its input is the heads' outputs side by side, (…, h·d_head)
    n_heads: int


@dataclass
class Block:
    """One decoder block: what it adds to the residual stream is its attention and its MLP."""

    name: str
    module: nn.Module
    attention: list[Attention]
    mlp: nn.Module | None  # None: no MLP module found (the decomposition is not offered)


@dataclass
class DecoderParts:
    """A decoder as the lens reads it (see the module docstring)."""

    blocks: list[Block]
    final_norm: nn.Module | None  # None: no final norm (post-LN models)
    unembed: nn.Module  # (…, d_model) → (…, V)
    logits: Callable[..., Tensor]  # the model's output → its logits (B, T, V)


def proj_weight(proj: nn.Module) -> tuple[Tensor, Tensor | None]:
    """``(W (in, out), bias (out,) | None)`` of a linear layer: ``nn.Linear`` stores ``W``
    transposed, transformers' ``Conv1D`` (GPT-2) as it is."""
    b = None if proj.bias is None else proj.bias.detach()
    if isinstance(proj, nn.Linear):
        return proj.weight.detach().t(), b
    if type(proj).__name__ == "Conv1D" and hasattr(proj, "weight"):
        return proj.weight.detach(), b
    raise ValueError(f"cannot read the weight of output projection {type(proj).__name__}")


def decoder_parts(model: nn.Module) -> DecoderParts:
    """The parts of ``model`` (see the module docstring); ``ValueError`` for another model."""
    from qkv.models.causal_lm import CausalLM
    from qkv.models.seq2seq import Seq2SeqTransformer

    if isinstance(model, Seq2SeqTransformer):
        return _qkv_parts(model.decoder, "decoder.", ("self_attn", "cross_attn"))
    if isinstance(model, CausalLM):
        return _qkv_parts(model, "", ("self_attn",))
    if hasattr(model, "get_output_embeddings") and hasattr(model, "config"):
        return _hf_parts(model)
    raise ValueError(f"the lens reads qkv translators, qkv CausalLM and transformers "
                     f"decoder-only models, not {type(model).__name__}")  # fmt: skip


def _qkv_parts(stack: nn.Module, prefix: str, kinds: tuple[str, ...]) -> DecoderParts:
    blocks = []
    for i, layer in enumerate(stack.layers):
        name = f"{prefix}layers.{i}"
        att = [Attention(f"{name}.{k}", getattr(layer, k), getattr(layer, k).w_o,
                         getattr(layer, k).n_heads) for k in kinds]  # fmt: skip
        blocks.append(Block(name, layer, att, layer.ffn))
    norm = None if isinstance(stack.norm, nn.Identity) else stack.norm
    return DecoderParts(blocks, norm, stack.out, lambda out: out)


def _child(module: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    for n in names:
        m = getattr(module, n, None)
        if isinstance(m, nn.Module):
            return m
    return None


def _hf_parts(model: nn.Module) -> DecoderParts:
    from qkv.hf.ablate import head_count
    from qkv.hf.capture import attention_modules, module_kind

    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("the lens reads decoder-only transformers models; this one is an "
                         "encoder-decoder")  # fmt: skip
    unembed = model.get_output_embeddings()
    if unembed is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (not a *ForCausalLM)")
    blocks: dict[str, Block] = {}
    for name, m in attention_modules(model):
        if module_kind(name, m) != "causal":
            raise ValueError(f"the lens reads decoder-only models; {name} is not causal")
        proj = _child(m, _PROJ)
        if proj is None:
            raise ValueError(f"{name}: no output projection among {_PROJ}")
        parent = name.rpartition(".")[0]
        if parent not in blocks:
            block = model.get_submodule(parent)
            blocks[parent] = Block(parent, block, [], _child(block, _MLP))
        blocks[parent].attention.append(Attention(name, m, proj, head_count(m)))
    base = getattr(model, "base_model", model)
    return DecoderParts(list(blocks.values()), _child(base, _NORM), unembed,
                        lambda out: out.logits)  # fmt: skip


def _eps(norm: nn.Module) -> float:
    for attr in ("eps", "variance_epsilon", "epsilon"):
        v = getattr(norm, attr, None)
        if isinstance(v, float | int):
            return float(v)
    return 1e-5


def frozen_norm(norm: nn.Module | None, x: Tensor) -> tuple[Callable[[Tensor], Tensor], Tensor]:
    """``(f, β)`` with ``norm(x) = f(x) + β`` and ``f`` linear, its scale frozen at ``x (d,)``.

    ``f`` maps ``(…, d) → (…, d)``. Tried in turn: LayerNorm (centre, divide by σ(x), scale by
    γ), RMSNorm (divide by rms(x), scale by γ or 1 + γ); the first that gives back the
    module's own ``norm(x)`` (within 1e-4 of its size) is taken, else ``ValueError``.
    """
    if norm is None:
        return (lambda c: c), torch.zeros_like(x)
    w, b = getattr(norm, "weight", None), getattr(norm, "bias", None)
    dt = x.dtype if w is None else w.dtype  # the norm runs in its own dtype (bf16 models)
    with torch.no_grad():
        want = norm(x.to(dt)[None])[0].to(x.dtype)  # (d,)
    eps = _eps(norm)
    w, b = (None if t is None else t.detach().to(x.dtype) for t in (w, b))
    gammas = [torch.ones_like(x)] if w is None else [w, 1 + w]
    beta = torch.zeros_like(x) if b is None else b
    sigma = torch.sqrt(x.var(unbiased=False) + eps)
    rms = torch.sqrt(x.pow(2).mean() + eps)
    candidates = []
    for g in gammas:
        candidates.append((lambda c, g=g: g * (c - c.mean(-1, keepdim=True)) / sigma, beta))
        candidates.append((lambda c, g=g: g * c / rms, beta))
    tol = max(1e-4, 32 * torch.finfo(dt).eps) * float(want.abs().max().clamp_min(1.0))
    for f, bb in candidates:
        if float((f(x) + bb - want).abs().max()) <= tol:
            return f, bb
    raise ValueError(f"cannot write the final norm {type(norm).__name__} as a LayerNorm or an "
                     f"RMSNorm with a frozen scale")  # fmt: skip
