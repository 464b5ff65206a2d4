"""qkv.models against torch.nn.Transformer layers, KV-cached decoding, save/load."""

import json

import pytest
import torch
from torch import nn

from qkv import MultiHeadAttention
from qkv.models import (
    CausalLM,
    DecoderLayer,
    EncoderLayer,
    Seq2SeqTransformer,
    TransformerConfig,
    load_pretrained,
    save_pretrained,
)

# Tiny models: extra threads only add synchronisation on this shared 2-core machine.
torch.set_num_threads(1)


def cfg_(**kw) -> TransformerConfig:
    base = dict(src_vocab_size=40, tgt_vocab_size=40, d_model=32, n_heads=4, d_ff=64, dropout=0.0)
    return TransformerConfig(**{**base, **kw})


def copy_norm(ours: nn.LayerNorm, theirs: nn.LayerNorm) -> None:
    ours.load_state_dict(theirs.state_dict())


def copy_ffn(ours, theirs) -> None:
    ours.ffn.w_1.load_state_dict(theirs.linear1.state_dict())
    ours.ffn.w_2.load_state_dict(theirs.linear2.state_dict())


@pytest.mark.parametrize("norm_first", [True, False])
def test_encoder_layer_equals_torch(norm_first):
    torch.manual_seed(0)
    theirs = nn.TransformerEncoderLayer(
        32, 4, 64, dropout=0.0, batch_first=True, norm_first=norm_first
    ).eval()
    ours = EncoderLayer(cfg_(norm_first=norm_first)).eval()
    ours.self_attn.load_state_dict(MultiHeadAttention.from_torch(theirs.self_attn).state_dict())
    copy_ffn(ours, theirs)
    copy_norm(ours.res_attn.norm, theirs.norm1)
    copy_norm(ours.res_ffn.norm, theirs.norm2)
    x = torch.randn(3, 7, 32)
    lengths = torch.tensor([7, 4, 2])
    pad = torch.arange(7)[None, :] >= lengths[:, None]  # torch: True = padding
    ref = theirs(x, src_key_padding_mask=pad)
    out = ours(x, (~pad)[:, None, None, :])  # qkv: True = may attend
    keep = ~pad  # torch's fast path may zero padded rows; compare real tokens
    torch.testing.assert_close(out[keep], ref[keep], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_first", [True, False])
def test_decoder_layer_equals_torch(norm_first):
    torch.manual_seed(1)
    theirs = nn.TransformerDecoderLayer(
        32, 4, 64, dropout=0.0, batch_first=True, norm_first=norm_first
    ).eval()
    ours = DecoderLayer(cfg_(norm_first=norm_first)).eval()
    ours.self_attn.load_state_dict(MultiHeadAttention.from_torch(theirs.self_attn).state_dict())
    ours.cross_attn.load_state_dict(
        MultiHeadAttention.from_torch(theirs.multihead_attn).state_dict()
    )
    copy_ffn(ours, theirs)
    for mine, ref_norm in zip((ours.res_self, ours.res_cross, ours.res_ffn), (1, 2, 3)):
        copy_norm(mine.norm, getattr(theirs, f"norm{ref_norm}"))
    x, memory = torch.randn(2, 6, 32), torch.randn(2, 9, 32)
    mem_pad = torch.arange(9)[None, :] >= torch.tensor([9, 5])[:, None]
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    ref = theirs(x, memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=mem_pad)
    out = ours(x, memory, (~mem_pad)[:, None, None, :])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("positional", ["sinusoidal", "learned", "rope"])
@pytest.mark.parametrize("norm_first", [True, False])
def test_cached_decoding_equals_full_decoding(positional, norm_first):
    torch.manual_seed(2)
    model = Seq2SeqTransformer(cfg_(positional=positional, norm_first=norm_first, n_kv_heads=2))
    model.eval()
    src = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, 0, 0]])
    tgt = torch.tensor([[1, 11, 12, 13, 14], [1, 15, 16, 17, 18]])
    mask = model.src_mask(src)
    full = model(src, tgt)  # (B, T, V)
    memory, cache = model.encode(src, mask), model.new_cache()
    steps = [model.decode(tgt[:, t : t + 1], memory, mask, cache=cache) for t in range(5)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    assert len(cache) == 5 and len(cache.cross_attn[0]) == 5  # memory projected once (S=5)


def test_causal_lm_cache_and_causality():
    torch.manual_seed(3)
    lm = CausalLM(cfg_(positional="rope")).eval()
    ids = torch.tensor([[1, 4, 5, 6, 7]])
    full = lm(ids)
    cache = lm.new_cache()
    steps = torch.cat([lm(ids[:, t : t + 1], cache=cache) for t in range(5)], 1)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)
    changed = ids.clone()
    changed[0, -1] = 9  # the future never leaks into earlier positions
    torch.testing.assert_close(lm(changed)[:, :-1], full[:, :-1])


