"""Corrupted model directories: every one is exactly one ModelLoadError naming the file.

Two tiny models are saved once (a qkv seq2seq directory and a HuggingFace-style BERT
directory); each case copies one, breaks one file, and loads it through the public loaders
(``qkv.translate.load_translator``, ``qkv.pretrained.load``) and through the CLI.
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qkv.pretrained as P
from qkv.apps.cli import main
from qkv.data import Tokenizer
from qkv.loading import ModelLoadError, inside, read_json, validate_safetensors
from qkv.models import Seq2SeqTransformer, TransformerConfig, save_pretrained
from qkv.pretrained.load import read_bert_config
from qkv.translate import load_translator

SENTENCES = ["the cat sat on the mat", "a dog runs in the park", "le chat est assis",
             "un chien court dans le parc"]  # fmt: skip


@pytest.fixture(scope="module")
def qkv_dir(tmp_path_factory):
    tok = Tokenizer.train(SENTENCES, vocab_size=300, min_frequency=1)
    cfg = TransformerConfig(src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size,
                            d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1,
                            n_decoder_layers=1, max_len=32)  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qkv") / "model"
    save_pretrained(Seq2SeqTransformer(cfg), path, tokenizer=tok)
    return path


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    cfg = P.BertConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_len=32)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("bert") / "model"
    P.save(P.BertModel(cfg), path)
    return path


def _copy(src, tmp_path):
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    return dst


def _set_json(name, value):
    def f(d):
        (d / name).write_text(value if isinstance(value, str) else json.dumps(value))

    return f


def _edit_config(fn):
    def f(d):
        data = json.loads((d / "config.json").read_text())
        fn(data)
        (d / "config.json").write_text(json.dumps(data))

    return f


def _truncate(name, keep):
    def f(d):
        data = (d / name).read_bytes()
        (d / name).write_bytes(data[: keep if keep >= 0 else len(data) + keep])

    return f


def _random_bytes(name, n=4096):
    def f(d):
        (d / name).write_bytes(os.urandom(n))

    return f


def _bad_offsets(d):
    p = d / "model.safetensors"
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"] = [0, 10**12]
    h = json.dumps(header).encode()
    p.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n :])


def _other_weights(d):  # a valid file whose tensors do not fit the config
    tok = Tokenizer.load(d)
    cfg = TransformerConfig(src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size,
                            d_model=8, n_heads=2, d_ff=16, n_encoder_layers=1,
                            n_decoder_layers=1, max_len=32)  # fmt: skip
    from safetensors.torch import save_model

    save_model(Seq2SeqTransformer(cfg), str(d / "model.safetensors"))


def _wrong_specials(d):
    Tokenizer.train(SENTENCES, vocab_size=300, min_frequency=1).hf.save(str(d / "tokenizer.json"))
    data = json.loads((d / "tokenizer.json").read_text())
    data["model"]["vocab"]["<pad>"], data["model"]["vocab"]["<s>"] = 1, 0
    data["added_tokens"] = []
    (d / "tokenizer.json").write_text(json.dumps(data))


QKV_CASES = {
    "safetensors truncated": (_truncate("model.safetensors", -100), "model.safetensors"),
    "safetensors 5 bytes": (_truncate("model.safetensors", 5), "model.safetensors"),
    "safetensors empty": (_truncate("model.safetensors", 0), "model.safetensors"),
    "safetensors random": (_random_bytes("model.safetensors"), "model.safetensors"),
    "safetensors offsets": (_bad_offsets, "model.safetensors"),
    "weights of another shape": (_other_weights, "model.safetensors"),
    "config list": (_set_json("config.json", [1, 2]), "config.json"),
    "config null": (_set_json("config.json", "null"), "config.json"),
    "config garbage": (_set_json("config.json", "{not json"), "config.json"),
    "config deep": (_set_json("config.json", "[" * 100_000), "config.json"),
    "config bad utf8": (
        lambda d: (d / "config.json").write_bytes(b'{"kind": "\xff"}'),
        "config.json",
    ),  # fmt: skip
    "config kind": (_edit_config(lambda c: c.update(kind="gpt")), "config.json"),
    "config.config list": (_edit_config(lambda c: c.update(config=[1])), "config.json"),
    "field str": (_edit_config(lambda c: c["config"].update(d_model="16")), "config.json"),
    "field float": (_edit_config(lambda c: c["config"].update(n_heads=2.5)), "config.json"),
    "field bool": (_edit_config(lambda c: c["config"].update(d_ff=True)), "config.json"),
    "dropout str": (_edit_config(lambda c: c["config"].update(dropout="0.1")), "config.json"),
    "heads zero": (_edit_config(lambda c: c["config"].update(n_heads=0)), "config.json"),
    "norm_first int": (_edit_config(lambda c: c["config"].update(norm_first=2)), "config.json"),
    "missing field": (_edit_config(lambda c: c["config"].pop("src_vocab_size")), "config.json"),
    "unknown field": (_edit_config(lambda c: c["config"].update(evil=1)), "config.json"),
    "tokenizer garbage": (_set_json("tokenizer.json", "garbage"), "tokenizer.json"),
    "tokenizer list": (_set_json("tokenizer.json", []), "tokenizer.json"),
    "tokenizer object": (_set_json("tokenizer.json", {"model": 3}), "tokenizer.json"),
    "tokenizer random": (_random_bytes("tokenizer.json"), "tokenizer.json"),
    "tokenizer specials": (_wrong_specials, "tokenizer.json"),
}


@pytest.mark.parametrize("case", sorted(QKV_CASES))
def test_broken_qkv_model_dir_is_one_model_load_error(case, qkv_dir, tmp_path):
    break_it, filename = QKV_CASES[case]
    d = _copy(qkv_dir, tmp_path)
    break_it(d)
    with pytest.raises(ModelLoadError) as e:
        load_translator(d)
    assert filename in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, ValueError) and e.value.path.name in (filename, d.name)


def _index(weight_map):
    return _set_json("model.safetensors.index.json", {"weight_map": weight_map})


def _shard_outside(d):
    os.replace(d / "model.safetensors", d.parent / "outside.safetensors")
    _index({"embeddings.word_embeddings.weight": "../outside.safetensors"})(d)


def _shard_absolute(d):
    os.replace(d / "model.safetensors", d.parent / "abs.safetensors")
    _index({"embeddings.word_embeddings.weight": str(d.parent / "abs.safetensors")})(d)


def _shard_symlink(d):
    os.replace(d / "model.safetensors", d.parent / "target.safetensors")
    os.symlink(d.parent / "target.safetensors", d / "link.safetensors")
    _index({"embeddings.word_embeddings.weight": "link.safetensors"})(d)


def _no_safetensors(fn):
    def f(d):
        (d / "model.safetensors").unlink()
        fn(d)

    return f


BERT_CASES = {
    "config list": (_set_json("config.json", []), "config.json"),
    "missing hidden_size": (_edit_config(lambda c: c.pop("hidden_size")), "config.json"),
    "heads str": (_edit_config(lambda c: c.update(num_attention_heads="2")), "config.json"),
    "heads zero": (_edit_config(lambda c: c.update(num_attention_heads=0)), "config.json"),
    "heads not dividing": (
        _edit_config(lambda c: c.update(num_attention_heads=3)),
        "config.json",
    ),  # fmt: skip
    "pad id outside": (_edit_config(lambda c: c.update(pad_token_id=999)), "config.json"),
    "model type": (_edit_config(lambda c: c.update(model_type="gpt2")), "config.json"),
    "activation": (_edit_config(lambda c: c.update(hidden_act="swish")), "config.json"),
    "dropout 2": (_edit_config(lambda c: c.update(hidden_dropout_prob=2)), "config.json"),
    "eps nan": (
        _set_json(
            "config.json",
            '{"vocab_size": 64, "hidden_size": 16, '
            '"num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32, '
            '"layer_norm_eps": NaN}',
        ),
        "config.json",
    ),  # fmt: skip
    "vocab smaller than weights": (
        _edit_config(lambda c: c.update(vocab_size=10)),
        "config.json",
    ),  # fmt: skip
    "safetensors truncated": (_truncate("model.safetensors", 1000), "model.safetensors"),
    "safetensors random": (_random_bytes("model.safetensors"), "model.safetensors"),
    "shard ../": (_shard_outside, "outside"),
    "shard absolute": (_shard_absolute, "outside"),
    "shard symlink out": (_shard_symlink, "outside"),
    "shard missing": (_no_safetensors(_index({"x": "nope.safetensors"})), "missing"),
    "index list": (
        _no_safetensors(_set_json("model.safetensors.index.json", [])),
        "model.safetensors.index.json",
    ),  # fmt: skip
    "index map of ints": (_no_safetensors(_index({"x": 3})), "weight_map"),
    "bin random": (_no_safetensors(_random_bytes("pytorch_model.bin")), "pytorch_model.bin"),
}


@pytest.mark.parametrize("case", sorted(BERT_CASES))
def test_broken_bert_dir_is_one_model_load_error(case, bert_dir, tmp_path):
    break_it, needle = BERT_CASES[case]
    d = _copy(bert_dir, tmp_path)
    break_it(d)
    with pytest.raises(ModelLoadError) as e:
        P.load(d)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_intact_models_still_load(qkv_dir, bert_dir):
    model, tok = load_translator(qkv_dir)
    assert tok.decode(tok.encode("the cat")) == "the cat"
    assert model.cfg.d_model == 16
    assert P.load(bert_dir).config.n_heads == 2


def test_inside_keeps_paths_in_the_directory(tmp_path):
    assert inside(tmp_path, "a/b.safetensors") == tmp_path / "a" / "b.safetensors"
    for name in ("../x", "/etc/passwd", "a/../../x", "", "..\\x"):
        with pytest.raises(ModelLoadError, match="outside|non-empty"):
            inside(tmp_path, name)


@pytest.mark.parametrize("case", ["safetensors random", "config list", "tokenizer garbage"])
def test_cli_reports_a_broken_model_in_one_line(case, qkv_dir, tmp_path, capsys, monkeypatch):
    break_it, filename = QKV_CASES[case]
    d = _copy(qkv_dir, tmp_path)
    break_it(d)
    monkeypatch.chdir(tmp_path)
    for argv in (["translate", "--model", str(d), "a cat"], ["view", "a cat", "--model", str(d)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"qkv {argv[0]}: error: ")
        assert filename in err and "Traceback" not in err
    assert not (tmp_path / "attention.html").exists()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),  # fmt: skip
    max_leaves=12,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=300))
def test_any_bytes_as_safetensors_is_one_error(data, tmp_path):
    p = tmp_path / "model.safetensors"
    p.write_bytes(data)
    with pytest.raises(ModelLoadError):
        validate_safetensors(p)
        from qkv.loading import read_safetensors

        if read_safetensors(p) == {}:  # an empty but valid file holds no weights
            raise ModelLoadError(p, "empty")


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(value=json_values)
def test_any_json_as_qkv_config_is_one_error(value, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(value))
    from qkv.models.io import load_config

    with pytest.raises(ModelLoadError):
        load_config(tmp_path)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(value=json_values)
def test_any_json_as_bert_config_or_tokenizer_is_one_error(value, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(value))
    (tmp_path / "tokenizer.json").write_text(json.dumps(value))
    with pytest.raises(ModelLoadError):
        read_bert_config(tmp_path / "config.json")
    with pytest.raises(ModelLoadError):
        Tokenizer.load(tmp_path)
    if isinstance(value, dict):
        assert read_json(tmp_path / "config.json") == value


@pytest.mark.parametrize("content", ["garbage", "[]", '{"model": 3}'])
def test_bert_dir_with_a_broken_tokenizer_is_one_cli_line(content, bert_dir, tmp_path, capsys,
                                                          monkeypatch):  # fmt: skip
    d = _copy(bert_dir, tmp_path)
    (d / "tokenizer.json").write_text(content)
    monkeypatch.chdir(tmp_path)
    assert main(["view", "a cat", "--model", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("qkv view: error: ") and "tokenizer" in err
    assert not (tmp_path / "attention.html").exists()
