"""KVCache: preallocated buffers read as views, growth, storage dtype, beam reorder, pools."""

import pytest
import torch

from qkv import KVCache, MultiHeadAttention
from qkv import functional as F
from qkv.cache import BufferPool

torch.set_num_threads(1)


def kv(B=3, h=2, T=1, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, h, T, d, generator=g), torch.randn(B, h, T, d, generator=g)


def test_views_share_one_preallocated_buffer():
    cache = KVCache(capacity=10)
    ks, vs, ptrs = [], [], set()
    for t in range(10):
        k, v = kv(seed=t)
        ks.append(k)
        vs.append(v)
        keys, values = cache.update(k, v)
        ptrs.add((keys.data_ptr(), values.data_ptr()))
    assert len(ptrs) == 1  # every step wrote into the same buffers: no copy, no growth
    assert cache.capacity == 10 and keys.shape == (3, 2, 10, 8)
    torch.testing.assert_close(keys, torch.cat(ks, 2), rtol=0, atol=0)
    torch.testing.assert_close(values, torch.cat(vs, 2), rtol=0, atol=0)


def test_growth_doubles_and_keeps_contents():
    cache = KVCache()
    chunks = [kv(T=t, seed=t) for t in (5, 12, 1, 20)]
    caps = []
    for k, v in chunks:
        cache.update(k, v)
        caps.append(cache.capacity)
    assert caps == [16, 32, 32, 64]  # max(needed, 2·capacity)
    torch.testing.assert_close(cache.keys, torch.cat([k for k, _ in chunks], 2), rtol=0, atol=0)
    torch.testing.assert_close(cache.values, torch.cat([v for _, v in chunks], 2), rtol=0, atol=0)


def test_max_len_caps_capacity_and_overflow_is_an_error():
    cache = KVCache(max_len=6)
    cache.update(*kv(T=4))
    assert cache.capacity == 6
    with pytest.raises(ValueError, match="max_len=6"):
        cache.update(*kv(T=3))


def test_storage_dtype_rounds_once_and_attention_matches_rounded_reference():
    torch.manual_seed(1)
    mha = MultiHeadAttention(32, 4, n_kv_heads=2).eval()
    x = torch.randn(2, 7, 32)
    cache = KVCache(dtype=torch.bfloat16)
    steps = torch.cat([mha(x[:, t : t + 1], causal=True, cache=cache) for t in range(7)], 1)
    assert cache.keys.dtype == torch.bfloat16
    # the reference: the same projections, keys/values rounded to bf16, fp32 math
    q = mha.split_heads(mha.w_q(x), 4)
    k, v = mha.project_kv(x)
    torch.testing.assert_close(cache.keys, k.to(torch.bfloat16), rtol=0, atol=0)
    ref = F.attention_steps(
        q.double(), k.to(torch.bfloat16).double(), v.to(torch.bfloat16).double(), causal=True
    ).output
    want = mha.w_o(mha.merge_heads(ref.float()))
    torch.testing.assert_close(steps, want, atol=1e-5, rtol=1e-5)


def test_reorder_gathers_filled_rows_into_the_second_buffer():
    cache = KVCache(capacity=8)
    chunks = [kv(B=4, seed=t) for t in range(3)]
    for k, v in chunks:
        cache.update(k, v)
    full_k = torch.cat([k for k, _ in chunks], 2)
    index = torch.tensor([2, 2, 0, 3])
    first = cache.keys.data_ptr()
    cache.reorder(index)
    second = cache.keys.data_ptr()
    torch.testing.assert_close(cache.keys, full_k[index], rtol=0, atol=0)
    cache.reorder(torch.tensor([1, 0, 3, 2]))
    assert cache.keys.data_ptr() == first != second  # two buffers, swapped: no allocation
    torch.testing.assert_close(cache.keys, full_k[index][[1, 0, 3, 2]], rtol=0, atol=0)
    k, v = kv(B=4, seed=9)  # appending after a reorder continues the reordered rows
    cache.update(k, v)
    torch.testing.assert_close(cache.keys[:, :, 3:], k, rtol=0, atol=0)
    kept = cache.keys.clone()
    spare_ptr = second if cache.keys.data_ptr() == first else first
    cache.reorder(torch.tensor([3, 1]))  # fewer rows: the first rows of the spare buffer
    assert cache.batch_size == 2 and len(cache) == 4
    assert cache.keys.data_ptr() == spare_ptr  # nothing allocated
    torch.testing.assert_close(cache.keys, kept[[3, 1]], rtol=0, atol=0)
    k, v = kv(B=2, seed=10)  # the smaller batch appends and reorders like any other
    cache.update(k, v)
    cache.reorder(torch.tensor([1, 1, 0]))  # a larger batch again, within the spare's 4 rows
    want = torch.cat([kept[[3, 1]], k], 2)[[1, 1, 0]]
    torch.testing.assert_close(cache.keys, want, rtol=0, atol=0)
    cache.reorder(torch.tensor([2, 0, 1]))
    torch.testing.assert_close(cache.keys, want[[2, 0, 1]], rtol=0, atol=0)


