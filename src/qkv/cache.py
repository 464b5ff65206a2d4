"""A key/value cache for incremental decoding.

Self-attention: each step appends the new tokens' keys and values, and the new queries
attend to everything cached (``causal=True`` aligns bottom-right, so query ``i`` of the step
sits at position ``len(cache) - Tq + i``). Cross-attention: the encoder's keys and values are
computed once, on the first step, and reused.

Shapes: keys and values are ``(B, h_kv, T, d_k)``.
"""

from __future__ import annotations

from torch import Tensor


class KVCache:
    """Grows along time with amortised doubling; ``update`` returns views of what is filled.

    >>> cache = KVCache()
    >>> k, v = cache.update(torch.zeros(2, 4, 3, 8), torch.zeros(2, 4, 3, 8))
    >>> k.shape, len(cache)
    (torch.Size([2, 4, 3, 8]), 3)
    """

    def __init__(self, max_len: int | None = None) -> None:
        self.max_len = max_len
        self._k: Tensor | None = None  # (B, h_kv, capacity, d_k)
        self._v: Tensor | None = None  # (B, h_kv, capacity, d_v)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    @property
    def is_empty(self) -> bool:
        return self._len == 0

    @property
    def batch_size(self) -> int | None:
        return None if self._k is None else self._k.shape[0]

    @property
    def keys(self) -> Tensor | None:
        return None if self._k is None else self._k[:, :, : self._len]

    @property
    def values(self) -> Tensor | None:
        return None if self._v is None else self._v[:, :, : self._len]

    def reset(self) -> None:
        self._k = self._v = None
        self._len = 0

    def _check(self, k: Tensor, v: Tensor) -> None:
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(
                "k and v must be (B, h_kv, T, d) with equal B, h_kv, T, got "
                f"k={tuple(k.shape)}, v={tuple(v.shape)}"
            )
        if self._k is None:
            return
        want_k, want_v = self._k.shape, self._v.shape
        if k.shape[0] != want_k[0]:
            raise ValueError(
                f"cache holds batch size {want_k[0]}, got k with batch size {k.shape[0]} "
                "(call reset() for a new batch, or reorder() to select beams)"
            )
        if k.shape[1] != want_k[1] or k.shape[3] != want_k[3] or v.shape[3] != want_v[3]:
            raise ValueError(
                f"cache holds k (B, {want_k[1]}, T, {want_k[3]}) and v (B, {want_v[1]}, T, "
                f"{want_v[3]}), got k={tuple(k.shape)}, v={tuple(v.shape)}"
            )
        if k.dtype != self._k.dtype or k.device != self._k.device:
            raise TypeError(
                f"cache holds {self._k.dtype} on {self._k.device}, got {k.dtype} on {k.device}"
            )

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k (B, h_kv, T_new, d_k)``, ``v (B, h_kv, T_new, d_v)``; return all cached."""
        self._check(k, v)
        new_len = self._len + k.shape[2]
        if self.max_len is not None and new_len > self.max_len:
            raise ValueError(f"cache overflow: {new_len} positions > max_len={self.max_len}")
        if self._k is None or new_len > self._k.shape[2]:
            capacity = max(new_len, 2 * (0 if self._k is None else self._k.shape[2]), 16)
            if self.max_len is not None:
                capacity = min(capacity, self.max_len)
            self._k = self._grow(self._k, k, capacity)
            self._v = self._grow(self._v, v, capacity)
        self._k[:, :, self._len : new_len] = k
        self._v[:, :, self._len : new_len] = v
        self._len = new_len
        return self.keys, self.values

    def _grow(self, old: Tensor | None, like: Tensor, capacity: int) -> Tensor:
        B, h, _, d = like.shape
        new = like.new_empty(B, h, capacity, d)
        if old is not None:
            new[:, :, : self._len] = old[:, :, : self._len]
        return new

    def set(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Replace the contents (cross-attention: the encoder's keys and values, once)."""
        self.reset()
        return self.update(k, v)

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (beam search: follow the surviving beams)."""
        if self._k is not None:
            self._k = self._k.index_select(0, index)
            self._v = self._v.index_select(0, index)

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on (speculative decoding, retries)."""
        if not 0 <= length <= self._len:
            raise ValueError(f"length must be in [0, {self._len}], got {length}")
        self._len = length
