"""qkv.functional against PyTorch's own SDPA, the attention notes' worked numbers, and each step
against an fp64 reference written out here."""

import math

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as TF
from hypothesis import given

from qkv.functional import attention_steps, scaled_dot_product_attention
from strategies import draw_mask_and_bias


def allowed_pairs(Tq, Tk, mask=None, causal=False, window=None):
    """Where attention is allowed, spelled out here (bottom-right aligned, True = may attend)."""
    allowed = torch.ones(Tq, Tk, dtype=torch.bool)
    if causal:
        allowed &= torch.tril(torch.ones(Tq, Tk, dtype=torch.bool), diagonal=Tk - Tq)
    if window is not None:
        i = torch.arange(Tq)[:, None] + Tk - Tq
        j = torch.arange(Tk)[None, :]
        allowed &= (j > i - window) & ((j <= i) if causal else (j < i + window))
    if mask is not None:
        allowed = allowed & mask
    return allowed


def torch_reference(q, k, v, mask=None, bias=None, causal=False, window=None, scale=None):
    """PyTorch's SDPA with our options spelled out as one float mask (math is PyTorch's)."""
    Tq, Tk = q.shape[-2], k.shape[-2]
    allowed = allowed_pairs(Tq, Tk, mask, causal, window)
    add = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, float("-inf"))
    if bias is not None:
        add = add + bias
    h, h_kv = q.shape[-3], k.shape[-3]
    out = TF.scaled_dot_product_attention(q, k, v, attn_mask=add, scale=scale, enable_gqa=h != h_kv)
    return out, allowed.expand(*q.shape[:-1], Tk).any(-1)  # rows with a visible key


@st.composite
def attention_case(draw):
    B = draw(st.integers(1, 3))
    h_kv = draw(st.integers(1, 3))
    h = h_kv * draw(st.integers(1, 3))
    Tq, Tk = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    d_k, d_v = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    dt = draw(st.sampled_from([torch.float64, torch.float32]))
    q = torch.randn(B, h, Tq, d_k, generator=g, dtype=dt)
    k = torch.randn(B, h_kv, Tk, d_k, generator=g, dtype=dt)
    v = torch.randn(B, h_kv, Tk, d_v, generator=g, dtype=dt)
    mask, bias = draw_mask_and_bias(draw, g, B, h, Tq, Tk, dt)
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.integers(1, 5)))
    scale = draw(st.one_of(st.none(), st.floats(0.1, 2.0)))
    return dict(q=q, k=k, v=v, mask=mask, bias=bias, causal=causal, window=window, scale=scale)


@given(attention_case())
def test_matches_torch_sdpa_values_and_gradients(case):
    q, k, v = (case[n].clone().requires_grad_() for n in "qkv")
    opts = {n: case[n] for n in ("mask", "bias", "causal", "window", "scale")}
    ours = scaled_dot_product_attention(q, k, v, **opts, backend="math")  # the reference
    q2, k2, v2 = (case[n].clone().requires_grad_() for n in "qkv")
    ref, has_key = torch_reference(q2, k2, v2, **opts)
    # Rows with no visible key: PyTorch gives NaN, qkv gives exactly zero.
    torch.testing.assert_close(ours[has_key], ref[has_key])
    assert torch.all(ours[~has_key] == 0)
    grad = torch.randn_like(ours) * has_key[..., None]
    ours.backward(grad)
    ref.masked_fill(~has_key[..., None], 0).backward(grad)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        assert torch.isfinite(a.grad).all()
        torch.testing.assert_close(a.grad, torch.nan_to_num(b.grad))


