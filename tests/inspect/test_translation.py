"""Inspecting a saved translation model: per-step maps while decoding, loader, CLI, BLEU ablation.

References: nn.MultiheadAttention's per-head weights (PyTorch), sacreBLEU, the model's own
teacher-forced forward pass.
"""

import pytest
import sacrebleu
import torch
from torch import nn

from qkv.apps.cli import main
from qkv.data import Tokenizer
from qkv.generate import beam_search, greedy_search, translate
from qkv.inspect import ablate, capture, heads_off, merge_steps
from qkv.inspect.loaders import load
from qkv.inspect.translation import bleu_metric, piece_labels, record_translation
from qkv.models import CausalLM, Seq2SeqTransformer, TransformerConfig, save_pretrained

SENTS = ["a dog runs", "the boy trains the puppy", "le chien court", "le garçon entraîne le chiot"]
TEXT = "the boy trains the puppy"


def _saved(tmp_path, kind=Seq2SeqTransformer, seed=0):
    tok = Tokenizer.train(SENTS * 10, vocab_size=340)
    torch.manual_seed(seed)
    cfg = TransformerConfig(src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size,
                            d_model=32, n_heads=4, d_ff=64, dropout=0.0, n_encoder_layers=2,
                            n_decoder_layers=2)  # fmt: skip
    model = kind(cfg)
    if kind is Seq2SeqTransformer:  # a few steps on two pairs: real words come out
        _fit(model, tok)
    model.eval()
    path = save_pretrained(model, tmp_path / kind.__name__, tokenizer=tok)
    return path, model, tok


