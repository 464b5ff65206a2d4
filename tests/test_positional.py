import math

import pytest
import torch

from qkv.positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding, TokenEmbedding


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


def test_learned_positions_limit():
    pe = LearnedPositionalEmbedding(4, 8)
    assert pe(torch.zeros(2, 4, 8)).shape == (2, 4, 8)
    with pytest.raises(ValueError, match="max_len=4"):
        pe(torch.zeros(1, 2, 8), offset=3)
