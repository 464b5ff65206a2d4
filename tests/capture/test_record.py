"""capture(): recorded maps equal PyTorch's own per-head weights; decoding steps add up."""

import pytest
import torch
from torch import nn

from qkv import MultiHeadAttention
from qkv.inspect import capture, capture_steps, merge_steps, recording
from qkv.inspect.tiny import TinyEncoder, TinySeq2Seq


class TwoLayers(nn.Module):
    """Two qkv layers copied from nn.MultiheadAttention: self then cross."""

    def __init__(self, torch_layers):
        super().__init__()
        self.a = MultiHeadAttention.from_torch(torch_layers[0])
        self.b = MultiHeadAttention.from_torch(torch_layers[1])

    def forward(self, x, mem):
        return self.b(self.a(x, causal=True), context=mem)


def test_captured_weights_equal_torch_multihead_attention():
    torch.manual_seed(0)
    ta = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    tb = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    model = TwoLayers([ta, tb]).eval()
    x, mem = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    y_plain = model(x, mem)
    maps = capture(
        model, x, mem, tokens=list("abcde"), source_tokens=list("ABCDEFG"), batch_index=1
    )
    assert maps.layers == ["a", "b"] and maps.kinds == ["causal", "cross"]
    # PyTorch's own weights, per head (True = blocked in its convention)
    blocked = torch.ones(5, 5, dtype=torch.bool).triu(1)
    ya, wa = ta(x, x, x, attn_mask=blocked, average_attn_weights=False)
    _, wb = tb(ya, mem, mem, average_attn_weights=False)
    torch.testing.assert_close(maps.weights[0], wa[1], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(maps.weights[1], wb[1], atol=1e-6, rtol=1e-5)
    assert maps.q_tokens[1] == list("abcde") and maps.k_tokens[1] == list("ABCDEFG")
    # recording changes nothing: same output, recorder detached afterwards
    torch.testing.assert_close(model(x, mem), y_plain)
    assert model.a.recorder is None and model.b.recorder is None


def test_only_asked_layers_and_heads_are_kept():
    enc = TinyEncoder(n_heads=4, n_layers=3)
    toks, ids = enc.tokenize("the boy trains the puppy")
    full = capture(enc, ids, tokens=toks)
    part = capture(enc, ids, tokens=toks, layers=["encoder.layers.[02].*"], heads=[3, 1])
    assert part.layers == ["encoder.layers.0.self_attn", "encoder.layers.2.self_attn"]
    assert part.weights[0].shape == (2, len(toks), len(toks))
    torch.testing.assert_close(part.select("encoder.layers.2.self_attn", 1), full.select(2, 1))
    torch.testing.assert_close(part.weights[1][0], full.weights[2][3])
    assert full.tensor.shape == (3, 4, 7, 7)
    assert torch.allclose(full.tensor.sum(-1), torch.ones(3, 4, 7))
    with pytest.raises(KeyError, match="not captured"):
        part.select(0, 0)
    with pytest.raises(KeyError, match="no attention module matches"):
        capture(enc, ids, layers=["decoder.*"])
    with pytest.raises(ValueError, match="out of range"):
        capture(enc, ids, heads=[4])
    d = part.to_dict()
    assert d["layers"][0]["q_tokens"] == toks and len(d["layers"][0]["weights"]) == 2


def test_decoding_steps_over_kv_cache_rebuild_the_full_maps():
    model = TinySeq2Seq(n_heads=2)
    src = torch.tensor([[5, 17, 42, 9, 30, 8]])
    with recording(model) as rec:
        out = model.greedy(src, max_len=6)
    steps = rec.steps(tokens=[f"t{i}" for i in range(out.shape[1])])
    assert len(steps) == out.shape[1] - 1  # one decoder call per generated token
    assert steps[0].layers[0].startswith("encoder.")
    assert all(s.step == i for i, s in enumerate(steps))
    dec_self = [s.select("decoder.layers.1.self_attn", 0) for s in steps]
    assert [w.shape for w in dec_self] == [(1, i + 1) for i in range(len(steps))]
    # the same target, teacher-forced in one causal pass
    tgt = out[:, :-1]
    whole = capture(model, src, tgt)
    merged = merge_steps(steps)
    for name in (
        "decoder.layers.0.self_attn",
        "decoder.layers.1.cross_attn",
        "encoder.layers.1.self_attn",
    ):
        torch.testing.assert_close(
            merged.weights[merged.index(name)],
            whole.weights[whole.index(name)],
            atol=1e-5,
            rtol=1e-4,
        )
    assert merged.kinds[merged.index("decoder.layers.0.cross_attn")] == "cross"
    assert merged.q_tokens[merged.index("decoder.layers.0.self_attn")] == [
        f"t{i}" for i in range(6)
    ]
    via_capture = capture_steps(model, src, run=model.greedy, max_len=6)
    assert len(via_capture) == len(steps)