def _fit(model, tok, steps=120):
    pairs = [(SENTS[0], SENTS[2]), (SENTS[1], SENTS[3])]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        for s, t in pairs:
            src = torch.tensor([tok.encode(s) + [2]])
            tgt = torch.tensor([[1, *tok.encode(t), 2]])
            logits = model(src, tgt[:, :-1])  # (1, T, V)
            loss = nn.functional.cross_entropy(logits[0], tgt[0, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()


def _torch_mha_weights(mha, x, context):
    """Per-head weights ``(B, h, Tq, Tk)`` from PyTorch's nn.MultiheadAttention, same weights."""
    ref = nn.MultiheadAttention(mha.d_model, mha.n_heads, batch_first=True, bias=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([mha.w_q.weight, mha.w_k.weight, mha.w_v.weight]))
        for i, lin in enumerate((mha.w_q, mha.w_k, mha.w_v)):
            b = lin.bias if lin.bias is not None else torch.zeros(mha.d_model)
            ref.in_proj_bias[i * mha.d_model : (i + 1) * mha.d_model].copy_(b)
    _, w = ref(x, context, context, need_weights=True, average_attn_weights=False)
    return w


def test_cached_greedy_maps_merge_to_teacher_forced_maps(tmp_path):
    path, model, tok = _saved(tmp_path)
    hyp, steps, beams = record_translation(model, tok, TEXT)
    assert beams == []  # greedy: no beam hypotheses
    assert len(steps) == len(hyp) > 1
    assert all(m.step == s for s, m in enumerate(steps))
    # step 0: every encoder layer + the first decoder call; later steps: the decoder only
    assert [k for k in steps[0].kinds].count("self") == 2
    assert set(steps[1].kinds) == {"causal", "cross"}
    assert all(w.shape[1] == 1 for w in steps[1].weights)  # one query per step (KV cache)
    merged = merge_steps(steps)

    src = torch.tensor([tok.encode(TEXT) + [tok.eos_id]])  # (1, S)
    tgt_in = torch.tensor([[model.cfg.bos_id, *hyp[:-1]]])  # (1, T)
    inputs = {}
    layer = model.decoder.layers[-1].cross_attn
    hook = layer.register_forward_pre_hook(
        lambda m, a, kw: inputs.update(x=a[0], ctx=a[1]), with_kwargs=True
    )
    full = capture(model, src, tgt_in)  # teacher forcing, one pass, no cache
    hook.remove()
    assert merged.layers == full.layers
    for got, want in zip(merged.weights, full.weights):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    cross = full.index("decoder.layers.1.cross_attn")
    assert merged.weights[cross].shape == (4, len(hyp), src.shape[1])
    want = _torch_mha_weights(layer, inputs["x"], inputs["ctx"])[0]  # (h, T, S)
    torch.testing.assert_close(merged.weights[cross], want, atol=1e-5, rtol=1e-4)
    # labels: source pieces on the keys; cross rows = the produced tokens, self rows = inputs
    src_labels = piece_labels(tok, src[0].tolist())
    assert merged.k_tokens[cross] == src_labels and src_labels[:2] == ["the", "boy"]
    assert merged.q_tokens[cross] == piece_labels(tok, hyp)
    causal = full.index("decoder.layers.1.self_attn")
    assert merged.q_tokens[causal] == piece_labels(tok, tgt_in[0].tolist())


def test_loader_round_trip_and_beam(tmp_path):
    path, model, tok = _saved(tmp_path)
    loaded = load(str(path))
    for a, b in zip(loaded.model.state_dict().values(), model.encoder.state_dict().values()):
        torch.testing.assert_close(a, b)
    tokens, inputs = loaded.encode(TEXT)
    assert tokens == ["the", "boy", "trains", "the", "puppy", "</s>"]
    enc = capture(loaded.model, *inputs, tokens=tokens)
    assert set(enc.kinds) == {"self"} and enc.weights[0].shape == (4, 6, 6)
    assert enc.layers == ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    # greedy maps end in the translation generate.translate produces
    steps = loaded.translate(TEXT)
    hyp = greedy_search(model, inputs[0])[0]
    assert len(steps) == int((hyp != 0).sum())
    # beam: the winning hypothesis is replayed; its tokens are beam_search's
    b_hyp, b_steps, b_beams = record_translation(model, tok, TEXT, beam=3)
    want = [t for t in beam_search(model, inputs[0], beam_size=3)[0].tolist() if t != 0]
    assert b_hyp == want and len(b_steps) == len(want)
    assert merge_steps(b_steps).q_tokens[-1] == piece_labels(tok, want)
    # every hypothesis beam search kept, best first: the first is the one chosen, and the
    # scores are what beam search ranks by, recomputed here from the model's own log-probs
    assert 1 <= len(b_beams) <= 3 and b_beams[0][0] == b_hyp
    assert [s for _, s in b_beams] == sorted((s for _, s in b_beams), reverse=True)
    for ids, score in b_beams:
        tgt = torch.tensor([[model.cfg.bos_id, *ids[:-1]]])
        logp = model(inputs[0], tgt).log_softmax(-1)[0]  # (T, V)
        total = float(logp.gather(1, torch.tensor(ids)[:, None]).sum())
        assert abs(score - total / len(ids)) < 1e-4  # length penalty 1.0
    # a training run directory (holding best/) opens too; a causal LM shows causal maps
    lm_path, lm, _ = _saved(tmp_path / "run" / "best", CausalLM)
    lm_loaded = load(str(lm_path))
    toks, lm_inputs = lm_loaded.encode(TEXT)
    assert toks[0] == "<s>" and lm_loaded.translate is None
    lm_maps = capture(lm_loaded.model, *lm_inputs, tokens=toks)
    assert set(lm_maps.kinds) == {"causal"} and lm_maps.weights[0].shape == (4, 6, 6)
    assert torch.all(lm_maps.weights[0].triu(1) == 0)


def test_cli_view_translate_writes_alignment_page_and_png(tmp_path, capsys):
    path, model, tok = _saved(tmp_path)
    out, png = tmp_path / "page.html", tmp_path / "align.png"
    argv = ["view", "--model", str(path), "--translate", TEXT, "--out", str(out), "--png", str(png)]
    assert main(argv) == 0
    html = out.read_text()
    assert "decoder.layers.1.cross_attn" in html and '"puppy"' in html
    for p in (png, tmp_path / "align-alignment.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([*argv, "--beam", "2"]) == 0
    assert main(["view", TEXT, "--model", str(path), "--out", str(tmp_path / "enc.html")]) == 0
    assert '"self"' in (tmp_path / "enc.html").read_text()


def test_ablation_bleu_matches_heads_off_and_sacrebleu(tmp_path, capsys):
    path, model, tok = _saved(tmp_path)
    srcs, refs = [SENTS[0], SENTS[1]], ["le chien court", "le garçon"]
    metric = bleu_metric(str(path), srcs, refs)
    hyps = translate(model, tok, srcs)
    assert metric(model) == sacrebleu.corpus_bleu(hyps, [refs]).score
    assert hyps == [SENTS[2], SENTS[3]]  # the tiny model learnt its two pairs
    assert bleu_metric(model, srcs, hyps, tok)(model) == pytest.approx(100.0)
    loaded = load(str(path))
    assert bleu_metric(loaded, srcs, refs)(loaded.full_model) == metric(model)
    spec = {"decoder.layers.*.cross_attn": [0, 1, 2, 3]}  # every cross head: blind to the source
    r = ablate(model, spec, bleu_metric(model, srcs, hyps, tok))
    with heads_off(model, spec):
        off_hyps = translate(model, tok, srcs)
        src = torch.tensor([tok.encode(srcs[1]) + [2]])
        off_logits = model(src, torch.tensor([[1, 5, 6]]))
    assert off_hyps[0] == off_hyps[1] and off_hyps != hyps  # same output for both sources...
    assert r.ablated == sacrebleu.corpus_bleu(off_hyps, [hyps]).score < 100.0  # ...and BLEU
    assert r.baseline == pytest.approx(100.0) and r.delta == r.ablated - r.baseline
    assert not torch.allclose(off_logits, model(src, torch.tensor([[1, 5, 6]])))
    assert translate(model, tok, srcs) == hyps  # restored
    # the CLI: BLEU on a (tiny) Multi30k-style split
    data = tmp_path / "data"
    data.mkdir()
    (data / "val.en").write_text("\n".join(srcs) + "\n")
    (data / "val.fr").write_text("\n".join(hyps) + "\n")
    argv = ["heads", "--model", str(path), "--data-split", "val", "--data", str(data), "--n", "2"]
    assert main([*argv, "--ablate", "decoder.layers.*.cross_attn:0,1,2,3"]) == 0
    assert f"100.00 → {r.ablated:.2f}" in capsys.readouterr().out
    assert main([*argv, "--ablate", "--layers", "decoder.layers.1.cross_attn"]) == 0
    assert "one head off at a time" in capsys.readouterr().out
