"""The benchmark's CTranslate2 conversion (bench/_ct2.py) is exact: greedy tokens agree."""

import importlib.util
from pathlib import Path

import pytest
import torch

from qkv.generate import greedy_search
from qkv.models import Seq2SeqTransformer, TransformerConfig

ctranslate2 = pytest.importorskip(
    "ctranslate2", reason="ctranslate2 is not installed (pip install 'qkv[bench]')"
)

torch.set_num_threads(1)


def _converter():
    path = Path(__file__).resolve().parents[2] / "bench" / "_ct2.py"
    spec = importlib.util.spec_from_file_location("_ct2", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "kw",
    [
        dict(norm_first=True, positional="sinusoidal", share_src_tgt_embeddings=True),
        dict(norm_first=False, positional="learned", activation="gelu"),
    ],
)
def test_conversion_agrees_token_for_token(tmp_path, kw):
    ct2 = _converter()
    torch.manual_seed(0)
    cfg = TransformerConfig(src_vocab_size=60, tgt_vocab_size=60, d_model=32, n_heads=4,
                            d_ff=64, n_encoder_layers=2, n_decoder_layers=2, dropout=0.0,
                            max_len=64, **kw)  # fmt: skip
    model = Seq2SeqTransformer(cfg).eval()
    with torch.no_grad():  # larger weights than the init: confident, varied predictions
        for p in model.parameters():
            p.mul_(3.0)
    ct2.convert(model, tmp_path / "m")
    translator = ctranslate2.Translator(str(tmp_path / "m"), device="cpu",
                                        compute_type="float32", intra_threads=1)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    src = torch.randint(3, 60, (12, 9), generator=g)
    lengths = torch.randint(2, 10, (12,), generator=g)
    for i, n in enumerate(lengths.tolist()):
        src[i, n - 1], src[i, n:] = cfg.eos_id, cfg.pad_id
    vocab = ct2.vocabulary(cfg)
    ours = greedy_search(model, src, max_new_tokens=20, min_new_tokens=20)
    rows = [[t for t in r if t != cfg.pad_id] for r in src.tolist()]
    res = translator.translate_batch([ct2.tokens(r, vocab) for r in rows], beam_size=1,
                                     max_decoding_length=20, min_decoding_length=20)  # fmt: skip
    theirs = [[vocab.index(t) for t in r.hypotheses[0]] for r in res]
    assert ours.tolist() == theirs
    assert len({tuple(r) for r in theirs}) > 1  # not a degenerate constant output
