import math

import pytest
import torch

from qkv.positional import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    TokenEmbedding,
)


def test_sinusoidal_matches_formula():
    pe = SinusoidalPositionalEncoding(6).table(5)
    pos, i = 3, 1
    assert pe[pos, 2 * i].item() == pytest.approx(math.sin(pos / 10000 ** (2 * i / 6)))
    assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(pos / 10000 ** (2 * i / 6)))
    assert torch.allclose(SinusoidalPositionalEncoding(6).table(2, offset=3), pe[3:5])


def test_token_embedding_scaled_and_checked():
    emb = TokenEmbedding(10, 16)
    ids = torch.tensor([[1, 2]])
    torch.testing.assert_close(emb(ids), emb.embedding(ids) * 4.0)
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        emb(torch.tensor([[10]]))
    with pytest.raises(TypeError, match="integer"):
        emb(torch.tensor([[1.0]]))


def test_learned_positions_add_their_rows_up_to_the_limit():
    pe = LearnedPositionalEmbedding(4, 8)
    table = pe.embedding.weight.detach()  # (max_len, d_model): row p is position p
    x = torch.randn(2, 4, 8)
    torch.testing.assert_close(pe(x), x + table)
    torch.testing.assert_close(pe(x[:, :2], offset=2), x[:, :2] + table[2:4])
    with pytest.raises(ValueError, match="max_len=4"):
        pe(torch.zeros(1, 2, 8), offset=3)


def test_rope_equals_the_formula_at_any_offset_and_after_inference():
    """rotate() against the rotation written out in fp64, for offsets that grow its table
    past several sizes; a table first built under inference_mode still trains."""
    d = 8
    rope = RotaryEmbedding(d)
    x = torch.randn(2, 3, 5, d, dtype=torch.float64)
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    for offset in (0, 3, 60, 200, 1000):
        with torch.inference_mode():  # the table is (re)built here
            got = rope.rotate(x.float(), offset)
        pos = torch.arange(offset, offset + 5, dtype=torch.float64)
        ang = pos[:, None] * inv[None, :]  # (T, d/2)
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        want = torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)
        torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=1e-4)
    q = torch.randn(1, 2, 4, d, requires_grad=True)
    rope.rotate(q, 7).sum().backward()  # no "inference tensors cannot be saved" error
    assert q.grad is not None and torch.isfinite(q.grad).all()
