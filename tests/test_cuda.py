"""qkv on a CUDA device: every backend that runs there against fp64 references, the
CPU-only kernels refused with a reason, the module, the caches and generation. Skipped
where there is no GPU (the suite's machines); run where one is lent."""

import pytest
import torch
import torch.nn.functional as TF

from qkv.attention import MultiHeadAttention
from qkv.cache import KVCache, dequantize_rows, quantize_rows
from qkv.dispatch import explain_dispatch
from qkv.functional import attention_steps, scaled_dot_product_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEV = "cuda"


def _case(g, B=2, h=8, h_kv=2, Tq=37, Tk=53, d=32, dtype=torch.float32):
    q = torch.randn(B, h, Tq, d, generator=g)
    k, v = (torch.randn(B, h_kv, Tk, d, generator=g) for _ in range(2))
    return [t.to(DEV, dtype) for t in (q, k, v)]


@pytest.mark.parametrize("backend", ["auto", "math", "torch", "flash"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_backend_on_cuda_matches_fp64(backend, dtype):
    g = torch.Generator().manual_seed(0)
    q, k, v = _case(g, dtype=dtype)
    mask = (torch.rand(37, 53, generator=g) > 0.3).to(DEV)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for kw in ({}, {"causal": True}, {"mask": mask}, {"causal": True, "window": 9}):
        out = scaled_dot_product_attention(q, k, v, backend=backend, **kw)
        assert out.device.type == "cuda" and out.dtype == dtype
        ref = attention_steps(*(t.double() for t in (q, k, v)), **kw).output
        assert (out.double() - ref).abs().max().item() < tol, (backend, kw)


def test_gradients_on_cuda_match_fp64():
    g = torch.Generator().manual_seed(1)
    q, k, v = (t.requires_grad_() for t in _case(g, Tq=20, Tk=20))
    for backend in ("auto", "flash", "torch"):
        out = scaled_dot_product_attention(q, k, v, causal=True, backend=backend)
        ours = torch.autograd.grad(out.sum(), (q, k, v))
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = attention_steps(qd, kd, vd, causal=True).output
        theirs = torch.autograd.grad(ref.sum(), (qd, kd, vd))
        for a, b in zip(ours, theirs):
            assert (a.double() - b).abs().max().item() < 1e-4, backend


def test_the_cpu_kernels_are_refused_on_cuda_with_a_reason():
    q, k, v = _case(torch.Generator().manual_seed(2), Tq=1)
    why = explain_dispatch(q, k, v).reasons.get("decode", "")
    assert "CPU-only" in why, why
    with pytest.raises(ValueError, match="decode.*CPU-only"):
        scaled_dot_product_attention(q, k, v, backend="decode")


def test_multi_head_attention_on_cuda_matches_torch():
    torch.manual_seed(3)
    ours = MultiHeadAttention(64, 4).to(DEV)
    theirs = torch.nn.MultiheadAttention(64, 4, batch_first=True).to(DEV)
    with torch.no_grad():
        theirs.in_proj_weight.copy_(torch.cat([ours.w_q.weight, ours.w_k.weight, ours.w_v.weight]))
        theirs.in_proj_bias.copy_(torch.cat([ours.w_q.bias, ours.w_k.bias, ours.w_v.bias]))
        theirs.out_proj.weight.copy_(ours.w_o.weight)
        theirs.out_proj.bias.copy_(ours.w_o.bias)
    x = torch.randn(3, 11, 64, device=DEV)
    causal = torch.ones(11, 11, dtype=torch.bool, device=DEV).triu(1)  # torch: True = blocked
    ref, _ = theirs(x, x, x, attn_mask=causal, need_weights=False)
    torch.testing.assert_close(ours(x, causal=True), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_caches_on_cuda_step_by_step_equal_one_call(dtype):
    torch.manual_seed(4)
    mha = MultiHeadAttention(64, 8, n_kv_heads=2).to(DEV).eval()
    x = torch.randn(2, 9, 64, device=DEV)
    cache = KVCache(dtype=dtype)
    with torch.no_grad():
        full = mha(x, causal=True)
        steps = torch.cat([mha(x[:, t : t + 1], causal=True, cache=cache) for t in range(9)], 1)
    assert cache.keys.device.type == "cuda" and len(cache) == 9
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.int8: 3e-2}[dtype]
    assert (steps - full).abs().max().item() < tol, dtype


def test_int8_rows_on_cuda_are_those_of_the_cpu():
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(5))
    packed = quantize_rows(x.to(DEV))
    assert torch.equal(packed.cpu(), quantize_rows(x))
    assert torch.equal(dequantize_rows(packed).cpu(), dequantize_rows(quantize_rows(x)))


def test_torch_sdpa_agrees_on_cuda():
    """The reference itself against PyTorch's SDPA on the device (GQA expanded)."""
    q, k, v = _case(torch.Generator().manual_seed(6))
    ours = scaled_dot_product_attention(q, k, v, causal=True, backend="math")
    kk, vv = (t.repeat_interleave(4, dim=1) for t in (k, v))
    theirs = TF.scaled_dot_product_attention(q, kk, vv, is_causal=False,
                                             attn_mask=torch.ones(37, 53, dtype=torch.bool,
                                                                  device=DEV).tril(53 - 37))  # fmt: skip
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_a_nan_at_seen_keys_on_cuda_follows_the_rule():
    """A NaN on the device, at a key every row sees: every backend that runs there gives the
    rule's NaN rows (tests/test_nonfinite.py) and the other rows' numbers. The rule's exact
    checks (NaN/inf at keys a row may not see, an inf value) are CPU-only: on CUDA each would
    wait for the device, and qkv._nonfinite says so. Seen on an H100: torch SDPA's kernel
    for the grouped-rows layout turns an inf value into NaN (its online-softmax rescaling)."""
    from test_nonfinite import rule

    g = torch.Generator().manual_seed(7)
    q, k, v = (t.cpu() for t in _case(g, Tq=6, Tk=11))
    k[0, 0, 3, 1] = float("nan")  # every row of kv head 0, batch 0: NaN
    ref = rule(q, k, v)
    assert ref.isnan().any() and not ref.isnan().all()
    for backend in ("auto", "math", "torch", "flash"):
        out = scaled_dot_product_attention(q.to(DEV), k.to(DEV), v.to(DEV), backend=backend)
        torch.testing.assert_close(out.cpu().double(), ref, atol=1e-5, rtol=1e-5,
                                   equal_nan=True, msg=backend)  # fmt: skip


@pytest.mark.parametrize("Tq", [1, 4, 16])
def test_grouped_query_decoding_on_cuda_matches_fp64(Tq):
    """Few queries over a long grouped-query cache (the torch backend's grouped-rows route)."""
    g = torch.Generator().manual_seed(8)
    q, k, v = _case(g, Tq=Tq, Tk=300)
    mask = (torch.rand(Tq, 300, generator=g) > 0.3).to(DEV)
    for backend in ("auto", "torch"):
        for kw in ({}, {"causal": True}, {"mask": mask}, {"causal": True, "window": 50}):
            out = scaled_dot_product_attention(q, k, v, backend=backend, **kw)
            ref = attention_steps(*(t.double() for t in (q, k, v)), **kw).output
            assert (out.double() - ref).abs().max().item() < 1e-5, (backend, kw)


@pytest.fixture(scope="module")
def translator():
    from qkv.translate import load

    try:
        tr = load("en-fr")
    except ValueError:
        pytest.skip("no shipped en-fr translator in this install")
    tr.model.to(DEV)
    return tr


def test_the_shipped_translator_on_cuda_says_the_notes_sentence(translator):
    for beam in (1, 5):
        assert translator("The boy trains the puppy.", beam=beam) == "Le garçon entraîne le chiot."


def test_lens_on_cuda_predicts_what_the_translator_writes(translator):
    from qkv.generate import greedy_search
    from qkv.inspect.lens import lens

    model, tok = translator.model.eval(), translator.tokenizer
    src = torch.tensor([tok.encode("The boy trains the puppy.") + [tok.eos_id]], device=DEV)
    with torch.no_grad():
        out = greedy_search(model, src)[0].tolist()
    hyp = out[: out.index(tok.eos_id) + 1]
    tgt = torch.tensor([[model.cfg.bos_id, *hyp[:-1]]], device=DEV)
    seen = lens(model, src, tgt, top_k=3)
    assert seen.top_ids[-1, :, 0].tolist() == hyp
    assert seen.check < 1e-3 * max(1.0, abs(seen.logit))
