"""``qkv serve`` on transformers encoder-decoders: beam search, and the step-by-step view of
calls the adapter hands back to transformers.

Tiny random Marian, T5 and BART models (and a Llama for the decoder-only cases) are saved
with the word-level tokenizer of ``test_hf_models`` into temporary directories; nothing
downloads. The server's beams must be transformers' own ``generate(num_beams=4)`` run with
its "eager" attention: the same hypotheses in the same order with the same scores, the best
one as the translation, its maps equal to eager's teacher-forced ``output_attentions``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing downloads
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("starlette")
pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402

import hf_tiny  # noqa: E402
from qkv.apps.serve.app import create_app  # noqa: E402
from qkv.apps.serve.limits import target_limit  # noqa: E402
from qkv.apps.serve.models import default_registry  # noqa: E402
from qkv.functional import attention_steps  # noqa: E402
from qkv.hf import attention as qattn  # noqa: E402
from qkv.inspect.loaders import load  # noqa: E402
from serve_helpers import chromium, one_thread, open_page, running_server  # noqa: E402
from test_hf_models import TEXT, V, _check_step, _tokenizer  # noqa: E402

BEAM = 4
SEQ2SEQ = ("marian", "t5", "bart")


def _t5():
    cfg = transformers.T5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, pad_token_id=0,
        eos_token_id=2, decoder_start_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(cfg)


def _bart():
    cfg = transformers.BartConfig(
        vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=2, forced_bos_token_id=None, forced_eos_token_id=None,
    )  # fmt: skip
    return transformers.BartForConditionalGeneration(cfg)


def _marian():
    """Marian with larger random weights (init_std 0.1) than hf_tiny's: sharper scores, so
    that no two hypotheses tie."""
    cfg = transformers.MarianConfig(
        vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
        max_position_embeddings=64, pad_token_id=0, decoder_start_token_id=0, eos_token_id=2,
        forced_eos_token_id=None, init_std=0.1,
    )  # fmt: skip
    return transformers.MarianMTModel(cfg)


# (builder, seed). Random weights: Marian's beams (seed 0) end at different lengths, two
# with the end token and padding after it in transformers' output, two at the length limit;
# T5's and BART's all run to the limit; "opus" (Marian, seed 4) writes words, for the page
BUILDERS = {"marian": (_marian, 0), "t5": (_t5, 0), "bart": (_bart, 0),
            "llama": (lambda: hf_tiny.llama(V), 0), "opus": (_marian, 4)}  # fmt: skip


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfbeam")
    out = {}
    for name, (build, seed) in BUILDERS.items():
        torch.manual_seed(seed)
        build().eval().save_pretrained(root / name)
        _tokenizer().save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def registry(dirs):
    reg = default_registry({n: str(p) for n, p in dirs.items() if n != "opus"})
    reg._entries.pop("minilm")
    return reg


@pytest.fixture(scope="module")
def client(registry):
    with one_thread(), TestClient(create_app(registry)) as c:
        yield c


def post(client, **body):
    return client.post("/api/attention", json=body)


def _eager(path, name):
    auto = transformers.AutoModelForCausalLM if name == "llama" else (
        transformers.AutoModelForSeq2SeqLM)  # fmt: skip
    return auto.from_pretrained(path, local_files_only=True, attn_implementation="eager").eval()


def _reference(dirs, name, beam):
    """transformers' own ``generate`` with eager attention, at the server's length limit:
    ``(hypotheses as id lists from the start token, their scores or None, source inputs)``."""
    loaded = load(str(dirs[name]))
    tokens, (ids, mask) = loaded.encode(TEXT)
    model = _eager(dirs[name], name)
    kw = dict(input_ids=ids, attention_mask=mask, do_sample=False,
              max_new_tokens=target_limit(len(tokens)))  # fmt: skip
    eos = loaded.tokenizer.eos_token_id
    with torch.no_grad():
        if beam == 1:
            seq = model.generate(**kw, num_beams=1)[0].tolist()
            return [seq[: seq.index(eos, 1) + 1] if eos in seq[1:] else seq], None, (ids, mask)
        out = model.generate(**kw, num_beams=beam, num_return_sequences=beam,
                             output_scores=True, return_dict_in_generate=True)  # fmt: skip
    # a hypothesis ends where its beam indices do (-1 after): the rest is padding
    prompt = out.sequences.shape[1] - out.beam_indices.shape[1]
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    hyps = [s[: prompt + n] for s, n in zip(out.sequences.tolist(), lengths, strict=True)]
    return hyps, out.sequences_scores.tolist(), (ids, mask)


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_beam_search_equals_transformers_generate(client, dirs, name):
    r = post(client, text=TEXT, model=name, translate=True, beam=BEAM)
    assert r.status_code == 200, r.text
    d = r.json()
    tr = d["translation"]
    hyps, scores, (ids, mask) = _reference(dirs, name, BEAM)
    tok = load(str(dirs[name])).tokenizer
    assert len(hyps) == BEAM and all(a - b > 5e-4 for a, b in zip(scores, scores[1:]))
    if name == "marian":  # hypotheses of different lengths: the padding after the end is cut
        assert len({len(h) for h in hyps}) > 1 and hyps[0][-1] == tok.eos_token_id
    assert tr["beam"] == BEAM and tr["length_penalty"] == 1.0
    # the table: every hypothesis, in transformers' order (best first), the best one chosen
    assert [b["tokens"] for b in tr["beams"]] == [tok.convert_ids_to_tokens(h[1:]) for h in hyps]
    assert [b["chosen"] for b in tr["beams"]] == [True] + [False] * (BEAM - 1)
    for b, h, sc in zip(tr["beams"], hyps, scores, strict=True):
        assert abs(b["score"] - sc) < 2e-4, (b["score"], sc)
        assert b["text"] == tok.decode(h[1:], skip_special_tokens=True)
    best = hyps[0]
    assert tr["target_tokens"] == tok.convert_ids_to_tokens(best[1:]) == tr["beams"][0]["tokens"]
    assert tr["decoder_inputs"] == tok.convert_ids_to_tokens(best[:-1])
    assert tr["text"] == tr["beams"][0]["text"] and tr["steps"] == len(best) - 1
    greedy = _reference(dirs, name, 1)[0][0]
    assert tr["greedy_text"] == tok.decode(greedy[1:], skip_special_tokens=True)
    # the maps are the chosen hypothesis's: eager's weights, teacher-forced on it
    with torch.no_grad():
        ref = _eager(dirs[name], name)(input_ids=ids, attention_mask=mask,
                                       decoder_input_ids=torch.tensor([best[:-1]]),
                                       output_attentions=True)  # fmt: skip
    cross = [x for x in d["layers"] if x["kind"] == "cross"]
    causal = [x for x in d["layers"] if x["kind"] == "causal"]
    assert len(cross) == len(causal) == 2
    for lay, w in [*zip(cross, ref.cross_attentions), *zip(causal, ref.decoder_attentions)]:
        torch.testing.assert_close(torch.tensor(lay["weights"]), w[0], atol=6e-4, rtol=0)
    assert cross[0]["q_tokens"] == tr["target_tokens"] and cross[0]["k_tokens"] == d["tokens"]
    assert d["step_unavailable"] is None
    _check_step(d)  # the step-by-step replay is the chosen hypothesis's too


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_greedy_equals_transformers_generate(client, dirs, name):
    d = post(client, text=TEXT, model=name, translate=True).json()
    tr = d["translation"]
    (want,), _, _ = _reference(dirs, name, 1)
    tok = load(str(dirs[name])).tokenizer
    assert tr["target_tokens"] == tok.convert_ids_to_tokens(want[1:])
    assert tr["beam"] == 1 and tr["beams"] == [] and "greedy_text" not in tr
    _check_step(d)


def test_beam_with_heads_off_has_its_baseline(client):
    layer = "model.decoder.layers.1.encoder_attn"
    d = post(client, text=TEXT, model="marian", translate=True, beam=BEAM,
             ablate=[[layer, 0], [layer, 1], [layer, 2]]).json()  # fmt: skip
    plain = post(client, text=TEXT, model="marian", translate=True, beam=BEAM).json()
    assert d["ablation"]["baseline"]["translation"] == plain["translation"]["text"]
    assert d["translation"]["beams"][0]["chosen"] and d["step"]["check"] < 1e-4


def test_decoder_only_models_do_not_translate_nor_beam(client):
    r = post(client, text=TEXT, model="llama", translate=True, beam=BEAM)
    assert r.status_code == 400
    assert "does not translate (nor search with a beam)" in r.json()["error"]
    d = post(client, text=TEXT, model="llama", beam=BEAM).json()  # beam is for translating
    assert "translation" not in d and d["step"] is not None


class _Spy:
    """Wraps transformers' attention function: keeps what it got for one module."""

    def __init__(self, fn, module):
        self.fn, self.module, self.calls = fn, module, []

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        if module is self.module:
            self.calls.append((query, key, value, attention_mask, kwargs))
        return self.fn(module, query, key, value, attention_mask, **kwargs)