def test_padding_does_not_change_real_outputs():
    torch.manual_seed(4)
    model = Seq2SeqTransformer(cfg_()).eval()
    src, tgt = torch.tensor([[5, 6, 7, 2]]), torch.tensor([[1, 8, 9]])
    padded = torch.tensor([[5, 6, 7, 2, 0, 0, 0]])
    torch.testing.assert_close(model(padded, tgt), model(src, tgt), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["seq2seq", "causal_lm"])
def test_save_load_identical_logits(tmp_path, kind):
    torch.manual_seed(5)
    cfg = cfg_(share_src_tgt_embeddings=True, positional="learned")
    model = (Seq2SeqTransformer if kind == "seq2seq" else CausalLM)(cfg).eval()
    save_pretrained(model, tmp_path / "m")
    files = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert files == ["config.json", "model.safetensors"]  # JSON + safetensors, no pickle
    loaded = load_pretrained(tmp_path / "m")
    assert type(loaded) is type(model) and loaded.cfg == cfg
    ids = torch.tensor([[1, 5, 6, 7]])
    out, ref = (
        (loaded(ids, ids), model(ids, ids)) if kind == "seq2seq" else (loaded(ids), model(ids))
    )
    assert torch.equal(out, ref)
    if kind == "seq2seq":  # tied weights stay tied after loading
        assert loaded.decoder.out.weight is loaded.encoder.embed.embedding.weight


def test_failed_save_keeps_previous_model(tmp_path):
    model = Seq2SeqTransformer(cfg_()).eval()
    save_pretrained(model, tmp_path / "m")
    before = (tmp_path / "m" / "model.safetensors").read_bytes()

    def boom(path):
        raise RuntimeError("disk full")

    with torch.no_grad():
        model.decoder.out.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="disk full"):
        save_pretrained(model, tmp_path / "m", extra={"state": boom})
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp dirs left behind


def test_config_validation_and_json_round_trip():
    cfg = cfg_(n_kv_heads=2, positional="rope")
    assert TransformerConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="d_model must be divisible by n_heads"):
        cfg_(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        cfg_(n_kv_heads=3)
    with pytest.raises(ValueError, match="positional must be one of"):
        cfg_(positional="alibi")
    with pytest.raises(ValueError, match="dropout"):
        cfg_(dropout=1.5)
    with pytest.raises(ValueError, match="share_src_tgt_embeddings"):
        cfg_(tgt_vocab_size=50, share_src_tgt_embeddings=True)
    with pytest.raises(ValueError, match="unknown TransformerConfig fields"):
        TransformerConfig.from_json(json.dumps({**json.loads(cfg.to_json()), "bogus": 1}))
    with pytest.raises(dataclasses_error()):
        cfg.d_model = 64  # frozen


def dataclasses_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_bad_inputs():
    model = Seq2SeqTransformer(cfg_()).eval()
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 40\)"):
        model(torch.tensor([[1, 99]]), torch.tensor([[1]]))
    with pytest.raises(TypeError, match="integer tensor"):
        model(torch.randn(1, 3), torch.tensor([[1]]))
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_pretrained("/nonexistent/model")
