"""KVCache.update(rows=...): the rows are checked as reorder()'s index is, before any write."""

import pytest
import torch

from qkv.cache import KVCache


def kv(B: int, T: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 2, T, 8, generator=g), torch.randn(
        B, 2, T, 8, generator=g
    )  # (B, h_kv, T, d)


@pytest.mark.parametrize("quantized", [False, True])
def test_rows_of_any_integer_dtype_write_those_rows(quantized):
    """int32 rows (what numpy or a tokenizer hands over) are batch rows as int64 ones are."""
    dtype = torch.int8 if quantized else None
    k0, v0 = kv(4, seed=1)
    k1, v1 = kv(2, seed=2)
    want = KVCache(capacity=8, dtype=dtype)
    want.update(k0, v0)
    want.update(k1, v1, rows=torch.tensor([3, 1]))
    for rows in (torch.tensor([3, 1], dtype=torch.int32), torch.tensor([3, 1], dtype=torch.int16),
                 torch.tensor([3, 1], dtype=torch.uint8)):  # fmt: skip
        cache = KVCache(capacity=8, dtype=dtype)
        cache.update(k0, v0)
        keys, values = cache.update(k1, v1, rows=rows)
        # the rows written (the others' new positions were never written: stale)
        torch.testing.assert_close(keys[[3, 1]], want.keys[[3, 1]], rtol=0, atol=0)
        torch.testing.assert_close(values[[3, 1]], want.values[[3, 1]], rtol=0, atol=0)
        torch.testing.assert_close(keys[:, :, :3], want.keys[:, :, :3], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("rows", "error", "words"),
    [(torch.tensor([3.0, 1.0]), TypeError, r"rows must be an integer tensor \(B',\) of batch rows, "
                                           r"got dtype torch.float32"),
     (torch.tensor([True, False]), TypeError, "rows must be an integer.*torch.bool"),
     ([3, 1], TypeError, r"rows must be an integer tensor \(B',\), got list"),
     (torch.tensor([[3, 1]]), ValueError, r"rows must be 1-D \(B',\), got shape \(1, 2\)"),
     (torch.tensor([3, 4]), IndexError, r"rows must hold batch rows in \[0, 3\] \(the cache holds "
                                        r"batch size 4\), got 4"),
     (torch.tensor([-1, 1]), IndexError, "rows must hold batch rows in .* got -1"),
     (torch.tensor([0, 1, 2]), ValueError, "one batch row per row of k")],
)  # fmt: skip
def test_bad_rows_are_refused_naming_the_argument_and_change_nothing(rows, error, words):
    cache = KVCache(capacity=8)
    k0, v0 = kv(4, seed=1)
    cache.update(k0, v0)
    before = cache.keys.clone(), cache.values.clone()
    with pytest.raises(error, match=words):
        cache.update(*kv(2, seed=2), rows=rows)
    assert len(cache) == k0.shape[2]
    torch.testing.assert_close(cache.keys, before[0], rtol=0, atol=0)
    torch.testing.assert_close(cache.values, before[1], rtol=0, atol=0)
