"""The compiled kernels of a generation step: beam search's fused log-softmax + top-k
(``qkv_decode.beam_topk``), greedy search's pick (``qkv_decode.argmax_rows``), the
small-batch linear (``qkv_decode.small_linear``) and the decode kernel reading reordered
beams through a rows table, against references nobody here wrote (torch's
``log_softmax``/``topk``/``argmax``, fp64 matmuls), in the -march=native build and in the
portable one."""

import pytest
import torch
import torch.nn.functional as TF

from native import assert_level_ok, other_levels, require_built
from qkv.kernels._native import decode_ops, native_module, native_status
from qkv.kernels.packed import panels as _panels
from qkv.models.incremental import SmallBatchLinear, _gather

require_built(decode_ops() is not None, "decode kernel", native_status())


def _reference_topk(logits, scores, beams, k, block):
    logp = logits.double().log_softmax(-1)
    if block >= 0:
        logp[:, block] = float("-inf")
    cand = (logp + scores.double()[:, None]).view(-1, beams * logits.shape[1])
    return cand.topk(k, dim=1)


@pytest.mark.parametrize(
    "B, K, V, block",
    [
        (1, 5, 8000, -1),
        (4, 5, 8000, 2),
        (3, 2, 37, 0),
        (2, 4, 5, 4),
        (1, 1, 16, -1),
        (2, 3, 33, 32),
    ],
)
def test_beam_topk_equals_log_softmax_then_topk(B, K, V, block):
    torch.manual_seed(B * 100 + V)
    logits = torch.randn(B * K, V) * 4
    scores = torch.randn(B * K) * 3
    scores[1::K] = float("-inf")  # dead hypotheses, as at the first step
    k = min(2 * K, K * V)
    top, idx = decode_ops().beam_topk(logits, scores, K, k, block)
    ref_top, ref_idx = _reference_topk(logits, scores, K, k, block)
    torch.testing.assert_close(top.double(), ref_top, atol=2e-5, rtol=1e-6)
    assert torch.equal(idx, ref_idx)  # random values: no ties
    assert top.shape == (B, k) and idx.dtype == torch.long


def test_beam_topk_fills_missing_candidates_with_minus_inf():
    """Fewer than k candidates above -inf: the rest are -inf at the lowest unused indices."""
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.1, 0.2]])
    scores = torch.tensor([0.0, float("-inf")])
    top, idx = decode_ops().beam_topk(logits, scores, 2, 4, 1)  # token 1 blocked
    ref = logits[0].log_softmax(-1)
    assert idx[0, :2].tolist() == [2, 0]
    torch.testing.assert_close(top[0, :2], ref[[2, 0]])
    assert top[0, 2:].tolist() == [float("-inf")] * 2 and idx[0, 2:].tolist() == [1, 3]


def _reference_argmax(logits, block):
    x = logits.clone()
    if block >= 0:
        x[:, block] = float("-inf")
    return x.argmax(-1)


