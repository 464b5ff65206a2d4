"""PackedLinear / pack_linears (qkv/kernels/packed.py) against torch's F.linear."""

import pytest
import torch
import torch.nn.functional as TF
from torch import nn

from qkv.kernels._native import decode_ops
from qkv.kernels.packed import SMALL_ROWS, PackedLinear, pack_linears
from qkv.models import CausalLM, TransformerConfig

needs_kernels = pytest.mark.skipif(decode_ops() is None, reason="fused kernels not built")


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 37), (3, 37), (2, 5, 37), (12, 37), (SMALL_ROWS + 1, 37)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_equals_linear(shape, bias):
    torch.manual_seed(0)
    lin = nn.Linear(37, 130, bias=bias)  # 130: two full panels and a partial one
    packed = PackedLinear.from_linear(lin)
    x = torch.randn(*shape)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), TF.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        assert packed._panels is not None or shape[0] > SMALL_ROWS  # the packed path ran


@needs_kernels
def test_weight_change_rebuilds_panels_and_grad_uses_linear():
    lin = PackedLinear(16, 8)
    x = torch.randn(2, 16)
    with torch.no_grad():
        before = lin(x)
        lin.weight.mul_(2)  # in place: same storage, new version
        after = lin(x)
    torch.testing.assert_close(after - lin.bias, 2 * (before - lin.bias), rtol=1e-5, atol=1e-5)
    y = lin(x.requires_grad_())  # autograd: F.linear, gradients flow
    y.sum().backward()
    torch.testing.assert_close(lin.weight.grad, torch.ones(8, 2) @ x.detach())


@needs_kernels
def test_pack_linears_same_logits_and_state_dict():
    cfg = TransformerConfig(src_vocab_size=50, tgt_vocab_size=50, d_model=32, n_heads=4,
                            n_kv_heads=2, d_ff=64, n_encoder_layers=0, n_decoder_layers=2,
                            positional="rope", dropout=0.0)  # fmt: skip
    torch.manual_seed(0)
    lm = CausalLM(cfg).eval()
    packed = pack_linears(lm)
    assert all(type(m) is not nn.Linear for m in packed.modules())
    assert type(lm.out) is nn.Linear  # the original is left alone
    assert packed.state_dict().keys() == lm.state_dict().keys()
    ids = torch.randint(3, 50, (1, 9))
    with torch.no_grad():
        ref_cache, cache = lm.new_cache(capacity=16), packed.new_cache(capacity=16)
        torch.testing.assert_close(packed(ids, cache=cache), lm(ids, cache=ref_cache))
        tok = ids[:, -1:]
        for _ in range(4):  # decode steps: one row per linear, the packed path
            a, b = packed(tok, cache=cache), lm(tok, cache=ref_cache)
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
            tok = b[:, -1].argmax(-1, keepdim=True)


def test_pack_linears_rejects_bad_input():
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        pack_linears("not a model")
    with pytest.raises(ValueError, match="skip='nope' matches no nn.Linear"):
        pack_linears(nn.Sequential(nn.Linear(2, 2)), skip="nope")
    kept = pack_linears(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), skip="1")
    assert [type(m).__name__ for m in kept] == ["PackedLinear", "Linear"]
