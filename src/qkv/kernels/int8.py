"""int8 linear layers for CPU inference: ``y = act(x Wᵀ + b)`` with an int8 weight.

- The weight ``W (N, K)`` is quantized once, symmetric per output channel:
  ``W ≈ s_w[n] · W_q[n, k]`` with ``|W_q| ≤ 127``, and packed for the kernel
  (:func:`quantize_weight`).
- The input ``x (M, K)`` is quantized per call and per row to uint8 with a zero point
  (``x ≈ s_x[m] · (q[m, k] - z[m])``, ``s_x = (max(x, 0) - min(x, 0)) / 255``, so that 0 is
  exact and a ReLU output keeps all 256 levels).
- ``Σ_k (q - z) W_q`` is summed exactly in int32, then ``y = s_x s_w Σ + b``, with ReLU
  fused where asked.

The C++ kernel (``qkv/csrc/int8_cpu.cpp``, built on first use with the other fused kernels)
runs the products with AVX512-VNNI ``vpdpbusd`` where the CPU has it (Intel since Cascade
Lake, AMD since Zen 4), plain C++ loops otherwise; where the kernel cannot be built, PyTorch
ops compute the same integers (exactly, in fp64), slowly. :func:`int8_path` says which runs.

**Error bound.** Per output, with ``s_x/2`` and ``s_w/2`` the largest rounding errors::

    |y - (x Wᵀ + b)| ≤ Σ_k (|x_k| s_w/2 + |w_k| s_x/2 + s_x s_w/4)

(plus fp32 rounding of the result, ~1e-7 relative). As ``s_w = max|w|/127`` and
``s_x ≤ 2 max|x|/255`` (``max|x|/255`` for a row of one sign, such as a ReLU output), this is
at most about ``(1/254 + 1/255) · K · max|x| · max|w|``; the tests check the per-output form.
Typical errors are far smaller, the roundings being independent (about ``√K`` times). On the
shipped en-fr translator, every linear in int8 changes BLEU by less than 0.1
(docs/generation.md).

Inference only (a clear error when a gradient is needed); CPU; ``in_features ≤ 65536``
(the int32 sums stay exact). A row with a non-finite value gives NaN for that row.

>>> lin = torch.nn.Linear(256, 1024)
>>> q = Int8Linear.from_linear(lin)
>>> x = torch.randn(5, 256)
>>> with torch.no_grad():
...     bool((q(x) - lin(x)).abs().max() < 0.05)
True
>>> model8 = quantize_linears(model)  # a copy, every nn.Linear replaced  # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as TF
from torch import Tensor, nn

from qkv.kernels._native import int8_ops, native_status
from qkv.kernels._replace import replace_linears

__all__ = [
    "MAX_IN_FEATURES",
    "Int8Linear",
    "PackedWeight",
    "SmallBatchInt8Linear",
    "fuse_packed",
    "int8_linear",
    "int8_path",
    "quantize_linears",
    "quantize_rows",
    "quantize_weight",
]

MAX_IN_FEATURES = 65536  # 255 · 127 · K < 2³¹: the int32 sums are exact
_GROUP = 64  # output channels per kernel block: N is padded to a multiple of this
_FLT_MIN = float(torch.finfo(torch.float32).tiny)
_ACTIVATIONS = ("none", "relu", "gelu")


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A weight quantized to int8 and packed for the kernel (see :func:`quantize_weight`).

    ``weight``: ``W_q`` int8 ``(N, K)``; ``scale``: ``s_w`` fp32 ``(N,)``. The kernel's
    operands, N padded to ``Np`` (a multiple of 64) and K to ``Kp`` (a multiple of 4) with
    zeros: ``packed`` int8 ``(Np/16 · Kp/4 · 64,)`` (blocks of 16 channels × 4 inputs),
    ``scale_padded`` fp32 ``(Np,)``, ``wsum`` int32 ``(Np,)`` (``Σ_k W_q[n, k]``).
    """

    weight: Tensor
    scale: Tensor
    packed: Tensor
    scale_padded: Tensor
    wsum: Tensor

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def dequantize(self) -> Tensor:
        """``s_w[n] · W_q[n, k]`` fp32 ``(N, K)``."""
        return self.weight.float() * self.scale[:, None]


