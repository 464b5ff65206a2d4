"""The "torch" backend's grouped-rows layout (qkv.dispatch.torch_adapter): a grouped-query
call with few queries runs as ``G·Tq`` rows per kv head. Checked against the fp64 reference
math on every mask shape, causal and window, and that it is the layout that ran."""

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as TF
from hypothesis import given, settings

from qkv import dispatch
from qkv.dispatch import torch_adapter
from qkv.functional import attention_steps, scaled_dot_product_attention


def _reference(q, k, v, **kw):
    return attention_steps(q.double(), k.double(), v.double(), **kw).output


@settings(max_examples=80, deadline=None)
@given(
    B=st.integers(1, 2),
    h_kv=st.integers(1, 3),
    G=st.integers(1, 4),
    Tq=st.integers(1, 18),  # past ROWS_MAX_TQ: the GQA layout again
    extra=st.integers(0, 20),
    mask_kind=st.sampled_from(["none", "padding", "rows", "2d", "per-head"]),
    causal=st.booleans(),
    window=st.sampled_from([None, 1, 3]),
    seed=st.integers(0, 2**16),
)
def test_torch_backend_equals_the_reference(B, h_kv, G, Tq, extra, mask_kind, causal, window,
                                            seed):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    Tk, h, d = Tq + extra, h_kv * G, 8
    q = torch.randn(B, h, Tq, d, generator=g)
    k, v = (torch.randn(B, h_kv, Tk, d, generator=g) for _ in "kv")
    shapes = {"none": None, "padding": (B, 1, 1, Tk), "rows": (B, 1, Tq, Tk), "2d": (Tq, Tk),
              "per-head": (B, h, Tq, Tk)}  # fmt: skip
    shape = shapes[mask_kind]
    mask = None if shape is None else torch.rand(shape, generator=g) < 0.7
    kw = dict(mask=mask, causal=causal, window=window)  # (a row that sees no key: zeros)
    out = scaled_dot_product_attention(q, k, v, backend="torch", **kw)
    torch.testing.assert_close(out.double(), _reference(q, k, v, **kw), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("Tq", "mask", "causal", "rows"), [
    (1, None, True, True),  # decoding: one query sees every key
    (4, None, True, True),  # a few queries, causal: the structure repeated per group
    (4, "padding", False, True),
    (4, "per-head", False, False),  # a mask per query head: the GQA layout
    (17, None, False, False),  # past ROWS_MAX_TQ
])  # fmt: skip
def test_grouped_rows_layout_is_what_runs(monkeypatch, Tq, mask, causal, rows):
    """The query tensor torch SDPA receives: (B, h_kv, G·Tq, d) on the rows layout."""
    B, h_kv, G, Tk, d = 1, 2, 4, 32, 8
    q = torch.randn(B, h_kv * G, Tq, d)
    k = v = torch.randn(B, h_kv, Tk, d)
    m = {None: None, "padding": torch.ones(B, 1, 1, Tk, dtype=torch.bool),
         "per-head": torch.ones(B, h_kv * G, Tq, Tk, dtype=torch.bool)}[mask]  # fmt: skip
    seen = []
    real = TF.scaled_dot_product_attention

    def spy(q, *a, **kw):
        seen.append(tuple(q.shape))
        return real(q, *a, **kw)

    monkeypatch.setattr(TF, "scaled_dot_product_attention", spy)
    dispatch._DECISIONS.clear()  # (a remembered fast path holds the function it was made with)
    for _ in range(2):  # the first call and the remembered fast path
        scaled_dot_product_attention(q, k, v, mask=m, causal=causal, backend="torch")
    expected = (B, h_kv, G * Tq, d) if rows else (B, h_kv * G, Tq, d)
    assert seen == [expected, expected]
    assert torch_adapter.ROWS_MAX_TQ == 16


@pytest.mark.parametrize(("mask", "causal", "window"), [
    (None, False, None),  # the remembered fast path
    ("padding", True, None),  # the structure built per call
    (None, True, 3),
])  # fmt: skip
def test_grouped_rows_take_any_output_strides(monkeypatch, mask, causal, window):
    """torch SDPA may return (B, T, h, d) memory (CUDA's kernels do): the rows layout's output
    must come back to (B, h, Tq, d) whatever its strides, not only by a view."""
    B, h_kv, G, Tq, Tk, d = 2, 2, 3, 4, 19, 8
    g = torch.Generator().manual_seed(9)
    q = torch.randn(B, h_kv * G, Tq, d, generator=g)
    k, v = (torch.randn(B, h_kv, Tk, d, generator=g) for _ in "kv")
    m = None if mask is None else torch.rand(B, 1, 1, Tk, generator=g) < 0.8
    real = TF.scaled_dot_product_attention

    def sdpa_bthd(*a, **kw):  # the same numbers in a (B, T, h, d) memory layout
        return real(*a, **kw).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(TF, "scaled_dot_product_attention", sdpa_bthd)
    dispatch._DECISIONS.clear()
    kw = dict(mask=m, causal=causal, window=window)
    for _ in range(2):
        out = scaled_dot_product_attention(q, k, v, backend="torch", **kw)
        torch.testing.assert_close(out.double(), _reference(q, k, v, **kw), atol=1e-5, rtol=1e-5)
