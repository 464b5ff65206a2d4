"""Weights prepared once per model for the prepared decoders, laid out for a few rows per call.

* :class:`SmallBatchLinear`: one linear (or several reading the same input, fused side by
  side) stored the way a small batch multiplies fastest; :func:`_prepared` picks it, or the
  int8 kernel for the layers of a ``quantize_linears`` model;
* ``_Layer`` / ``_EncoderLayer``: one decoder / encoder layer's weights prepared (the
  self-attention ``W_q, W_k, W_v`` fused into one matrix), its norms and RoPE;
* :func:`_compiled_specs`: prepared linears as the compiled encoder/decoder step takes them.

Shapes: ``x (M, in)`` → ``(M, out)``; weights ``(out, in)`` as ``nn.Linear`` holds them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as TF
from torch import Tensor, nn

from qkv.kernels._native import decode_ops
from qkv.kernels.int8 import Int8Linear, SmallBatchInt8Linear
from qkv.kernels.packed import SMALL_ROWS, panels
from qkv.positional import RotaryEmbedding

__all__ = ["SmallBatchLinear"]

# oneDNN packs a weight for a batch size (any other works, a little slower): one packing per
# power of two of the rows, the last few kept
_MAX_PACKINGS = 6


def _mkldnn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_LINEAR_POINTWISE = (
    torch.ops.mkldnn._linear_pointwise.default if _mkldnn_linear_available() else None
)


class SmallBatchLinear:
    """``act(x Wᵀ + b)`` for ``x (M, in)`` with few rows, in the layout fastest for ``M``.

    Measured on the CPU this was written on (1 thread, weights not in cache, one
    ``(8000, 256)`` projection: 1.0 ms as ``F.linear``, 0.36 ms transposed — the read
    bandwidth — and for ``M ≥ 5`` oneDNN's prepacked weights 1.3-3× faster than either):

    * ``M <= 12`` (fp32, with the compiled kernels): ``qkv_decode.small_linear`` on the
      weight packed once into panels of 64 output columns, each read as one sequential
      stream, up to 6 rows per load (1 thread, Zen 4: 1.4-2× faster than a GEMV at
      ``M = 1``, 1.2-2× faster than oneDNN at ``M = 2..12``);
    * otherwise ``M = 1``: a matrix-vector product; when ``out ≥ 2·in`` the weight is
      stored transposed ``(in, out)`` (a streaming read), else as given;
    * ``M > 1``: oneDNN's prepacked weight for ``M`` rounded up to a power of two
      (``torch.ops.mkldnn``; a sentence length change does not repack), the activation
      fused; ``F.linear`` where oneDNN is missing.

    Results equal ``F.linear`` up to float rounding (a different summation order).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, activation: str = "none") -> None:
        self.weight = weight.detach()  # (out, in)
        self.bias = None if bias is None else bias.detach()
        self.activation = activation  # "none" | "relu" | "gelu"
        out_f, in_f = self.weight.shape
        self.wt = self.weight.t().contiguous() if out_f >= 2 * in_f else None  # (in, out)
        self._packed: dict[int, Tensor] = {}
        self._mkldnn = (_mkldnn_linear_available() and self.weight.dtype == torch.float32
                        and self.weight.device.type == "cpu")  # fmt: skip
        self._attr = activation if activation in ("relu", "gelu") else "none"
        self._algo = "none" if activation == "gelu" else ""
        self.out_features = out_f
        self.panels = None  # (ceil(out/64), in, 64): the compiled kernel's layout, M <= 12
        if self.weight.dtype == torch.float32 and self.weight.device.type == "cpu":
            ops = decode_ops()
            if ops is not None:
                self._small = ops.small_linear
                self.panels = panels(self.weight)
                self.wt = None  # the panels serve M = 1 too (faster than a GEMV, measured)

    def __call__(self, x: Tensor) -> Tensor:
        M = x.shape[0]
        if M <= SMALL_ROWS and self.panels is not None:
            if x.stride(-1) != 1:
                x = x.contiguous()
            y = self._small(x, self.panels, self.bias, self.out_features, self.activation == "relu")
            return TF.gelu(y) if self.activation == "gelu" else y
        if M == 1 or not self._mkldnn:
            if M == 1 and self.wt is not None:
                y = x @ self.wt if self.bias is None else torch.addmm(self.bias, x, self.wt)
            else:
                y = TF.linear(x, self.weight, self.bias)
            if self.activation == "relu":
                return y.relu_()
            return TF.gelu(y) if self.activation == "gelu" else y
        hint = 1 << (M - 1).bit_length()  # M rounded up to a power of two: few packings
        packed = self._packed.get(hint)
        if packed is None:
            if len(self._packed) >= _MAX_PACKINGS:
                self._packed.pop(next(iter(self._packed)))
            packed = self._packed[hint] = torch.ops.mkldnn._reorder_linear_weight(self.weight, hint)
        return _LINEAR_POINTWISE(x, packed, self.bias, self._attr, [], self._algo)


