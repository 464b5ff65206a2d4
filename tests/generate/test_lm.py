"""CausalLM generation: the prepared decoder equals the model's forward; generate() equals
decoding without a cache; sampling, end tokens and bad input."""

import pytest
import torch

from qkv.cache import SCALE_BYTES
from qkv.generate import generate
from qkv.kernels.int8 import quantize_linears
from qkv.kernels.packed import pack_linears
from qkv.models import CausalLM, TransformerConfig
from qkv.models.lm_decoder import LMDecoder

torch.set_num_threads(1)


def lm_(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = TransformerConfig(src_vocab_size=50, tgt_vocab_size=50, d_model=32, n_heads=4,
                            d_ff=64, n_encoder_layers=0, n_decoder_layers=2, dropout=0.0,
                            max_len=128, **kw)  # fmt: skip
    return CausalLM(cfg).eval()


CONFIGS = [
    dict(positional="rope", n_kv_heads=2),
    dict(positional="sinusoidal"),
    dict(positional="learned", norm_first=False),
    dict(positional="rope", n_kv_heads=1, activation="gelu"),
]


@pytest.mark.parametrize("kw", CONFIGS)
@pytest.mark.parametrize("prefill", [1, 7])
def test_prepared_steps_equal_the_model_forward(kw, prefill):
    lm = lm_(**kw)
    dec = LMDecoder.for_model(lm)
    assert dec is not None
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 50, (3, prefill + 6), generator=g)
    with torch.inference_mode():
        want = lm(ids)  # (B, T, V): the whole sequence, no cache
        caches = lm.new_cache(capacity=ids.shape[1])
        lm(ids[:, :prefill], cache=caches)
        state = dec.start(caches)
        got = torch.stack([dec.step(state, ids[:, t]) for t in range(prefill, ids.shape[1])], 1)
    torch.testing.assert_close(got, want[:, prefill:], atol=1e-5, rtol=1e-5)