def _values(step, key):
    m = next(m for m in step["matrices"] if m["key"] == key)
    return torch.tensor([[float("-inf") if x is None else x for x in row] for row in m["values"]])


@pytest.mark.parametrize("how", ["eager", "sdpa"])
def test_step_view_of_a_call_transformers_computed(client, registry, monkeypatch, how):
    """Every call handed back to transformers (forced here for the whole model): the step view
    is the replay of what transformers' function was given, equal to ``attention_steps`` on
    exactly those arguments, and gives back what transformers returned (``check``)."""
    import sys

    from transformers.integrations import sdpa_attention

    layer, head = "model.layers.1.self_attn", 3
    module = registry.get("llama").loaded.hf.model.get_submodule(layer)  # the server's model
    reason = f"forced in this test ({how})"
    monkeypatch.setattr(qattn, "fallback_reason", lambda *a, **k: (reason, how))
    modeling = sys.modules[type(module).__module__]
    if how == "eager":
        spy = _Spy(modeling.eager_attention_forward, module)
        monkeypatch.setattr(modeling, "eager_attention_forward", spy)
    else:
        spy = _Spy(sdpa_attention.sdpa_attention_forward, module)
        monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", spy)
    r = post(client, text=TEXT, model="llama", layer=layer, head=head)
    assert r.status_code == 200, r.text
    d = r.json()
    st = d["step"]
    assert d["step_unavailable"] is None and st["fallback"].startswith(reason)
    assert f"transformers' {how} computed it" in st["fallback"]
    assert st["check"] is not None and st["check"] < 1e-5
    _check_step(d)  # its weights are the captured map (eager's, or sdpa's replayed)
    q, k, v, am, kw = spy.calls[-1]  # the map's capture and the step replay saw the same
    kv = head // (q.shape[1] // k.shape[1])
    if how == "eager":  # eager adds its float mask: the causal one the adapter hands it
        assert am is not None and am.dtype == q.dtype
        ref = attention_steps(q[:, head:head + 1], k[:, kv:kv + 1], v[:, kv:kv + 1], bias=am,
                              scale=kw["scaling"])  # fmt: skip
    else:  # sdpa: no mask, is_causal (Tq == Tk: top-left = bottom-right)
        assert am is None and q.shape[2] == k.shape[2]
        ref = attention_steps(q[:, head:head + 1], k[:, kv:kv + 1], v[:, kv:kv + 1], causal=True,
                              scale=kw["scaling"])  # fmt: skip
    for key in ("scores", "weights", "output"):
        torch.testing.assert_close(_values(st, key), getattr(ref, key)[0, 0], atol=6e-4, rtol=0)
    scaled = ref.scores[0, 0] * kw["scaling"]  # (eager's steps add its float mask here)
    torch.testing.assert_close(_values(st, "scaled"), scaled, atol=6e-4, rtol=0)
    masked = _values(st, "masked")
    seen = torch.isfinite(masked)
    assert torch.equal(seen, torch.ones_like(seen).tril())  # the causal mask, as -inf
    torch.testing.assert_close(masked[seen], scaled[seen], atol=6e-4, rtol=0)