_ACTIVATIONS = {"none": 0, "relu": 1, "gelu": 2}  # step_cpu.cpp's codes


def _compiled_specs(linears: list, norms: list) -> list | None:
    """Prepared linears as the compiled encoder/decoder step takes them (weight, bias, out
    and in features, activation code, int8 scales and column sums), or ``None`` where one is
    in neither form the step runs (fp32 panels on the CPU, the compiled int8 kernel) or a
    norm has no weight or bias; an empty list (no layers) is ``None`` too."""
    if not linears or any(m.activation not in _ACTIVATIONS for m in linears):
        return None
    if any(w is None or b is None for w, b, _ in norms):
        return None
    specs = []
    for m in linears:
        act = _ACTIVATIONS[m.activation]
        if isinstance(m, SmallBatchLinear) and m.panels is not None:
            specs.append((m.panels, m.bias, m.out_features, m.panels.shape[1], act, None, None))
        elif isinstance(m, SmallBatchInt8Linear) and m.compiled:
            w = m.weight
            specs.append((w.packed, m.bias, w.out_features, w.in_features, act, w.scale_padded,
                          w.wsum))  # fmt: skip
        else:
            return None
    return specs


def _fuse(*linears: nn.Linear) -> tuple[Tensor, Tensor | None]:
    w = torch.cat([lin.weight for lin in linears])
    b = None if linears[0].bias is None else torch.cat([lin.bias for lin in linears])
    return w, b


def _prepared(*linears: nn.Module, activation: str = "none"):
    """The prepared form of one linear, or of several reading the same input (outputs side
    by side): the int8 kernel for :class:`~qkv.kernels.int8.Int8Linear` layers (a model from
    ``quantize_linears``), :class:`SmallBatchLinear` for float ones."""
    if all(isinstance(m, Int8Linear) for m in linears):
        return SmallBatchInt8Linear.fuse(*linears, activation=activation)
    return SmallBatchLinear(*_fuse(*linears), activation)


class _Layer:
    """One decoder layer's weights, prepared."""

    def __init__(self, layer: nn.Module, activation: str) -> None:
        sa, ca = layer.self_attn, layer.cross_attn
        self.qkv = _prepared(sa.w_q, sa.w_k, sa.w_v)
        self.o = _prepared(sa.w_o)
        self.cq = _prepared(ca.w_q)
        self.co = _prepared(ca.w_o)
        self.w1 = _prepared(layer.ffn.w_1, activation=activation)
        self.w2 = _prepared(layer.ffn.w_2)
        self.norms = [
            (r.norm.weight.detach(), r.norm.bias.detach(), r.norm.eps)
            for r in (layer.res_self, layer.res_cross, layer.res_ffn)
        ]
        self.rope = sa.position if isinstance(sa.position, RotaryEmbedding) else None
        self.backends = (sa.backend, ca.backend)


class _EncoderLayer:
    """One encoder layer's weights, prepared (``W_q, W_k, W_v`` fused)."""

    def __init__(self, layer: nn.Module, activation: str) -> None:
        sa = layer.self_attn
        self.qkv = _prepared(sa.w_q, sa.w_k, sa.w_v)
        self.o = _prepared(sa.w_o)
        self.w1 = _prepared(layer.ffn.w_1, activation=activation)
        self.w2 = _prepared(layer.ffn.w_2)
        self.norms = [
            (r.norm.weight.detach(), r.norm.bias.detach(), r.norm.eps)
            for r in (layer.res_attn, layer.res_ffn)
        ]
        self.rope = sa.position if isinstance(sa.position, RotaryEmbedding) else None
        self.backend = sa.backend
