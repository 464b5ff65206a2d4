import pytest
import torch

from qkv import masks


def test_causal_and_window_shapes():
    assert masks.causal(3).int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert masks.causal(2, 4).int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert masks.sliding_window(4, 4, 2, causal=False).int().tolist() == [
        [1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]
    ]  # fmt: skip


def test_padding_and_conversions():
    m = masks.padding([2, 0, 3], 3)
    assert m.shape == (3, 1, 1, 3)
    assert m[:, 0, 0].int().tolist() == [[1, 1, 0], [0, 0, 0], [1, 1, 1]]
    kpm = torch.tensor([[False, False, True]])  # PyTorch: True = padding
    assert masks.from_key_padding_mask(kpm)[0, 0, 0].tolist() == [True, True, False]
    mask, bias = masks.from_torch_attn_mask(torch.tensor([[False, True]]))
    assert mask.tolist() == [[True, False]] and bias is None
    with pytest.raises(ValueError, match="lengths"):
        masks.padding([4], 3)


def test_combine_is_the_and_of_its_masks():
    """causal(3) and padding([2, 3]) combined: pair (i, j) allowed iff j <= i and j < length,
    written out pair by pair."""
    c = masks.combine(masks.causal(3), None, masks.padding([2, 3], 3))
    want = [[[[j <= i and j < n for j in range(3)] for i in range(3)]] for n in (2, 3)]
    assert c.tolist() == want  # (2, 1, 3, 3)
    assert masks.combine(None) is None
    with pytest.raises(TypeError, match="bool masks"):
        masks.combine(masks.causal(3), torch.ones(3, 3))


def test_alibi_slopes_match_paper():
    assert masks.alibi_slopes(8).tolist() == pytest.approx([2 ** -(i + 1) for i in range(8)])
    s6 = masks.alibi_slopes(6).tolist()
    assert s6[:4] == pytest.approx([2**-2, 2**-4, 2**-6, 2**-8])
    assert s6[4:] == pytest.approx([2**-1, 2**-3])
    b = masks.alibi_bias(2, 3)
    assert b.shape == (1, 2, 3, 3) and b[0, 0, 2].tolist() == pytest.approx(
        [-2 / 16, -1 / 16, 0.0]
    )  # slope 2^-4