def test_page_shows_the_beams_of_a_transformers_model(dirs):
    """The Translation view of an HF encoder-decoder with beam 4: the beams table, the chosen
    hypothesis marked and equal to the translation shown (Debian's chromium via Playwright)."""
    pytest.importorskip("uvicorn")
    reg = default_registry({"opus-tiny": str(dirs["opus"])})
    with one_thread(), running_server(create_app(reg)) as port, chromium() as b:
        text = TEXT.replace(" ", "+")
        url = f"http://127.0.0.1:{port}/?model=opus-tiny&translate=1&text={text}&view=trans"
        page, errors, _, _ = open_page(b, url, height=900)
        assert page.query_selector("#beams") is None  # greedy: no table
        page.select_option("#beam", str(BEAM))
        page.wait_for_selector("#beams")
        rows = page.eval_on_selector_all("#beams tr", "rs => rs.length")
        assert rows == BEAM + 1  # the header and one row per hypothesis
        chosen = page.text_content("#beams tr.chosen")
        assert page.eval_on_selector_all("#beams tr.chosen", "rs => rs.length") == 1
        shown = page.text_content("#view-trans .intro").removeprefix("Translation:")
        assert shown.strip() in chosen and "chosen" in chosen
        assert "greedy" in page.inner_text("#view-trans")  # the greedy line beside
        shots = Path(__file__).resolve().parents[1] / "artifacts"  # tests/artifacts
        shots.mkdir(exist_ok=True)
        page.screenshot(path=str(shots / "serve_hf_beams.png"), full_page=True)
    assert errors == []
