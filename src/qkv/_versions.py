"""A tensor's version counter, where it has one: what work remembered for a tensor is keyed by.

An in-place change bumps a tensor's ``_version``, so work keyed by it (a mask's hidden keys,
a weight's packed panels, a model's prepared decoder) is redone when its inputs change. A
tensor made under ``torch.inference_mode()`` has no version counter, and asking for it
raises: :func:`version` gives ``None`` for it, and each caller says what that means for it.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["version"]


def version(t: Tensor) -> int | None:
    """``t._version``, or ``None`` for an inference tensor (it has no version counter)."""
    return None if t.is_inference() else t._version