def _pack(wq: Tensor, scale: Tensor) -> PackedWeight:
    N, K = wq.shape
    Np, Kp = -(-N // _GROUP) * _GROUP, -(-K // 4) * 4
    w = torch.zeros(Np, Kp, dtype=torch.int8)
    w[:N, :K] = wq
    packed = w.view(Np // 16, 16, Kp // 4, 4).permute(0, 2, 1, 3).contiguous().view(-1)
    scale_padded = torch.zeros(Np, dtype=torch.float32)
    scale_padded[:N] = scale
    wsum = w.sum(1, dtype=torch.int32)  # (Np,)
    return PackedWeight(wq, scale, packed, scale_padded, wsum)


def quantize_weight(weight: Tensor) -> PackedWeight:
    """Quantize ``weight (out_features, in_features)`` (float, finite) to int8, symmetric per
    output channel: ``s_w[n] = max_k |W[n, k]| / 127``, ``W_q = round(W / s_w)``."""
    if not isinstance(weight, Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        got = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise TypeError(f"weight must be a 2-D float tensor (out, in), got {got}")
    if weight.device.type != "cpu":
        raise ValueError(f"weight must be on the CPU, got {weight.device}")
    if weight.shape[1] > MAX_IN_FEATURES:
        raise ValueError(f"weight: in_features must be <= {MAX_IN_FEATURES}, got {weight.shape[1]}")
    w = weight.detach().double()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("weight has non-finite values (inf or NaN): cannot quantize it")
    scale = (w.abs().amax(1) / 127).float() if w.shape[1] else torch.zeros(w.shape[0])  # (N,)
    step = scale.double()
    wq = torch.where(step[:, None] > 0, w / step.clamp_min(1e-300)[:, None], 0.0)
    wq = wq.round().clamp_(-127, 127).to(torch.int8)
    return _pack(wq.contiguous(), scale.contiguous())


def int8_path() -> str:
    """Which code runs the int8 products: ``"avx512_vnni"``, ``"avx2_vnni (vpdpbusd)"``,
    ``"avx2 (int16 pairs)"``, ``"portable"`` (the kernel's plain C++ loops) or
    ``"torch (kernel unavailable: ...)"``."""
    ops = int8_ops()
    return ops.isa() if ops is not None else f"torch (kernel {native_status()})"


def quantize_rows(x: Tensor, k_padded: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The kernel's per-row quantization of ``x (M, K)`` fp32: ``q`` uint8 ``(M, Kp)`` (the
    padding 0), ``scale`` fp32 ``(M,)`` (NaN for a row with a non-finite value), ``zero``
    int32 ``(M,)``, with ``x ≈ scale · (q - zero)``."""
    K = x.shape[1]
    Kp = -(-K // 4) * 4 if k_padded is None else k_padded
    ops = int8_ops()
    if ops is not None:
        return ops.quantize_rows(x, Kp)
    return _quantize_rows_torch(x.float(), Kp)


def _quantize_rows_torch(x: Tensor, Kp: int) -> tuple[Tensor, Tensor, Tensor]:
    """The same float operations as the kernel, in PyTorch (where it cannot be built)."""
    M, K = x.shape
    finite = torch.isfinite(x).all(1)  # (M,)
    x = torch.where(finite[:, None], x, 0.0)
    zero = x.new_zeros(M)
    lo = torch.minimum(x.amin(1), zero) if K else zero
    hi = torch.maximum(x.amax(1), zero) if K else zero
    scale = (hi / 255 - lo / 255).clamp_min(_FLT_MIN)
    inv = 1 / scale
    z = torch.round(-lo * inv).clamp(0, 255)
    q = (torch.round(x * inv[:, None]) + z[:, None]).clamp(0, 255)
    out = torch.zeros(M, Kp, dtype=torch.uint8)
    out[:, :K] = q.to(torch.uint8)
    return out, torch.where(finite, scale, float("nan")), z.to(torch.int32)


def _linear_torch(x: Tensor, w: PackedWeight, bias: Tensor | None, relu: bool) -> Tensor:
    q, sx, z = _quantize_rows_torch(x, w.in_features)
    acc = (q.double() - z[:, None].double()) @ w.weight.double().T  # exact integers
    y = acc.float() * (sx[:, None] * w.scale)
    if bias is not None:
        y = y + bias
    return y.relu() if relu else y


def int8_linear(
    x: Tensor, weight: PackedWeight, bias: Tensor | None = None, activation: str = "none"
) -> Tensor:
    """``act(x Wᵀ + b)`` with the int8 ``weight``: ``x (..., K)`` float → ``(..., N)``.

    ``activation``: ``"none"``, ``"relu"`` (fused) or ``"gelu"``. fp32 runs as is; another
    float dtype is computed in fp32 and returned in its own dtype.
    """
    if not isinstance(weight, PackedWeight):
        raise TypeError(f"weight must be a PackedWeight (quantize_weight), got "
                        f"{type(weight).__name__}")  # fmt: skip
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
    N = weight.out_features
    if bias is not None:
        if not isinstance(bias, Tensor) or bias.shape != (N,) or not bias.is_floating_point():
            got = tuple(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__
            raise ValueError(f"bias must be a float tensor ({N},), got {got}")
        if bias.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(_NO_GRAD)
        bias = bias.detach().float()
    return _apply(x, weight, bias, activation)


_NO_GRAD = ("int8 linear layers are inference only (no gradient): call them under "
            "torch.no_grad() or torch.inference_mode()")  # fmt: skip
_op_cache: list = []


def _op():
    """``torch.ops.qkv_int8.linear``, or ``None`` where the kernel is not built (looked up
    once: the lookup costs more than a small product)."""
    if not _op_cache:
        ops = int8_ops()
        _op_cache.append(None if ops is None else ops.linear)
    return _op_cache[0]


def _apply(x: Tensor, w: PackedWeight, bias: Tensor | None, activation: str) -> Tensor:
    """:func:`int8_linear` with ``w``, ``bias`` (fp32 or None) and ``activation`` valid."""
    N, K = w.out_features, w.in_features
    op = _op()
    # the common case first, with the fewest checks: fp32 CPU rows, no gradient
    if (type(x) is Tensor and x.dtype is torch.float32 and x.is_cpu and not x.requires_grad
            and x.dim() >= 2 and x.shape[-1] == K and K > 0 and op is not None):  # fmt: skip
        x2 = x if x.dim() == 2 else x.reshape(-1, K)  # (M, K)
        y = op(x2, w.packed, w.scale_padded, w.wsum, bias, N, K, activation == "relu")
        if activation == "gelu":
            y = TF.gelu(y)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], N)
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() < 1 or x.shape[-1] != K:
        got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"x must be a float tensor (..., {K}), got {got}")
    if x.device.type != "cpu":
        raise ValueError(f"x must be on the CPU (int8 linear layers are CPU-only), got {x.device}")
    if x.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(_NO_GRAD)
    dtype = x.dtype
    x2 = x.detach().reshape(math.prod(x.shape[:-1]), K).float()  # (M, K)
    relu = activation == "relu"
    if op is not None:
        y = op(x2, w.packed, w.scale_padded, w.wsum, bias, N, K, relu)
    else:
        y = _linear_torch(x2, w, bias, relu)
    if activation == "gelu":
        y = TF.gelu(y)
    return y.view(*x.shape[:-1], N).to(dtype)


class Int8Linear(nn.Module):
    """An :class:`torch.nn.Linear` with its weight in int8 (see the module's docstring).

    Build it with :meth:`from_linear`. Inference only. ``weight`` holds ``W_q`` (int8) and
    ``weight_scale`` ``s_w``, both saved in the ``state_dict`` (the packed copy is rebuilt
    on load). It takes float inputs (``input_dtype``: fp32).

    >>> q = Int8Linear.from_linear(torch.nn.Linear(64, 32))
    >>> q(torch.randn(2, 7, 64)).shape
    torch.Size([2, 7, 32])
    """

    input_dtype = torch.float32  # what it computes in (MultiHeadAttention's input check)

    def __init__(self, weight: PackedWeight, bias: Tensor | None = None,
                 activation: str = "none") -> None:  # fmt: skip
        super().__init__()
        if not isinstance(weight, PackedWeight):
            raise TypeError(f"weight must be a PackedWeight (quantize_weight), got "
                            f"{type(weight).__name__}")  # fmt: skip
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.activation = activation
        self.register_buffer("weight", weight.weight)
        self.register_buffer("weight_scale", weight.scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self._packed = weight
        self.register_load_state_dict_post_hook(lambda module, _: module._repack())

    @classmethod
    def from_linear(cls, linear: nn.Linear, activation: str = "none") -> Int8Linear:
        """The quantized copy of ``linear`` (its weight quantized per output channel)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        return cls(quantize_weight(linear.weight), linear.bias, activation)

    def _repack(self) -> None:
        self._packed = _pack(self.weight.contiguous(), self.weight_scale.float().contiguous())

    @property
    def packed(self) -> PackedWeight:
        """The kernel's operands (rebuilt if ``weight``/``weight_scale`` were replaced)."""
        if self._packed.weight is not self.weight or self._packed.scale is not self.weight_scale:
            self._repack()
        return self._packed

    def forward(self, x: Tensor) -> Tensor:
        bias = self.bias
        if bias is not None and bias.dtype != torch.float32:  # after a .to(dtype)
            bias = bias.float()
        return _apply(x, self.packed, bias, self.activation)

    def extra_repr(self) -> str:
        act = "" if self.activation == "none" else f", activation={self.activation}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8{act}")  # fmt: skip


def quantize_linears(model: nn.Module, *, skip: Iterable[str] = ()) -> nn.Module:
    """A copy of ``model`` (in eval mode) with every :class:`torch.nn.Linear` replaced by an
    :class:`Int8Linear`; embeddings, norms and everything else stay as they are.

    ``skip``: module names or ``fnmatch`` patterns (``"decoder.out"``, ``"*.ffn.w_2"``) of
    linears to keep in float; each must match at least one linear (a typo is an error).
    The original model is left unchanged.
    """
    return replace_linears(model, Int8Linear.from_linear, skip).eval()


def fuse_packed(*weights: PackedWeight) -> PackedWeight:
    """One weight whose output channels are those of ``weights`` in order (e.g. ``W_q``,
    ``W_k``, ``W_v`` as one projection): exactly their products side by side, the scales
    being per output channel."""
    if not weights or not all(isinstance(w, PackedWeight) for w in weights):
        raise TypeError("fuse_packed takes one or more PackedWeight")
    if len({w.in_features for w in weights}) != 1:
        raise ValueError(f"fuse_packed: in_features differ: {[w.in_features for w in weights]}")
    return _pack(torch.cat([w.weight for w in weights]), torch.cat([w.scale for w in weights]))


class SmallBatchInt8Linear:
    """``act(x Wᵀ + b)`` for ``x (M, in)`` fp32 with an int8 weight, called with as little
    per-call work as possible: the int8 counterpart of
    :class:`qkv.models.prepared_weights.SmallBatchLinear` (same constructor and call).

    ``weight``: a float ``(out, in)`` weight (quantized here) or a :class:`PackedWeight`;
    ``activation``: ``"none"``, ``"relu"`` (fused in the kernel) or ``"gelu"``. The input is
    not checked beyond what the kernel checks (2-D fp32, ``in`` columns).

    >>> lin = torch.nn.Linear(64, 32)
    >>> f = SmallBatchInt8Linear(lin.weight, lin.bias, "relu")
    >>> f(torch.randn(3, 64)).shape
    torch.Size([3, 32])
    """

    def __init__(self, weight: Tensor | PackedWeight, bias: Tensor | None,
                 activation: str = "none") -> None:  # fmt: skip
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
        self.weight = weight if isinstance(weight, PackedWeight) else quantize_weight(weight)
        N = self.weight.out_features
        if bias is not None and (bias.shape != (N,) or not bias.is_floating_point()):
            raise ValueError(f"bias must be a float tensor ({N},), got {tuple(bias.shape)}")
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.activation = activation
        w = self.weight
        self._args = (w.packed, w.scale_padded, w.wsum, self.bias, N, w.in_features,
                      activation == "relu")  # fmt: skip
        self._op = _op()
        self._gelu = activation == "gelu"

    @property
    def compiled(self) -> bool:
        """Whether calls run on the compiled int8 kernel (else on PyTorch ops)."""
        return self._op is not None

    @classmethod
    def fuse(cls, *linears: Int8Linear, activation: str = "none") -> SmallBatchInt8Linear:
        """One call for several :class:`Int8Linear` of the same input, outputs side by side."""
        if not linears or not all(isinstance(m, Int8Linear) for m in linears):
            raise TypeError("SmallBatchInt8Linear.fuse takes one or more Int8Linear")
        biases = [m.bias for m in linears]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            raise ValueError("SmallBatchInt8Linear.fuse: some linears have a bias, some not")
        bias = None if biases[0] is None else torch.cat(biases)
        return cls(fuse_packed(*(m.packed for m in linears)), bias, activation)

    def __call__(self, x: Tensor) -> Tensor:
        if self._op is None:  # no compiled kernel: the PyTorch ops
            return _apply(x, self.weight, self.bias, self.activation)
        y = self._op(x, *self._args)  # (M, out)
        return TF.gelu(y) if self._gelu else y
