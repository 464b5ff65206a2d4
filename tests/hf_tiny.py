"""Tiny transformers models built from small configs (no downloads), shared by the HF tests."""

import torch
import transformers


def llama(vocab: int, positions: int = 128):
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def bert(vocab: int):
    cfg = transformers.BertConfig(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.BertModel(cfg)


def marian(vocab: int):
    cfg = transformers.MarianConfig(
        vocab_size=vocab, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
        decoder_ffn_dim=48, max_position_embeddings=64, pad_token_id=0,
        decoder_start_token_id=0, eos_token_id=2, forced_eos_token_id=None,
    )  # fmt: skip
    return transformers.MarianMTModel(cfg)


def gpt_oss(vocab: int):
    """gpt-oss (attention sinks, sliding windows, experts), in eval mode, its sinks drawn far
    from 0 so that they matter."""
    cfg = transformers.GptOssConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64, pad_token_id=0,
        eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "sinks"):
                m.sinks.copy_(torch.randn(m.sinks.shape, generator=torch.Generator().manual_seed(3)))
    return model
