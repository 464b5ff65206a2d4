"""Weights stored as int8 rows (qkv.models.int8_rows): each element within half a step of its
row's scale, tied weights stored once and tied again, bad files refused, a shipped translator
saying the same after the round trip."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qkv.loading import ModelLoadError
from qkv.models import (
    CausalLM,
    Seq2SeqTransformer,
    TransformerConfig,
    load_pretrained,
    save_pretrained,
)
from qkv.models.int8_rows import SCALE, STORAGE_KEY

torch.set_num_threads(1)


def tiny(kind=Seq2SeqTransformer, **kw):
    torch.manual_seed(0)
    cfg = TransformerConfig(src_vocab_size=50, tgt_vocab_size=50, d_model=32, n_heads=4,
                            d_ff=64, dropout=0.0, **kw)  # fmt: skip
    model = kind(cfg).eval()
    with torch.no_grad():  # one row of zeros: its scale is 0, its values stay 0
        next(p for p in model.parameters() if p.dim() == 2)[3].zero_()
    return model


@pytest.mark.parametrize("kind", [Seq2SeqTransformer, CausalLM])
@pytest.mark.parametrize("tie", [True, False])
def test_round_trip_within_half_a_step(tmp_path, kind, tie):
    model = tiny(kind, tie_embeddings=tie)
    save_pretrained(model, tmp_path / "m", storage="int8-rows")
    loaded = load_pretrained(tmp_path / "m")
    stored = load_file(str(tmp_path / "m" / "model.safetensors"))
    ours = dict(loaded.named_parameters(remove_duplicate=False))
    for name, p in model.named_parameters(remove_duplicate=False):
        got = ours[name].detach()
        if p.dim() == 2:  # max |row| / 127 per row, computed here in fp64; then float16
            amax = p.detach().double().abs().amax(dim=1, keepdim=True)
            err = (got.double() - p.detach().double()).abs()
            assert (err <= amax / 254 + amax * 2.0**-11).all(), name
            assert torch.equal(got.half().float(), got), name  # float16 numbers
        else:  # float16
            torch.testing.assert_close(got, p.detach().half().float(), rtol=0, atol=0)
    # a tied matrix once in the file (tied: the embedding and the output projection)
    matrices = [n for n, p in model.named_parameters(remove_duplicate=False) if p.dim() == 2]
    int8 = [n for n in stored if stored[n].dtype == torch.int8]
    assert len(int8) == len(matrices) - (1 if tie else 0)
    assert all(n + SCALE in stored for n in int8)
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        assert f.metadata()[STORAGE_KEY] == "int8-rows"


def test_smaller_and_same_outputs(tmp_path):
    model = tiny()
    save_pretrained(model.half(), tmp_path / "half")
    save_pretrained(model.float(), tmp_path / "q", storage="int8-rows")
    half = (tmp_path / "half" / "model.safetensors").stat().st_size
    q = (tmp_path / "q" / "model.safetensors").stat().st_size
    assert q < 0.7 * half
    src = torch.randint(4, 50, (2, 7))
    tgt = torch.randint(4, 50, (2, 5))
    want = load_pretrained(tmp_path / "half")(src, tgt)
    got = load_pretrained(tmp_path / "q")(src, tgt)
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_bad_files_are_refused(tmp_path):
    model = tiny()
    save_pretrained(model, tmp_path / "m", storage="int8-rows")
    path = tmp_path / "m" / "model.safetensors"
    good = load_file(str(path))
    meta = {"format": "pt", STORAGE_KEY: "int8-rows"}
    name = next(n for n in good if n.endswith(SCALE))[: -len(SCALE)]
    for what, tensors in (
        ("no scale per row", {k: v for k, v in good.items() if k != name + SCALE}),
        ("is missing", {k: v for k, v in good.items() if k != name}),
        ("unexpected", {**good, "extra.weight": torch.zeros(2)}),
    ):
        save_file(tensors, str(path), metadata=meta)
        with pytest.raises(ModelLoadError, match=what):
            load_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="storage must be"):
        save_pretrained(model, tmp_path / "n", storage="int4")


def test_shipped_translator_says_the_same(tmp_path):
    """The notes' sentence through en-fr, stored as int8 rows and loaded back."""
    import shutil

    from qkv.data import Tokenizer
    from qkv.models.shipped import HERE
    from qkv.translate import load

    src = HERE / "en-fr"
    save_pretrained(load_pretrained(src), tmp_path / "en-fr", storage="int8-rows",
                    tokenizer=Tokenizer.load(src / "tokenizer.json"))  # fmt: skip
    shutil.copy(src / "generation.json", tmp_path / "en-fr")
    sentence = "The boy trains the puppy."
    assert load(tmp_path / "en-fr")(sentence) == load("en-fr")(sentence)
