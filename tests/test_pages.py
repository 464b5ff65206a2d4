"""Large KV-cache buffers asked for on 2 MiB pages (qkv._pages), and what uses them."""

import pytest
import torch

from qkv import KVCache, _pages
from qkv.cache import BufferPool

MiB = 1 << 20
madvise_mode = pytest.mark.skipif(
    _pages.huge_pages_mode() != "madvise",
    reason=f"Linux huge pages in 'madvise' mode needed (here: {_pages.huge_pages_mode()}); in "
    "'always' mode every buffer is eligible, so the request could not be told apart",
)


def thp_eligible(t: torch.Tensor) -> bool:
    """Whether the kernel's memory map marks the mapping holding t as huge-page eligible."""
    ptr, inside = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end ..."
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and line.startswith("THPeligible:"):
                return line.split()[1] == "1"
    raise AssertionError("no mapping holds the tensor")


def test_small_buffers_are_plain_tensors():
    t = _pages.empty((3, 5), torch.bfloat16, "cpu")
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.untyped_storage().nbytes() == 30  # no slack: torch.empty itself
    t = _pages.empty((_pages.MIN_BYTES // 4 - 1,), torch.float32, "cpu")  # just below
    assert t.untyped_storage().nbytes() == t.numel() * 4


@madvise_mode
def test_large_buffers_are_aligned_advised_and_usable():
    t = _pages.empty((5, MiB // 2), torch.float64, "cpu")  # 20 MiB
    assert t.shape == (5, MiB // 2) and t.dtype == torch.float64 and t.is_contiguous()
    assert t.data_ptr() % (2 * MiB) == 0
    t.copy_(torch.arange(t.numel(), dtype=torch.float64).view_as(t))
    assert t[4, -1].item() == t.numel() - 1 and t.sum().item() == t.numel() * (t.numel() - 1) / 2
    assert thp_eligible(t)
    assert not thp_eligible(torch.empty(5, MiB // 2, dtype=torch.float64))  # the control


@madvise_mode
def test_only_whole_huge_pages_are_advised(monkeypatch):
    """17 MiB: the request covers the first 16 MiB, 2 MiB-aligned, not the last 1 MiB (a huge
    page there would be backed in full, 1 MiB beyond the tensor); QKV_HUGE_PAGES=0 asks for
    none. (The calls are recorded: whether a tail reads as eligible in smaps also depends on
    advice given earlier to memory the allocator reuses.)"""
    real, calls = _pages._madvise(), []
    monkeypatch.setattr(_pages, "_madvise", lambda: lambda *a: calls.append(a) or real(*a))
    t = _pages.empty((17 * MiB,), torch.uint8, "cpu")
    assert calls == [(t.data_ptr(), 16 * MiB, 14)] and t.data_ptr() % (2 * MiB) == 0
    assert thp_eligible(t)
    monkeypatch.setenv("QKV_HUGE_PAGES", "0")
    plain = _pages.empty((17 * MiB,), torch.uint8, "cpu")
    assert plain.untyped_storage().nbytes() == 17 * MiB and len(calls) == 1


@madvise_mode
def test_kv_cache_buffers_on_huge_pages_with_and_without_a_pool():
    """A 16 MiB cache is advised; with a pool, growing gives the old buffers back (found by
    their storage, which starts before the view) and the next cache reuses them."""
    k, v = torch.randn(1, 8, 4096, 128), torch.randn(1, 8, 4096, 128)  # 16 MiB each
    keys, values = KVCache(capacity=4096).update(k, v)
    assert thp_eligible(keys) and thp_eligible(values) and keys.data_ptr() % (2 * MiB) == 0
    torch.testing.assert_close(keys, k, rtol=0, atol=0)

    pool = BufferPool()
    cache = KVCache(capacity=4096, pool=pool)
    cache.update(k, v)
    first = {cache.keys.untyped_storage().data_ptr(), cache.values.untyped_storage().data_ptr()}
    extra = torch.randn(1, 8, 1, 128)
    keys, values = cache.update(extra, extra)  # full: grows to 8192, the 16 MiB pair goes back
    assert pool.nbytes == 2 * 16 * MiB
    torch.testing.assert_close(keys, torch.cat([k, extra], 2), rtol=0, atol=0)
    again = KVCache(capacity=4096, pool=pool)
    again.update(v, k)
    assert {again.keys.untyped_storage().data_ptr(),
            again.values.untyped_storage().data_ptr()} == first  # fmt: skip
    assert pool.nbytes == 0 and thp_eligible(again.keys)
    torch.testing.assert_close(again.keys, v, rtol=0, atol=0)
