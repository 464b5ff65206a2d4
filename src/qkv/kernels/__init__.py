"""Fast attention paths, each tested against the reference math of :mod:`qkv.functional`.

- :mod:`qkv.kernels.flash`: tiled attention with the online softmax and block skipping.
- :mod:`qkv.kernels.int8`: int8 linear layers for CPU inference (``quantize_linears``).
- :mod:`qkv.kernels.packed`: linear layers whose few-row calls read panel-packed weights
  (``pack_linears``), for decoding at the read bandwidth.

:func:`native_status` says which compiled level runs on this CPU (and why none, if so).
"""

from qkv.kernels._native import native_status
from qkv.kernels.flash import flash_attention

__all__ = ["flash_attention", "native_status"]
