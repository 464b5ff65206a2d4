"""Conversions both ways between PyTorch's ``nn.TransformerEncoderLayer`` /
``nn.TransformerEncoder`` and qkv's :class:`~qkv.pretrained.layer.EncoderLayer` /
:class:`~qkv.pretrained.layer.Encoder`, with equal outputs.

State-dict names, per layer (an encoder adds ``layers.{i}.`` in front, and ``norm.`` is its
optional final LayerNorm on both sides)::

    PyTorch                                   qkv
    self_attn.in_proj_weight (3d, d)          self_attn.w_q.weight, self_attn.w_k.weight, self_attn.w_v.weight
    self_attn.in_proj_bias (3d,)              self_attn.w_q.bias, self_attn.w_k.bias, self_attn.w_v.bias
    self_attn.out_proj                        self_attn.w_o
    linear1 / linear2                         ff_in / ff_out
    norm1 / norm2                             attn_norm / ff_norm   (in both norm_first modes)

qkv's layers are always batch-first; PyTorch's may be either (``batch_first`` is read on the
way in and chosen on the way out). Masks: PyTorch's ``src_key_padding_mask`` is True =
*padding*; convert with :func:`qkv.masks.from_key_padding_mask` (True = may attend).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.pretrained.layer import Encoder, EncoderLayer

__all__ = [
    "encoder_from_torch",
    "encoder_layer_from_torch",
    "encoder_layer_to_torch",
    "encoder_to_torch",
    "state_dict_from_torch",
    "state_dict_to_torch",
]

_LOCAL = {  # PyTorch layer-local name -> qkv layer-local name (in_proj handled apart)
    "self_attn.out_proj.weight": "self_attn.w_o.weight",
    "self_attn.out_proj.bias": "self_attn.w_o.bias",
    "linear1.weight": "ff_in.weight",
    "linear1.bias": "ff_in.bias",
    "linear2.weight": "ff_out.weight",
    "linear2.bias": "ff_out.bias",
    "norm1.weight": "attn_norm.weight",
    "norm1.bias": "attn_norm.bias",
    "norm2.weight": "ff_norm.weight",
    "norm2.bias": "ff_norm.bias",
}
_FINAL = {"norm.weight", "norm.bias"}  # an encoder's final LayerNorm: same name both sides
_ROLES = ("w_q", "w_k", "w_v")


def _split(name: str, local_names) -> tuple[str, str] | None:
    """``"layers.3.linear1.weight"`` → ``("layers.3.", "linear1.weight")`` if the tail is known."""
    for local in local_names:
        if name == local or name.endswith("." + local):
            return name[: len(name) - len(local)], local
    return None


def state_dict_from_torch(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """A ``nn.TransformerEncoderLayer``/``nn.TransformerEncoder`` state dict → qkv names.

    The packed ``in_proj_weight (3d, d)`` is split into ``w_q``, ``w_k``, ``w_v`` ``(d, d)``.
    """
    out: dict[str, Tensor] = {}
    for name, t in sd.items():
        if name in _FINAL:
            out[name] = t
        elif hit := _split(name, ("self_attn.in_proj_weight", "self_attn.in_proj_bias")):
            prefix, local = hit
            kind = "weight" if local.endswith("weight") else "bias"
            for role, part in zip(_ROLES, t.chunk(3, dim=0)):
                out[f"{prefix}self_attn.{role}.{kind}"] = part
        elif hit := _split(name, _LOCAL):
            prefix, local = hit
            out[prefix + _LOCAL[local]] = t
        else:
            raise ValueError(f"state dict name {name!r} is not an nn.TransformerEncoder(Layer) one")
    return out


def state_dict_to_torch(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """A qkv :class:`EncoderLayer`/:class:`Encoder` state dict → PyTorch names (q, k, v packed)."""
    back = {v: k for k, v in _LOCAL.items()}
    out: dict[str, Tensor] = {}
    packed: dict[tuple[str, str], dict[str, Tensor]] = {}
    for name, t in sd.items():
        if name in _FINAL:
            out[name] = t
        elif hit := _split(name, [f"self_attn.{r}.{k}" for r in _ROLES for k in ("weight", "bias")]):
            prefix, local = hit
            _, role, kind = local.split(".")
            packed.setdefault((prefix, kind), {})[role] = t
        elif hit := _split(name, back):
            prefix, local = hit
            out[prefix + back[local]] = t
        else:
            raise ValueError(f"state dict name {name!r} has no nn.TransformerEncoderLayer name")
    for (prefix, kind), parts in packed.items():
        if set(parts) != set(_ROLES):
            raise ValueError(
                f"{prefix}self_attn.* must hold w_q, w_k and w_v {kind}s, got {sorted(parts)}"
            )
        out[f"{prefix}self_attn.in_proj_{kind}"] = torch.cat([parts[r] for r in _ROLES])
    return out


def _activation_name(act) -> str:
    if act is F.relu or isinstance(act, nn.ReLU):
        return "relu"
    if act is F.gelu:
        return "gelu"
    if isinstance(act, nn.GELU):
        return "gelu" if act.approximate == "none" else "gelu_tanh"
    raise ValueError(f"activation must be relu or gelu to convert, got {act!r}")


def encoder_layer_from_torch(layer: nn.TransformerEncoderLayer) -> EncoderLayer:
    """An :class:`EncoderLayer` (batch-first) equal to ``layer`` (either ``batch_first``).

    >>> theirs = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True).eval()
    >>> ours = encoder_layer_from_torch(theirs).eval()
    >>> x = torch.randn(2, 5, 64)
    >>> torch.allclose(ours(x), theirs(x), atol=1e-5)
    True
    """
    if not isinstance(layer, nn.TransformerEncoderLayer):
        raise TypeError(f"layer must be nn.TransformerEncoderLayer, got {type(layer).__name__}")
    w = layer.linear1.weight
    ours = EncoderLayer(
        layer.self_attn.embed_dim, layer.self_attn.num_heads, layer.linear1.out_features,
        dropout=layer.dropout1.p, attn_dropout=layer.self_attn.dropout, ff_dropout=layer.dropout.p,
        activation=_activation_name(layer.activation), norm_first=layer.norm_first,
        layer_norm_eps=layer.norm1.eps, bias=layer.linear1.bias is not None,
    ).to(device=w.device, dtype=w.dtype)  # fmt: skip
    ours.load_state_dict(state_dict_from_torch(layer.state_dict()))
    return ours.train(layer.training)


def encoder_layer_to_torch(
    layer: EncoderLayer, *, batch_first: bool = True, dropout: float | None = None
) -> nn.TransformerEncoderLayer:
    """An ``nn.TransformerEncoderLayer`` equal to ``layer``.

    PyTorch's layer has one dropout rate; pass ``dropout`` when qkv's three rates differ
    (BERT: 0 inside the feed-forward), else a ``ValueError`` says which differ.
    """
    rates = {layer.dropout, layer.self_attn.dropout, layer.ff_dropout}
    if dropout is None and len(rates) > 1:
        raise ValueError(
            f"nn.TransformerEncoderLayer has one dropout rate but this layer has dropout="
            f"{layer.dropout}, attn_dropout={layer.self_attn.dropout}, ff_dropout={layer.ff_dropout};"
            " pass dropout="
        )
    act = {"relu": "relu", "gelu": "gelu", "gelu_tanh": nn.GELU(approximate="tanh")}
    w = layer.ff_in.weight
    theirs = nn.TransformerEncoderLayer(
        layer.self_attn.d_model, layer.self_attn.n_heads, layer.ff_in.out_features,
        dropout=layer.dropout if dropout is None else dropout,
        activation=act[layer.activation], layer_norm_eps=layer.attn_norm.eps,
        batch_first=batch_first, norm_first=layer.norm_first,
        bias=layer.ff_in.bias is not None, device=w.device, dtype=w.dtype,
    )  # fmt: skip
    theirs.load_state_dict(state_dict_to_torch(layer.state_dict()))
    return theirs.train(layer.training)


def encoder_from_torch(encoder: nn.TransformerEncoder) -> Encoder:
    """An :class:`Encoder` (batch-first) equal to ``encoder`` (its final ``norm`` included)."""
    if not isinstance(encoder, nn.TransformerEncoder):
        raise TypeError(f"encoder must be nn.TransformerEncoder, got {type(encoder).__name__}")
    if encoder.norm is not None and not isinstance(encoder.norm, nn.LayerNorm):
        raise ValueError(f"encoder.norm must be nn.LayerNorm or None, got {encoder.norm!r}")
    layers = [encoder_layer_from_torch(layer) for layer in encoder.layers]
    norm = copy.deepcopy(encoder.norm) if encoder.norm is not None else None
    return Encoder(layers, norm).train(encoder.training)


def encoder_to_torch(
    encoder: Encoder, *, batch_first: bool = True, dropout: float | None = None
) -> nn.TransformerEncoder:
    """An ``nn.TransformerEncoder`` equal to ``encoder``.

    It is built with ``enable_nested_tensor=False``, so padded positions keep their values
    (PyTorch's nested-tensor path would write zeros there) and every position compares.
    """
    if len(encoder.layers) == 0:
        raise ValueError("encoder has no layers")
    layers = [encoder_layer_to_torch(lyr, batch_first=batch_first, dropout=dropout)
              for lyr in encoder.layers]  # fmt: skip
    norm = copy.deepcopy(encoder.norm) if encoder.norm is not None else None
    theirs = nn.TransformerEncoder(
        layers[0], num_layers=len(layers), norm=norm, enable_nested_tensor=False
    )
    theirs.layers = nn.ModuleList(layers)
    return theirs.train(encoder.training)