def test_reorder_keeps_gradients():
    k = torch.randn(3, 2, 4, 8, requires_grad=True)
    cache = KVCache()
    cache.update(k, k * 2)
    cache.reorder(torch.tensor([2, 0, 1]))
    cache.keys.sum().backward()
    torch.testing.assert_close(k.grad, torch.ones_like(k))


def test_bad_arguments():
    with pytest.raises(ValueError, match="capacity"):
        KVCache(capacity=0)
    with pytest.raises(TypeError, match="dtype"):
        KVCache(dtype=torch.int16)
    cache = KVCache()
    cache.update(*kv())
    with pytest.raises(ValueError, match="batch size 3"):
        cache.update(*kv(B=2))
    with pytest.raises(TypeError, match="float32"):
        cache.update(*(t.double() for t in kv()))
    with pytest.raises(ValueError, match="1-D"):
        cache.reorder(torch.zeros(3, 1, dtype=torch.long))


def test_causal_lm_preallocated_caches_decode_like_the_full_forward():
    from qkv.models import CausalLM, TransformerConfig

    torch.manual_seed(2)
    cfg = TransformerConfig(src_vocab_size=30, tgt_vocab_size=30, d_model=32, n_heads=4,
                            n_kv_heads=2, d_ff=64, positional="rope", dropout=0.0)  # fmt: skip
    lm = CausalLM(cfg).eval()
    ids = torch.tensor([[1, 4, 5, 6, 7, 8]])
    full = lm(ids)  # (1, 6, V)
    cache = lm.new_cache(capacity=6)
    steps = torch.cat([lm(ids[:, :3], cache=cache)] + [lm(ids[:, t : t + 1], cache=cache)
                                                       for t in range(3, 6)], 1)  # fmt: skip
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)
    assert all(c.capacity == 6 and len(c) == 6 for c in cache)  # allocated once, never grown


def test_update_into_chosen_rows():
    """rows=: a batch some of whose rows stopped writes only the rows still running."""
    cache = KVCache(capacity=8)
    k0, v0 = kv(B=4, seed=1)
    cache.update(k0, v0)
    k1, v1 = kv(B=2, seed=2)
    keys, values = cache.update(k1, v1, rows=torch.tensor([3, 1]))
    assert keys.shape[0] == 4 and len(cache) == 2 * k0.shape[2]
    new = slice(k0.shape[2], 2 * k0.shape[2])
    torch.testing.assert_close(keys[[3, 1], :, new], k1, rtol=0, atol=0)
    torch.testing.assert_close(values[[3, 1], :, new], v1, rtol=0, atol=0)
    torch.testing.assert_close(keys[:, :, : k0.shape[2]], k0, rtol=0, atol=0)  # kept
    with pytest.raises(ValueError, match="one batch row per row of k"):
        cache.update(k1, v1, rows=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="first update"):
        KVCache().update(k1, v1, rows=torch.tensor([0, 1]))


def test_pooled_buffers_are_reused_and_keep_every_behaviour():
    """With a pool, growth, reorder and reset return the buffers to it, and the next cache
    takes them instead of new memory: same contents as without a pool."""
    pool = BufferPool()
    chunks = [kv(T=t, seed=t) for t in (5, 12, 1)]
    ptrs = []
    for _ in range(2):
        cache, plain = KVCache(pool=pool), KVCache()
        for k, v in chunks:  # 16 -> 32 positions: the 16-position buffers go back
            cache.update(k, v)
            plain.update(k, v)
        index = torch.tensor([2, 0, 0, 1])
        cache.reorder(index)
        plain.reorder(index)
        torch.testing.assert_close(cache.keys, plain.keys, rtol=0, atol=0)
        torch.testing.assert_close(cache.values, plain.values, rtol=0, atol=0)
        ptrs.append({cache.keys.untyped_storage().data_ptr(),
                     cache.values.untyped_storage().data_ptr()})  # fmt: skip
        held = pool.nbytes
        cache.reset()
        assert pool.nbytes > held and cache.keys is None
    assert ptrs[1] <= {b.data_ptr() for b in pool._free}  # the second cache's, reused
    n_free = len(pool._free)
    KVCache(pool=pool).update(*kv(T=4))  # a smaller one takes the smallest that fits
    assert len(pool._free) == n_free - 2