@given(attention_case())
def test_every_step_equals_an_fp64_reference(case):
    """scores, scaled, masked, lse, weights and output, each against the same step computed
    here in fp64 from the inputs (kv heads repeated, the mask spelled out, torch's softmax and
    logsumexp), not from the other fields of the result."""
    s = attention_steps(**case)
    q, k, v = (case[n].double() for n in "qkv")
    rep = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    scale = case["scale"] if case["scale"] is not None else 1 / math.sqrt(q.shape[-1])
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k)
    scaled = scores * scale
    if case["bias"] is not None:
        scaled = scaled + case["bias"].double()
    Tq, Tk = q.shape[-2], k.shape[-2]
    allowed = allowed_pairs(Tq, Tk, case["mask"], case["causal"], case["window"])
    allowed = allowed.expand(scaled.shape)
    masked = scaled.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(masked, -1)
    weights = torch.softmax(masked, -1).nan_to_num(0.0)  # a row with no key: zeros
    output = weights @ v
    tol = {} if s.output.dtype == torch.float64 else dict(atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(s.scores.double(), scores, **tol)
    torch.testing.assert_close(s.scaled.double().expand(scaled.shape), scaled, **tol)
    assert torch.equal(s.masked.expand(masked.shape) == float("-inf"), ~allowed)
    torch.testing.assert_close(s.masked.double().expand(masked.shape), masked, **tol)
    torch.testing.assert_close(s.lse.double(), lse, **tol)
    torch.testing.assert_close(s.weights.double(), weights, **tol)
    torch.testing.assert_close(s.output.double(), output, **tol)


def test_notes_dot_product_and_score_matrix():
    q = torch.tensor([[[1.0, 2.0, 3.0]]])  # (h=1, Tq=1, d_k=3)
    k = torch.tensor([[[2.0, 1.0, 0.0]]])
    assert attention_steps(q, k, k).scores.item() == 4.0
    k2 = torch.tensor([[[2.0, 1.0, 0.0], [1.0, 2.0, 3.0]]])
    s = attention_steps(q, k2, k2)
    assert s.scores.tolist() == [[[4.0, 14.0]]]
    torch.testing.assert_close(s.scaled, s.scores / math.sqrt(3))


def test_notes_unscaled_self_attention():
    x = torch.tensor([[[0.4, 0.1, 0.8], [0.5, 0.8, 0.6], [0.5, 0.8, 0.6]]])
    out = scaled_dot_product_attention(x, x, x, scale=1.0)
    expected = torch.tensor(
        [[0.4656, 0.5592, 0.6688], [0.4765, 0.6358, 0.6469], [0.4765, 0.6358, 0.6469]]
    )
    torch.testing.assert_close(out[0], expected, atol=1e-3, rtol=0)


def test_notes_score_matrix_holds_every_query_key_dot_product():
    """T tokens give T² scores (2 → 4, 5 → 25): entry (i, j) is q_i · k_j, summed here in
    Python floats."""
    g = torch.Generator().manual_seed(0)
    for T in (2, 5):
        q, k = (torch.randn(1, 1, T, 4, generator=g, dtype=torch.float64) for _ in "qk")
        want = [
            [sum(a * b for a, b in zip(qi, kj)) for kj in k[0, 0].tolist()]
            for qi in q[0, 0].tolist()
        ]
        scores = attention_steps(q, k, k).scores[0, 0]
        assert scores.shape == (T, T)
        torch.testing.assert_close(scores, torch.tensor(want, dtype=torch.float64))


def test_causal_bottom_right_alignment():
    Tq, Tk = 2, 5
    q, k, v = torch.randn(1, 1, Tq, 4), torch.randn(1, 1, Tk, 4), torch.randn(1, 1, Tk, 4)
    s = attention_steps(q, k, v, causal=True)
    assert s.mask.tolist() == [[True, True, True, True, False], [True] * 5]
    # The last query sees every key: equal to unmasked attention for that row.
    full = scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(s.output[..., -1, :], full[..., -1, :])
    # Tq > Tk: the first queries see nothing and give zeros.
    out = scaled_dot_product_attention(
        torch.randn(1, 1, 5, 4), k[..., :2, :], v[..., :2, :], causal=True
    )
    assert torch.all(out[..., :3, :] == 0) and torch.all(out[..., 3:, :] != 0)


def test_sliding_window_sees_w_most_recent_keys():
    s = attention_steps(*(torch.randn(1, 1, 6, 2),) * 3, causal=True, window=3)
    assert s.mask.sum(-1).tolist() == [1, 2, 3, 3, 3, 3]
    assert s.mask[5].tolist() == [False, False, False, True, True, True]


def test_softcap_caps_before_masking():
    q, k, v = torch.randn(1, 2, 3, 4) * 10, torch.randn(1, 2, 3, 4) * 10, torch.randn(1, 2, 3, 4)
    s = attention_steps(q, k, v, softcap=5.0, causal=True)
    torch.testing.assert_close(s.scaled, 5.0 * torch.tanh(s.scores * s.scale / 5.0))
    assert s.scaled.abs().max() <= 5.0


def test_fully_masked_rows_zero_output_and_finite_grads():
    q, k, v = (torch.randn(2, 2, 3, 4, requires_grad=True) for _ in range(3))
    mask = torch.ones(2, 2, 3, 3, dtype=torch.bool)
    mask[0, 1, 2] = False  # one row sees nothing
    out, w = scaled_dot_product_attention(q, k, v, mask=mask, return_weights=True)
    assert torch.all(out[0, 1, 2] == 0) and torch.all(w[0, 1, 2] == 0)
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.all(q.grad[0, 1, 2] == 0)
    # Everything masked: all zeros, no NaN anywhere.
    out = scaled_dot_product_attention(q, k, v, mask=torch.zeros(3, 3, dtype=torch.bool))
    assert torch.all(out == 0)


def test_gqa_equals_repeated_heads():
    q, k, v = torch.randn(2, 6, 4, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 3)
    ours = scaled_dot_product_attention(q, k, v)
    rep = scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1))
    torch.testing.assert_close(ours, rep)
    torch.testing.assert_close(ours, TF.scaled_dot_product_attention(q, k, v, enable_gqa=True))


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_within_pytorch_own_error(causal):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32, generator=g, dtype=torch.float64) for _ in range(3))
    exact = scaled_dot_product_attention(q, k, v, causal=causal)
    ours = scaled_dot_product_attention(*(t.bfloat16() for t in (q, k, v)), causal=causal)
    theirs = TF.scaled_dot_product_attention(*(t.bfloat16() for t in (q, k, v)), is_causal=causal)
    assert ours.dtype == torch.bfloat16
    err_ours = (ours.double() - exact).abs().max()
    err_theirs = (theirs.double() - exact).abs().max()
    assert err_ours <= 2 * err_theirs + 1e-3


