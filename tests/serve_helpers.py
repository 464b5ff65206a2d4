"""Shared fixtures of the ``qkv serve`` tests: a tiny saved translator and a registry."""

from __future__ import annotations

from pathlib import Path

import torch

from qkv.data import Tokenizer
from qkv.models import Seq2SeqTransformer, TransformerConfig, save_pretrained
from qkv.serve.models import Registry, default_registry

SENTS = ["a dog runs", "the boy trains the puppy", "le chien court", "le garçon entraîne le chiot"]


def tiny_translator(directory: Path) -> Path:
    """A small seq2seq model fitted for a few steps on two pairs, saved with its tokenizer."""
    tok = Tokenizer.train(SENTS * 10, vocab_size=340)
    torch.manual_seed(0)
    cfg = TransformerConfig(src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size,
                            d_model=32, n_heads=4, d_ff=64, dropout=0.0, n_encoder_layers=2,
                            n_decoder_layers=2)  # fmt: skip
    model = Seq2SeqTransformer(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    pairs = [(SENTS[0], SENTS[2]), (SENTS[1], SENTS[3])]
    for _ in range(60):
        for s, t in pairs:
            src = torch.tensor([tok.encode(s) + [2]])
            tgt = torch.tensor([[1, *tok.encode(t), 2]])
            logits = model(src, tgt[:, :-1])  # (1, T, V)
            loss = torch.nn.functional.cross_entropy(logits[0], tgt[0, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    return save_pretrained(model, directory, tokenizer=tok)


def registry(tmp: Path, *, minilm: bool = True) -> Registry:
    reg = default_registry({"tiny-fr": str(tiny_translator(tmp / "tiny-fr"))})
    if not minilm:
        reg._entries.pop("minilm")
    return reg
