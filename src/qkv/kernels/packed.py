"""Linear layers for decoding: the weight also held in panels that a few rows read once.

A generation step multiplies one row (or a few: beams, a batch of prompts) by every weight of
the model, so the step is a read of all the weights: its limit is the read bandwidth.
``F.linear`` with one row runs a matrix-vector product that reads ``(out, in)`` weights at
about half of it on the CPUs measured here; ``qkv_decode.small_linear`` reads a copy packed
into panels of 64 output columns, each one sequential stream, up to 6 rows per load (1
thread, Zen 4, a ``(3072, 768)`` weight out of cache: 12.8 GB/s as ``F.linear``, 25 GB/s
packed, the machine's streaming read ~27 GB/s).

:class:`PackedLinear` is an :class:`torch.nn.Linear` (same parameters, same
``state_dict``) whose inference calls with at most ``SMALL_ROWS`` rows take the packed path;
training, autograd, other dtypes and devices call ``F.linear`` as before. The panels are
built on first use and rebuilt when the weight changes; they double the layer's memory.
:func:`pack_linears` returns a copy of a model with every ``nn.Linear`` packed:

>>> from qkv.models import CausalLM, TransformerConfig
>>> cfg = TransformerConfig(src_vocab_size=100, tgt_vocab_size=100, d_model=32, n_heads=4,
...                         d_ff=64, n_encoder_layers=0, n_decoder_layers=2)
>>> lm = pack_linears(CausalLM(cfg))
>>> type(lm.out).__name__
'PackedLinear'
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.nn.functional as TF
from torch import Tensor, nn

from qkv._versions import version
from qkv.kernels._native import decode_ops
from qkv.kernels._replace import replace_linears

__all__ = ["PackedLinear", "SMALL_ROWS", "pack_linears", "panels"]

# up to this many rows the compiled small-batch kernel (every weight read once, up to 6 rows
# per load) beats oneDNN's packed GEMM and MKL (measured, 1 thread, M = 1..13 and beyond)
SMALL_ROWS = 256
_PANEL = 64  # output columns per panel (the kernel's layout)


def panels(weight: Tensor) -> Tensor:
    """``weight (out, in)`` as panels of 64 output columns ``(ceil(out/64), in, 64)``, each
    panel's rows contiguous, zeros past ``out`` (the layout of ``qkv_decode.small_linear``)."""
    out_f, in_f = weight.shape
    n = -(-out_f // _PANEL)
    padded = weight.new_zeros(n * _PANEL, in_f)
    padded[:out_f] = weight
    return padded.view(n, _PANEL, in_f).transpose(1, 2).contiguous()


class PackedLinear(nn.Linear):
    """:class:`torch.nn.Linear` whose few-row inference calls read panel-packed weights."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._panels: Tensor | None = None
        self._panels_of: tuple | None = None  # (data_ptr, version) the panels were built from

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        """The same layer (sharing its parameters), packed."""
        new = cls.__new__(cls)
        new.__dict__.update(linear.__dict__)
        for name in ("_parameters", "_buffers", "_modules"):  # own dicts, shared tensors
            setattr(new, name, dict(getattr(linear, name)))
        new._panels, new._panels_of = None, None
        return new

    def _packed(self) -> Tensor:
        # a weight made under inference_mode has no version: taken as unchanged at the same
        # address (repacking it at every call would double the call's memory traffic)
        w = self.weight
        key = (w.data_ptr(), version(w))
        if self._panels is None or self._panels_of != key:
            self._panels, self._panels_of = panels(w.detach()), key
        return self._panels

    def forward(self, x: Tensor) -> Tensor:
        # the checks cheapest first: a decode step calls this ~7 times per layer
        w = self.weight
        if (
            x.dtype != torch.float32
            or w.dtype != torch.float32
            or not x.is_cpu
            or not w.is_cpu
            or x.dim() == 0
            or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))
            or (op := _small_linear()) is None
        ):
            return TF.linear(x, w, self.bias)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not 0 < rows <= SMALL_ROWS:
            return TF.linear(x, w, self.bias)
        x2 = x.reshape(rows, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = op(x2, self._packed(), self.bias, self.out_features, False)
        return y.view(*x.shape[:-1], self.out_features)


@functools.cache
def _small_linear():
    """The compiled ``small_linear`` overload (looked up once), or ``None``."""
    ops = decode_ops()
    return None if ops is None else ops.small_linear.default


def pack_linears(model: nn.Module, *, skip: Iterable[str] = ()) -> nn.Module:
    """A copy of ``model`` with every :class:`torch.nn.Linear` a :class:`PackedLinear`.

    ``skip``: module names or ``fnmatch`` patterns of linears to leave as they are; each
    must match at least one linear (a typo is an error). The original model is unchanged.
    """
    return replace_linears(model, PackedLinear.from_linear, skip, select=lambda m: type(m) is nn.Linear)