def test_pool_limits_and_modes():
    pool = BufferPool(max_bytes=1000)
    pool.give_back(torch.empty(100))  # 400 bytes
    pool.give_back(torch.empty(200))  # 800 more: over the limit, dropped
    assert pool.nbytes == 400
    assert pool.take(50, torch.float32, "cpu").numel() == 100  # kept one, fits
    assert pool.take(50, torch.float32, "cpu").numel() == 50  # none left: new, exact size
    pool = BufferPool()
    pool.give_back(torch.empty(100, dtype=torch.float64))
    assert pool.take(10, torch.float32, "cpu").dtype == torch.float32  # not the float64 one
    with torch.inference_mode():
        pool.give_back(pool.take(100, torch.float64, "cpu"))  # new: an inference tensor
        assert pool.take(10, torch.float64, "cpu").is_inference()
        pool.give_back(torch.empty(100, dtype=torch.float64))
    assert len(pool._free) == 2  # one inference tensor, one not
    got = pool.take(10, torch.float64, "cpu")  # outside inference mode: not the inference one
    assert not got.is_inference()
    got.add_(1)  # writable here
    assert pool.take(10, torch.float64, "cpu").is_inference() is False  # new, not the other


def test_extend_counts_positions_the_caller_writes():
    """extend(n): the buffers grow if needed, the length counts the new positions, and what
    the caller writes there is what attention then reads."""
    cache = KVCache(capacity=4)
    with pytest.raises(ValueError, match="update\\(\\) it first"):
        cache.extend(1)
    k, v = torch.randn(2, 3, 3, 5), torch.randn(2, 3, 3, 5)
    cache.update(k, v)
    for step in range(3):  # past the capacity of 4: grows
        kb, vb = cache.extend(1)
        t = len(cache) - 1
        kb[:, :, t], vb[:, :, t] = step + 1.0, -(step + 1.0)
    assert len(cache) == 6 and cache.capacity >= 6
    assert torch.equal(cache.keys[:, :, :3], k) and torch.equal(cache.values[:, :, :3], v)
    for step in range(3):
        assert bool((cache.keys[:, :, 3 + step] == step + 1.0).all())
        assert bool((cache.values[:, :, 3 + step] == -(step + 1.0)).all())
    bounded = KVCache(max_len=4)
    bounded.update(k, v)
    bounded.extend(1)
    with pytest.raises(ValueError, match="cache overflow"):
        bounded.extend(1)


@pytest.mark.parametrize(
    "index, error, words",
    [
        (torch.tensor([True, False, True]), TypeError, "index must be an integer.*torch.bool"),
        (torch.tensor([0.5]), TypeError, "index must be an integer.*torch.float32"),
        ([0, 1], TypeError, "index must be an integer tensor.*list"),
        (torch.tensor([[0, 1]]), ValueError, "index must be 1-D"),
        (torch.tensor([0, -1]), IndexError, r"\[0, 2\].*got -1"),
        (torch.tensor([0, 3]), IndexError, r"\[0, 2\].*batch size 3.*got 3"),
    ],
)
def test_reorder_refuses_bad_index_and_leaves_the_cache_as_it_was(index, error, words):
    cache = KVCache()
    k, v = kv(T=2)
    cache.update(k, v)
    with pytest.raises(error, match=words):
        cache.reorder(index)
    assert len(cache) == 2 and cache.batch_size == 3
    torch.testing.assert_close(cache.keys, k, rtol=0, atol=0)


def test_reorder_checks_index_before_the_first_update_too():
    with pytest.raises(TypeError, match="torch.bool"):
        KVCache().reorder(torch.tensor([True]))
    KVCache().reorder(torch.tensor([5]))  # no batch yet: nothing to check the range against
    cache = KVCache()
    cache.update(*kv(B=3, T=1))
    cache.reorder(torch.tensor([2, 0], dtype=torch.int32))  # any integer dtype
    assert cache.batch_size == 2


