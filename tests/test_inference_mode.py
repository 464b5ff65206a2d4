"""qkv under ``torch.inference_mode()``: tensors made there have no version counter, which
qkv's remembered work (a mask's hidden keys, packed weights, prepared decoders) is keyed by.
Every call gives what it gives outside inference mode, and a mask refilled in place there is
seen anew."""

from __future__ import annotations

import pytest
import torch

from qkv import scaled_dot_product_attention
from qkv._nonfinite import _SMALL
from qkv.attention import MultiHeadAttention
from qkv.kernels.packed import PackedLinear
from test_nonfinite import rule

BACKENDS = ("math", "flash", "torch", "decode", "auto")


def _qkv(Tq: int, Tk: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 4, T, 64, generator=g) for T in (Tq, Tk, Tk)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("Tk", [40, _SMALL // (2 * 4 * 64) + 50])  # values looked at whole / by keys
def test_masked_calls_equal_those_outside(backend, Tk):
    Tq = 1 if backend == "decode" else 6
    q, k, v = _qkv(Tq, Tk, 0)
    v[1, 2, 7, 3] = float("nan")  # at a key the mask hides: must not reach any row
    mask = torch.rand(2, 1, 1, Tk, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[..., 7] = False
    outside = scaled_dot_product_attention(q, k, v, mask=mask, backend=backend)
    with torch.inference_mode():
        m = mask.clone()  # an inference tensor
        inside = scaled_dot_product_attention(q, k, v, mask=m, backend=backend)
    assert torch.isfinite(outside).all()
    torch.testing.assert_close(inside, outside, atol=0, rtol=0)


def test_a_mask_refilled_in_place_is_seen_anew():
    """A decode loop's padding mask, one buffer refilled under inference_mode: the keys it
    hides are looked at again at every call (an inference tensor's change cannot be seen)."""
    Tk = _SMALL // (2 * 4 * 64) + 50  # large enough for the hidden-keys path
    q, k, v = _qkv(1, Tk, 2)
    v[0, 1, 5, 0] = float("nan")
    with torch.inference_mode():
        mask = torch.ones(2, 1, 1, Tk, dtype=torch.bool)
        mask[..., 5] = False
        first = scaled_dot_product_attention(q, k, v, mask=mask)
        mask[..., 5] = True  # the same buffer, refilled: key 5 (NaN value) is seen now
        second = scaled_dot_product_attention(q, k, v, mask=mask)
        mask_now = mask.clone()
    assert torch.isfinite(first).all()
    expected = rule(q, k, v, mask=mask_now.clone())
    torch.testing.assert_close(second.double(), expected, equal_nan=True, atol=1e-5, rtol=1e-5)
    assert second[0, 1].isnan().any()


def test_modules_made_and_run_in_inference_mode():
    torch.manual_seed(3)
    mha, lin = MultiHeadAttention(64, 4).eval(), torch.nn.Linear(64, 48)
    x = torch.randn(2, 300, 64)
    mask = torch.rand(2, 1, 1, 300) > 0.2
    with torch.no_grad():
        want_mha, want_lin = mha(x, mask=mask), lin(x[0, :5])
    with torch.inference_mode():
        mha2 = MultiHeadAttention(64, 4).eval()  # parameters made here: inference tensors
        mha2.load_state_dict(mha.state_dict())
        packed = PackedLinear(64, 48)
        packed.load_state_dict(lin.state_dict())
        got_mha, got_lin = mha2(x, mask=mask.clone()), packed(x[0, :5])
    torch.testing.assert_close(got_mha, want_mha, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lin, want_lin, atol=1e-5, rtol=1e-5)


def test_the_translator_loaded_and_run_in_inference_mode():
    from qkv.translate import load

    lines = ["The boy trains the puppy.", "Two men are sitting on a bench in the park."]
    try:
        tr = load("en-fr")
    except ValueError:
        pytest.skip("no shipped en-fr translator in this install")
    want = [tr(lines, beam=b) for b in (1, 5)]
    with torch.inference_mode():
        tr2 = load("en-fr")
        got = [tr2(lines, beam=b) for b in (1, 5)]
    assert got == want and want[0][0] == "Le garçon entraîne le chiot."
