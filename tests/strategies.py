"""Hypothesis pieces shared by the attention property tests (functional, dispatch, flash)."""

import hypothesis.strategies as st
import torch

from qkv import masks


def draw_mask_and_bias(draw, g: torch.Generator, B: int, h: int, Tq: int, Tk: int, dtype):
    """A random mask (True = may attend) of one of the accepted shapes, and maybe a bias.

    Returns ``(mask, bias)``; either may be ``None``. Shapes: ``(Tq, Tk)``, key padding
    ``(B, 1, 1, Tk)`` or full ``(B, h, Tq, Tk)``; bias ``(1, h, Tq, Tk)``.
    """
    kind = draw(st.sampled_from(["none", "2d", "padding", "full"]))
    mask = {
        "none": lambda: None,
        "2d": lambda: torch.rand(Tq, Tk, generator=g) > 0.3,
        "padding": lambda: masks.padding(torch.randint(0, Tk + 1, (B,), generator=g), Tk),
        "full": lambda: torch.rand(B, h, Tq, Tk, generator=g) > 0.3,
    }[kind]()
    bias = torch.randn(1, h, Tq, Tk, generator=g, dtype=dtype) if draw(st.booleans()) else None
    return mask, bias
