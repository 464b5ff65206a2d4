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


DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@st.composite
def attention_inputs(draw, *, allow_empty: bool = True, max_T: int = 24):
    """Random ``(q, k, v, kw)`` for one attention call, adversarial on purpose.

    Any of ``B``, ``h``, ``Tq``, ``Tk`` may be 0 (``allow_empty``), ``d_v`` always; the dtype is one of
    fp16/bf16/fp32/fp64; values have magnitude up to 1e4 and ``scale`` goes up to 1e10, so
    the logits reach ~1e19. ``kw`` holds ``causal``, ``window``, ``scale`` and maybe a
    ``mask``/``bias`` (:func:`draw_mask_and_bias`); q, k, v are exact in their dtype, so an
    fp64 reference computed from them measures only the kernel's own error.
    """
    lo = 0 if allow_empty else 1
    B = draw(st.integers(lo, 2))
    h_kv = draw(st.integers(1, 2))
    h = h_kv * draw(st.integers(lo, 2))
    Tq, Tk = draw(st.integers(lo, max_T)), draw(st.integers(lo, max_T))
    d, d_v = draw(st.integers(1, 16)), draw(st.integers(0, 8))
    dtype = draw(st.sampled_from(DTYPES))
    magnitude = draw(st.sampled_from([1.0, 35.0, 1e3, 1e4]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))

    def make(*shape):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * magnitude).to(dtype)

    q, k, v = make(B, h, Tq, d), make(B, h_kv, Tk, d), make(B, h_kv, Tk, d_v)
    kw = dict(
        causal=draw(st.booleans()),
        window=draw(st.none() | st.integers(1, 12)),
        scale=draw(st.none() | st.sampled_from([1e-3, 0.1, 1.0, 30.0, 1e4, 1e10])),
    )
    mask, bias = draw_mask_and_bias(draw, g, B, h, Tq, Tk, dtype)
    if bias is not None and draw(st.booleans()):  # an additive mask: -inf entries, whole rows
        bias = bias.masked_fill(torch.rand(bias.shape, generator=g) < 0.4, float("-inf"))
    kw.update({n: t for n, t in (("mask", mask), ("bias", bias)) if t is not None})
    return q, k, v, kw