def test_weights_are_per_head_and_dropout_only_when_asked():
    q = k = v = torch.randn(1, 3, 4, 8)
    out, w = scaled_dot_product_attention(q, k, v, return_weights=True)
    x = q.double()
    want = torch.softmax(x @ x.transpose(-1, -2) / math.sqrt(8), -1)  # (1, 3, 4, 4): per head
    torch.testing.assert_close(w.double(), want, atol=1e-6, rtol=1e-5)
    torch.manual_seed(0)
    dropped = scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert not torch.allclose(dropped, out)


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(q=torch.randn(1, 2, 3, 4), k=torch.randn(1, 2, 3, 5)), ValueError, "d_k=4"),
        (dict(q=torch.randn(1, 3, 3, 4), k=torch.randn(1, 2, 3, 4)), ValueError, "h % h_kv"),
        (dict(q=torch.randn(1, 2, 3, 4).double()), TypeError, "share a dtype"),
        (dict(q=torch.randn(3, 4)), ValueError, "at least 3 dims"),
        (dict(mask=torch.ones(2, 3, dtype=torch.bool)), ValueError, "does not broadcast"),
        (dict(mask=torch.ones(1, 3)), TypeError, "bias="),
        (dict(mask=torch.ones(1, 3, dtype=torch.bool)[0]), ValueError, "qkv.masks.padding"),
        (dict(bias=torch.ones(1, 3, 3, dtype=torch.bool)), TypeError, "bias"),
        (dict(window=0), ValueError, "window"),
        (dict(dropout_p=1.5), ValueError, "dropout_p"),
        (dict(v=torch.randn(1, 2, 4, 4)), ValueError, "Tk=3"),
    ],
)
def test_bad_input_names_the_argument(kwargs, exc, words):
    args = dict(q=torch.randn(1, 2, 3, 4), k=torch.randn(1, 2, 3, 4), v=torch.randn(1, 2, 3, 4))
    args.update(kwargs)
    with pytest.raises(exc, match=words.replace("(", r"\(").replace("%", "%")):
        scaled_dot_product_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_key_padding_mask_of_batch_shape_is_not_broadcast_silently():
    # (B, Tk) with B == Tq would broadcast "fine" in PyTorch and be wrong; qkv refuses it.
    q = k = v = torch.randn(3, 2, 3, 4)
    with pytest.raises(ValueError, match="2-D"):
        scaled_dot_product_attention(q, k, v, mask=torch.ones(3, 3, 3, dtype=torch.bool)[0, None])