def reference_greedy(lm, prompt, n):
    """Greedy continuation recomputing the whole sequence every step (no cache)."""
    ids = prompt
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, lm(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[:, prompt.shape[1] :]


@pytest.mark.parametrize("kw", CONFIGS[:3])
def test_greedy_generate_equals_uncached_decoding(kw):
    lm = lm_(seed=2, **kw)
    prompt = torch.randint(3, 50, (2, 9), generator=torch.Generator().manual_seed(3))
    out = generate(lm, prompt, max_new_tokens=12, prefill_chunk=4)  # chunked prefill too
    assert torch.equal(out, reference_greedy(lm, prompt, 12))


def test_packed_int8_and_bf16_cache_paths_run_prepared():
    lm = lm_(seed=4, positional="rope", n_kv_heads=2)
    prompt = torch.randint(3, 50, (2, 5), generator=torch.Generator().manual_seed(5))
    want = generate(lm, prompt, max_new_tokens=10)
    packed = pack_linears(lm)
    assert LMDecoder.for_model(packed) is not None
    assert torch.equal(generate(packed, prompt, max_new_tokens=10), want)
    q = quantize_linears(lm)
    assert LMDecoder.for_model(q) is not None
    assert generate(q, prompt, max_new_tokens=10).shape == (2, 10)
    bf16 = generate(lm, prompt, max_new_tokens=10, cache_dtype=torch.bfloat16)
    assert (bf16 == want).float().mean() >= 0.8  # a rounded cache may flip a close call


def test_int8_cache_prepared_steps_equal_the_module_forward():
    """An int8 cache: LMDecoder (the decode kernel reading the packed rows) gives the
    logits of the module forward over the same cache (MultiHeadAttention's own reading),
    step by step; tokens stay those of the fp32 cache but for close calls."""
    lm = lm_(seed=8, positional="rope", n_kv_heads=2)
    prompt = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        caches = [lm.new_cache(dtype=torch.int8) for _ in range(2)]
        for c in caches:
            lm(prompt, cache=c)
        dec = LMDecoder.for_model(lm)
        state = dec.start(caches[0], max_len=20)
        tok = prompt[:, -1]
        for _ in range(6):
            fast = dec.step(state, tok)
            ref = lm(tok[:, None], cache=caches[1])[:, -1]
            torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
            tok = ref.argmax(-1)
        assert caches[0][0].keys.dtype == torch.int8
        # the same rows written, up to the projections' rounding: LMDecoder's few-row linears
        # and PyTorch's sum in other orders (bit for bit alike on some CPUs only), so a value
        # on a rounding boundary may land one step apart and a scale a few ulps apart
        for fast_layer, ref_layer in zip(caches[0], caches[1]):
            for a, b in ((fast_layer.keys, ref_layer.keys), (fast_layer.values, ref_layer.values)):
                sa, sb = (x[..., -SCALE_BYTES:].contiguous().view(torch.float32) for x in (a, b))
                torch.testing.assert_close(sa, sb, rtol=1e-5, atol=0)
                steps = (a[..., :-SCALE_BYTES].int() - b[..., :-SCALE_BYTES].int()).abs()
                assert steps.max() <= 1 and (steps > 0).float().mean() < 0.05
    want = generate(lm, prompt, max_new_tokens=10)
    int8 = generate(lm, prompt, max_new_tokens=10, cache_dtype=torch.int8)
    assert (int8 == want).float().mean() >= 0.8


def test_general_path_when_an_inspection_hook_is_set():
    lm = lm_(seed=6)
    prompt = torch.randint(3, 50, (1, 4), generator=torch.Generator().manual_seed(7))
    want = generate(lm, prompt, max_new_tokens=8)
    lm.layers[0].self_attn.head_mask = torch.ones(4)
    assert LMDecoder.for_model(lm) is None
    assert torch.equal(generate(lm, prompt, max_new_tokens=8), want)


def test_prepared_copy_follows_weights_and_backend():
    lm = lm_(seed=8)
    first = LMDecoder.for_model(lm)
    assert LMDecoder.for_model(lm) is first
    lm.layers[0].self_attn.backend = "torch"  # another attention path: prepared again
    second = LMDecoder.for_model(lm)
    assert second is not first and second.layers[0].backend == "torch"
    with torch.no_grad():
        lm.layers[1].ffn.w_2.weight.mul_(2.0)
    assert LMDecoder.for_model(lm) is not second


def test_generate_runs_in_eval_mode_and_gives_the_training_mode_back():
    torch.manual_seed(3)
    cfg = TransformerConfig(src_vocab_size=50, tgt_vocab_size=50, d_model=32, n_heads=4,
                            d_ff=64, n_encoder_layers=0, n_decoder_layers=2, dropout=0.5,
                            max_len=128)  # fmt: skip
    lm = CausalLM(cfg).eval()
    prompt = torch.tensor([[5, 6, 7]])
    expected = generate(lm, prompt, max_new_tokens=6)
    lm.train()
    got = generate(lm, prompt, max_new_tokens=6)
    assert torch.equal(got, expected)  # dropout off while generating
    assert lm.training and all(m.training for m in lm.modules())


def test_eos_sampling_and_top_k():
    lm = lm_(seed=12)
    prompt = torch.randint(3, 50, (3, 4), generator=torch.Generator().manual_seed(10))
    greedy = generate(lm, prompt, max_new_tokens=10).tolist()
    # a row whose greedy continuation changes token at step j; that token becomes the end
    r, j = next((r, j) for r in range(3) for j in range(1, 10) if greedy[r][j] not in greedy[r][:j])
    eos = greedy[r][j]
    out = generate(lm, prompt, max_new_tokens=10, eos_id=eos).tolist()
    for b in range(3):  # every row: the greedy tokens up to its first end token, then pads
        n = greedy[b].index(eos) + 1 if eos in greedy[b] else 10
        assert out[b][:n] == greedy[b][:n] and all(t == lm.cfg.pad_id for t in out[b][n:])
    greedy = torch.tensor(greedy)
    top1 = generate(lm, prompt, max_new_tokens=10, temperature=1.3, top_k=1)
    assert torch.equal(top1, greedy)  # one candidate: sampling is greedy
    a = generate(lm, prompt, max_new_tokens=10, temperature=1.0,
                 generator=torch.Generator().manual_seed(0))  # fmt: skip
    b = generate(lm, prompt, max_new_tokens=10, temperature=1.0,
                 generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert torch.equal(a, b) and not torch.equal(a, greedy)


def test_bad_input():
    lm = lm_()
    with pytest.raises(TypeError, match="prompt must be an integer tensor"):
        generate(lm, torch.zeros(1, 3), max_new_tokens=2)
    with pytest.raises(TypeError, match="T >= 1"):
        generate(lm, torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(lm, torch.ones(1, 3, dtype=torch.long), max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        generate(lm, torch.ones(1, 3, dtype=torch.long), max_new_tokens=2, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        generate(lm, torch.ones(1, 3, dtype=torch.long), max_new_tokens=2, top_k=0)
    learned = lm_(positional="learned")
    with pytest.raises(ValueError, match="max_len=128"):
        generate(learned, torch.ones(1, 100, dtype=torch.long), max_new_tokens=40)
    with pytest.raises(ValueError, match="one KVCache per layer"):
        LMDecoder.for_model(lm).start(lm.new_cache()[:1])