@pytest.mark.parametrize("n, error", [(-5, ValueError), (1.5, TypeError), (True, TypeError)])
def test_extend_refuses_bad_counts_and_keeps_a_usable_length(n, error):
    cache = KVCache()
    cache.update(*kv(T=2))
    with pytest.raises(error, match="n must be an int >= 0"):
        cache.extend(n)
    assert len(cache) == 2
    cache.extend(0)  # a no-op
    assert len(cache) == 2


def test_truncate_and_reserve_refuse_non_integers():
    cache = KVCache()
    cache.update(*kv(T=4))
    with pytest.raises(TypeError, match="length must be an int"):
        cache.truncate(2.5)
    with pytest.raises(TypeError, match="capacity must be an int"):
        cache.reserve(8.0)
    with pytest.raises(ValueError, match="capacity must be an int >= 0"):
        cache.reserve(-1)
    assert len(cache) == 4


def test_one_cache_shared_by_two_layers_is_refused():
    torch.manual_seed(5)
    a, b = MultiHeadAttention(16, 2).eval(), MultiHeadAttention(16, 2).eval()
    x = torch.randn(2, 1, 16)
    cache = KVCache()
    a(x, causal=True, cache=cache)
    assert cache.owner is a
    words = "already belongs to layer MultiHeadAttention.*give each layer its own cache"
    with pytest.raises(ValueError, match=words):
        b(x, causal=True, cache=cache)
    assert len(cache) == 1  # b wrote nothing
    a(x, causal=True, cache=cache)  # the owner goes on
    assert len(cache) == 2
    # cross-attention: the second layer would read the first one's projected memory
    memory, cross = torch.randn(2, 3, 16), KVCache()
    a(x, memory, cache=cross)
    with pytest.raises(ValueError, match="already belongs"):
        b(x, memory, cache=cross)
    a(x, memory, cache=cross)  # set() then reuse by the owner


def test_reset_releases_the_owner_and_reuse_by_the_same_layer_works():
    a, b = MultiHeadAttention(16, 2).eval(), MultiHeadAttention(16, 2).eval()
    x = torch.randn(2, 3, 16)
    cache = KVCache()
    for _ in range(2):  # one generation after another, same layer, same cache
        cache.reset()
        for t in range(3):
            a(x[:, t : t + 1], causal=True, cache=cache)
        assert len(cache) == 3 and cache.owner is a
    cache.reset()
    assert cache.owner is None
    b(x, causal=True, cache=cache)  # released: another layer may take it
    assert cache.owner is b


def test_a_copied_cache_has_no_owner():
    import copy
    import pickle

    a = MultiHeadAttention(16, 2).eval()
    cache = KVCache()
    with torch.no_grad():  # keys computed with autograd are no graph leaves: no deepcopy
        a(torch.randn(1, 2, 16), causal=True, cache=cache)
    for twin in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        assert twin.owner is None and len(twin) == 2
        torch.testing.assert_close(twin.keys, cache.keys, rtol=0, atol=0)
    assert cache.owner is a


def test_a_cache_does_not_keep_its_layer_alive():
    import gc

    cache = KVCache()
    a = MultiHeadAttention(16, 2).eval()
    a(torch.randn(1, 1, 16), causal=True, cache=cache)
    del a
    gc.collect()
    assert cache.owner is None
    cache.reset()
    MultiHeadAttention(16, 2).eval()(torch.randn(1, 1, 16), causal=True, cache=cache)


def test_model_caches_one_per_layer_still_work():
    from qkv.models import CausalLM, Seq2SeqTransformer, TransformerConfig

    cfg = TransformerConfig(src_vocab_size=20, tgt_vocab_size=20, d_model=16, n_heads=2,
                            d_ff=32, n_encoder_layers=1, n_decoder_layers=2,
                            dropout=0.0)  # fmt: skip
    lm = CausalLM(cfg).eval()
    caches = lm.new_cache()
    for _ in range(2):
        lm(torch.tensor([[1, 4, 5]]), cache=caches)
    assert [c.owner for c in caches] == [layer.self_attn for layer in lm.layers]
    with pytest.raises(ValueError, match="already belongs"):  # one cache for every layer
        lm(torch.tensor([[1]]), cache=[KVCache()] * 2)
    model = Seq2SeqTransformer(cfg).eval()
    src = torch.tensor([[5, 6, 2]])
    mask = model.src_mask(src)
    memory, cache = model.encode(src, mask), model.new_cache()
    for tok in (1, 7, 8):
        model.decode(torch.tensor([[tok]]), memory, mask, cache=cache)
    assert len(cache) == 3
