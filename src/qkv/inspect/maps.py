"""``AttentionMaps`` and ``merge_steps`` live in :mod:`qkv.capture.maps` (below both
:mod:`qkv.hf` and :mod:`qkv.inspect`, which use them); this module keeps the old import path.
"""

from qkv.capture.maps import KINDS, AttentionMaps, merge_steps

__all__ = ["KINDS", "AttentionMaps", "merge_steps"]