@pytest.mark.parametrize("V", [1, 5, 16, 17, 33, 8000])
@pytest.mark.parametrize("block", [-1, 0, "last", "mid"])
def test_argmax_rows_equals_torch_argmax_after_blocking(V, block):
    """Greedy search's pick: torch.argmax after ``logits[:, block] = -inf``, ties (first
    index), NaN (the first NaN), +inf and rows that are all -inf included."""
    block = {"last": V - 1, "mid": V // 2}.get(block, block)
    torch.manual_seed(V)
    x = torch.randn(9, V)
    x[1] = torch.randint(0, 3, (V,)).float()  # ties
    x[2] = float("-inf")  # nothing finite: index 0 (or the blocked token's first -inf)
    x[3, V // 3] = float("nan")
    x[3, -1] = float("nan")
    x[4, V // 2] = float("inf")
    x[5, :] = 7.0  # all equal
    x[6, block if block >= 0 else 0] = 100.0  # the maximum is the blocked token
    x[7, V - 1] = 50.0  # the maximum in the scalar tail
    got = decode_ops().argmax_rows(x, block)
    assert torch.equal(got, _reference_argmax(x, block)), (got, _reference_argmax(x, block))
    assert got.dtype == torch.long and got.shape == (9,)


def test_greedy_pick_writes_the_argmax_and_counts_eos():
    """Greedy search's step (the extension module's greedy_pick): the argmax of each row,
    written into the given row of the output, and how many rows chose </s>."""
    module = native_module()
    torch.manual_seed(3)
    x = torch.randn(6, 50)
    x[[1, 4], 2] = 9.0  # two rows choose token 2
    out = torch.full((3, 6), -1, dtype=torch.long)
    assert module.greedy_pick(x, -1, 2, out[1]) == 2
    assert torch.equal(out[1], x.argmax(-1)) and bool((out[[0, 2]] == -1).all())
    assert module.greedy_pick(x, 2, 2, out[2]) == 0  # </s> blocked
    assert torch.equal(out[2], _reference_argmax(x, 2))
    assert module.greedy_pick(x, -1, -1, out[0]) == 0  # no </s> to count
    with pytest.raises(RuntimeError, match="contiguous int64"):
        module.greedy_pick(x, -1, 2, out[:, 0])  # a strided column
    with pytest.raises(RuntimeError, match="contiguous int64"):
        module.greedy_pick(x, -1, 2, torch.zeros(5, dtype=torch.long))


def test_argmax_rows_bad_input_is_an_error():
    with pytest.raises(RuntimeError, match="contiguous float32"):
        decode_ops().argmax_rows(torch.randn(2, 5).double(), -1)
    with pytest.raises(RuntimeError, match="V >= 1"):
        decode_ops().argmax_rows(torch.randn(2, 0), -1)


@pytest.mark.parametrize("M", [1, 2, 5, 6, 7, 13, 40])
@pytest.mark.parametrize("out_f, in_f", [(1, 1), (63, 37), (64, 256), (100, 37), (300, 130)])
@pytest.mark.parametrize("bias, relu", [(True, False), (False, True)])
def test_small_linear_matches_fp64(M, out_f, in_f, bias, relu):
    torch.manual_seed(M + out_f)
    w = torch.randn(out_f, in_f)
    b = torch.randn(out_f) if bias else None
    x = torch.randn(M, in_f + 3)[:, :in_f]  # rows with a stride: read in place
    y = decode_ops().small_linear(x, _panels(w), b, out_f, relu)
    ref = TF.linear(x.double(), w.double(), None if b is None else b.double())
    ref = ref.relu() if relu else ref
    torch.testing.assert_close(y.double(), ref, atol=1e-5 * in_f**0.5, rtol=1e-5)


@pytest.mark.parametrize("activation", ["none", "relu", "gelu"])
@pytest.mark.parametrize("M", [1, 5, 32, 300])  # the compiled kernel and oneDNN (M > 256)
def test_small_batch_linear_equals_f_linear(M, activation):
    torch.manual_seed(M)
    w, b, x = torch.randn(200, 96), torch.randn(200), torch.randn(M, 96)
    lin = SmallBatchLinear(w, b, activation)
    ref = TF.linear(x.double(), w.double(), b.double())
    ref = {"none": ref, "relu": ref.relu(), "gelu": TF.gelu(ref)}[activation]
    torch.testing.assert_close(lin(x).double(), ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("Tk", [1, 7, 16, 45, 200])
@pytest.mark.parametrize("h, h_kv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("gone", [0, 3])
def test_decode_reads_reordered_beams_through_the_rows_table(Tk, h, h_kv, gone):
    """``rows[b, p]``: the batch row holding row b's key/value at position p (beams reordered
    without copying the cache; ``gone`` more rows of sentences that finished) equals
    attention over the gathered cache, fp64 reference."""
    torch.manual_seed(Tk + h)
    N, cap, d = 6, Tk + 5, 32
    q = torch.randn(N, h, 1, d)
    kbuf, vbuf = torch.randn(N + gone, h_kv, cap, d), torch.randn(N + gone, h_kv, cap, d)
    k, v = kbuf[:, :, :Tk], vbuf[:, :, :Tk]  # cache views, as a decode step reads them
    rows = torch.randint(0, N + gone, (N, cap))
    out = decode_ops().fwd(q, k, v, None, d**-0.5, True, -1, 0, rows)[0]
    pos = torch.arange(Tk)
    kg = k.transpose(1, 2)[rows[:, :Tk], pos].transpose(1, 2).double()  # (N, h_kv, Tk, d)
    vg = v.transpose(1, 2)[rows[:, :Tk], pos].transpose(1, 2).double()
    ref = TF.scaled_dot_product_attention(q.double(), kg, vg, enable_gqa=h != h_kv)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("Tk", [1, 7, 16, 45, 200])
@pytest.mark.parametrize("h, h_kv", [(4, 4), (6, 2)])
def test_decode_reads_a_cache_larger_than_the_batch(Tk, h, h_kv):
    """Sentences that finished left the batch without compacting the cache: ``kv_batch[b]``
    names the batch row of a cache holding more rows than q; equals attention over the
    selected rows, fp64 reference, with a mask."""
    torch.manual_seed(Tk + 3 * h)
    Nk, N, cap, d = 7, 3, Tk + 5, 32
    q = torch.randn(N, h, 1, d)
    kbuf, vbuf = torch.randn(Nk, h_kv, cap, d), torch.randn(Nk, h_kv, cap, d)
    k, v = kbuf[:, :, :Tk], vbuf[:, :, :Tk]
    mask = torch.rand(N, 1, 1, Tk) < 0.7
    mask[..., 0] = True
    m5 = mask[:, :, None].expand(N, h_kv, h // h_kv, 1, Tk)  # (N, h_kv, G, Tq, Tk)
    batch = torch.tensor([5, 0, 3])
    out = decode_ops().fwd(q, k, v, m5, d**-0.5, False, -1, 0, None, batch)[0]
    ref = TF.scaled_dot_product_attention(q.double(), k[batch].double(), v[batch].double(),
                                          attn_mask=mask, enable_gqa=h != h_kv)  # fmt: skip
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_kv_batch_bad_input_is_an_error():
    q, k = torch.randn(2, 2, 1, 8), torch.randn(4, 2, 5, 8)
    with pytest.raises(RuntimeError, match="kv_batch out of range"):
        decode_ops().fwd(q, k, k, None, 0.3, True, -1, 0, None, torch.tensor([1, 4]))
    with pytest.raises(RuntimeError, match="kv_batch must be"):
        decode_ops().fwd(q, k, k, None, 0.3, True, -1, 0, None, torch.tensor([1, 2, 3]))
    with pytest.raises(RuntimeError, match="shapes of q, k, v"):  # more rows need a map
        decode_ops().fwd(q, k, k, None, 0.3, True, -1)
    with pytest.raises(RuntimeError, match="not both"):
        decode_ops().fwd(q, k, k, None, 0.3, True, -1, 0, torch.zeros(2, 5, dtype=torch.long),
                         torch.tensor([0, 1]))  # fmt: skip


def test_gathered_cache_for_other_paths():
    """Paths other than the decode kernel get the reordered beams as one tensor."""
    torch.manual_seed(0)
    x, rows = torch.randn(5, 2, 9, 3), torch.randint(0, 5, (5, 12))
    got = _gather(x, rows)
    for b in range(5):
        for p in range(9):
            assert torch.equal(got[b, :, p], x[rows[b, p], :, p])


def test_decode_rows_table_out_of_range_is_an_error():
    q, k = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 5, 8)
    with pytest.raises(RuntimeError, match="rows out of range"):
        decode_ops().fwd(q, k, k, None, 0.3, True, -1, 0, torch.full((2, 5), 2))


_LEVEL_CHECK_SCRIPT = """
import torch
from qkv.kernels._native import decode_ops, native_module, native_status
from qkv.kernels.packed import panels as _panels
torch.manual_seed(0)
ops = decode_ops()
logits, scores = torch.randn(6, 101) * 4, torch.randn(6)
top, idx = ops.beam_topk(logits, scores, 3, 6, 7)
logp = logits.double().log_softmax(-1)
logp[:, 7] = float("-inf")
ref_top, ref_idx = (logp + scores.double()[:, None]).view(2, 303).topk(6, dim=1)
assert torch.equal(idx, ref_idx) and (top.double() - ref_top).abs().max() < 2e-5
x = torch.randint(0, 4, (5, 77)).float()
x[1, 9] = float("nan")
ref = x.clone()
ref[:, 3] = float("-inf")
assert torch.equal(ops.argmax_rows(x, 3), ref.argmax(-1))
for M in (1, 5, 13):
    w, b, x = torch.randn(100, 37), torch.randn(100), torch.randn(M, 37)
    y = ops.small_linear(x, _panels(w), b, 100, True)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double()).relu()
    assert (y.double() - ref).abs().max() < 1e-4, M
q, kb = torch.randn(5, 4, 1, 24), torch.randn(2, 5, 2, 40, 24)
k, v = kb[0, :, :, :33], kb[1, :, :, :33]
rows = torch.randint(0, 5, (5, 40))
out = ops.fwd(q, k, v, None, 0.2, True, -1, 0, rows)[0]
pos = torch.arange(33)
kg = k.transpose(1, 2)[rows[:, :33], pos].transpose(1, 2).double()
vg = v.transpose(1, 2)[rows[:, :33], pos].transpose(1, 2).double()
ref = torch.nn.functional.scaled_dot_product_attention(q.double(), kg, vg, scale=0.2,
                                                       enable_gqa=True)
assert (out.double() - ref).abs().max() < 1e-5
# the compiled encoder and decoder step (plain loops here) decode as the uncached model does
from qkv.generate import beam_search, greedy_search
from qkv.models import Seq2SeqTransformer, TransformerConfig
from qkv.models.incremental import IncrementalDecoder
cfg = TransformerConfig(src_vocab_size=40, tgt_vocab_size=40, d_model=32, n_heads=4, d_ff=64,
                        dropout=0.0, n_kv_heads=2)
model = Seq2SeqTransformer(cfg).eval()
dec = IncrementalDecoder.for_model(model)
assert dec.fused is not None and dec.fused_encoder is not None
src = torch.tensor([[5, 6, 7, 8, 9, 2], [10, 11, 2, 0, 0, 0]])
assert torch.equal(greedy_search(model, src, max_new_tokens=8),
                   greedy_search(model, src, max_new_tokens=8, use_cache=False))
assert torch.equal(beam_search(model, src, beam_size=3, max_new_tokens=8),
                   beam_search(model, src, beam_size=3, max_new_tokens=8, use_cache=False))
print("ok")
"""


@pytest.mark.parametrize("level", other_levels())
def test_every_level_gives_the_same_answers(level):
    """Each other kernel level this CPU can run (the portable build's plain C++ included)
    gives the same answers."""
    assert_level_ok(_LEVEL_CHECK_SCRIPT, level)


@pytest.mark.parametrize("Tk", [1, 33, 300])
def test_decode_fp32_queries_over_a_bf16_cache(Tk):
    """An fp32 model with a bf16 cache: the kernel reads the cache as stored, the queries
    rounded to bf16 (as its bf16 dot products take them), the output in fp32; equals the fp64
    reference on those inputs within the bf16 kernel's rounding of the weights (2^-8)."""
    torch.manual_seed(Tk)
    q = torch.randn(3, 8, 1, 64)
    k, v = torch.randn(3, 2, Tk, 64).bfloat16(), torch.randn(3, 2, Tk, 64).bfloat16()
    out, lse = decode_ops().fwd(q, k, v, None, 0.125, False, -1)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    qd, kd, vd = q.bfloat16().double(), k.double(), v.double()
    ref = TF.scaled_dot_product_attention(qd, kd, vd, scale=0.125, enable_gqa=True)
    torch.testing.assert_close(out.double(), ref, atol=2**-8 * float(vd.abs().max()), rtol=0)
    s = (qd @ kd.repeat_interleave(4, 1).transpose(-1, -2)) * 0.125  # (3, 8, 1, Tk)
    torch.testing.assert_close(lse.double(), s.logsumexp(-1), atol=1e-4, rtol=1e-5)
    with pytest.raises(RuntimeError, match="share a dtype"):  # bf16 queries, fp32 cache: no
        decode_ops().fwd(q.bfloat16(), k.float(), v.float(), None, 0.125, False, -1)
