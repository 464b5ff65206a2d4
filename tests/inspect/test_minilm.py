"""qkv.inspect on a real model: all-MiniLM-L6-v2, checked against HuggingFace transformers."""

from __future__ import annotations

import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing downloads

transformers = pytest.importorskip("transformers")

from qkv.apps.cli import main  # noqa: E402
from qkv.inspect import capture, pronoun_probe  # noqa: E402
from qkv.inspect.loaders import load  # noqa: E402

TIRED = "The animal didn't cross the street because it was tired."


@pytest.fixture(scope="module")
def loaded():
    return load("minilm")


@pytest.fixture(scope="module")
def hf(loaded):
    return transformers.BertModel.from_pretrained(
        str(loaded.model.source_dir), attn_implementation="eager", local_files_only=True
    ).eval()


def test_encode_gives_wordpieces_with_specials(loaded):
    tokens, (ids, mask) = loaded.encode(TIRED)
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]"
    assert ["animal", "street", "it"] == [t for t in tokens if t in ("animal", "street", "it")]
    assert ids.shape == mask.shape == (1, len(tokens)) and bool(mask.all())
    # the tokenizer's own ids, read back through HF's vocabulary
    assert loaded.model.tokenizer.convert_tokens_to_ids(tokens) == ids[0].tolist()
    assert loaded.hidden(ids, mask).shape == (1, len(tokens), 384)


@pytest.mark.parametrize("text", [TIRED, "Hi <script>alert(1)</script> — naïve café, 東京!"])
def test_captured_maps_equal_hf_output_attentions(loaded, hf, text):
    tokens, (ids, mask) = loaded.encode(text)
    maps = capture(loaded.model, ids, mask, tokens=tokens)
    assert maps.layers == [f"encoder.layers.{i}.self_attn" for i in range(6)]
    assert set(maps.kinds) == {"self"} and all(h == list(range(12)) for h in maps.heads)
    assert maps.q_tokens[0] == maps.k_tokens[5] == tokens
    with torch.no_grad():
        want = torch.stack(hf(ids, attention_mask=mask, output_attentions=True).attentions)
    got = maps.tensor  # (L=6, H=12, T, T)
    assert got.shape == (6, 12, len(tokens), len(tokens)) == want[:, 0].shape
    torch.testing.assert_close(got, want[:, 0], atol=1e-5, rtol=0)
    # and the model's own output_attentions path agrees with the recorder
    with torch.no_grad():
        own = torch.stack(loaded.model(ids, mask, output_attentions=True).attentions)
    torch.testing.assert_close(got, own[:, 0], atol=1e-6, rtol=0)


def test_only_asked_heads_are_kept_and_equal_hf(loaded, hf):
    tokens, (ids, mask) = loaded.encode(TIRED)
    maps = capture(loaded.model, ids, mask, tokens=tokens, layers=[3, 5], heads=[1, 11])
    assert maps.layers == ["encoder.layers.3.self_attn", "encoder.layers.5.self_attn"]
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, output_attentions=True).attentions
    for i, layer in enumerate((3, 5)):
        torch.testing.assert_close(maps.weights[i], want[layer][0, [1, 11]], atol=1e-5, rtol=0)


def test_pronoun_probe_ranks_all_72_heads(loaded, hf):
    tokens, (ids, mask) = loaded.encode(TIRED)
    rows = pronoun_probe(capture(loaded.model, ids, mask, tokens=tokens), "it",
                         ["animal", "street"])  # fmt: skip
    assert len(rows) == 72 and len({(r.layer, r.head) for r in rows}) == 72
    best = [r.scores[r.best] for r in rows]
    assert best == sorted(best, reverse=True)
    # the scores are HF's attention weights from "it" to each candidate
    with torch.no_grad():
        att = hf(ids, attention_mask=mask, output_attentions=True).attentions
    it, animal, street = (tokens.index(w) for w in ("it", "animal", "street"))
    for r in rows:
        layer = int(r.layer.split(".")[2])
        assert r.scores["animal"] == pytest.approx(float(att[layer][0, r.head, it, animal]),
                                                   abs=1e-5)  # fmt: skip
        assert r.scores["street"] == pytest.approx(float(att[layer][0, r.head, it, street]),
                                                   abs=1e-5)  # fmt: skip


def test_cli_heads_minilm(capsys):
    argv = ["heads", TIRED, "--model", "minilm", "--token", "it", "--candidates", "animal",
            "street", "--top", "5"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "where does 'it' look? (top 5 of 72 heads)" in out
    assert "encoder.layers." in out and "animal" in out and "street" in out
    line = next(x for x in out.splitlines() if x.startswith("heads preferring each candidate"))
    counts = [int(x.split(":")[1]) for x in line.split(": ", 1)[1].split(", ")]
    assert sum(counts) == 72
    assert main([*argv, "--ablate", "3:1", "5:11"]) == 0
    out = capsys.readouterr().out
    assert "cos(it,animal) − cos(it,street)" in out and "off (Δ" in out


def test_bert_directory_opens_as_model_dir(loaded, tmp_path):
    d = loaded.model.source_dir
    other = load(str(d))  # --model DIR: any HuggingFace BERT directory
    assert other.name == str(d) and other.encode(TIRED)[0] == loaded.encode(TIRED)[0]
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')  # not BERT: not ours
    with pytest.raises(ValueError, match="no loader recognises"):
        load(str(tmp_path))
