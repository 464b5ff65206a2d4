"""``qkv serve``'s JSON API through Starlette's TestClient: answers checked against torch
and HuggingFace computations, every error a JSON 4xx, and bounded responses."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("starlette")
pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402

from qkv.apps.cli import build_parser  # noqa: E402
from qkv.apps.serve.app import CSP, create_app  # noqa: E402
from qkv.apps.serve.limits import (  # noqa: E402
    MAX_BODY_BYTES,
    MAX_LONG_BYTES,
    TOKEN_LIMIT,
    encoder_limit,
    target_limit,
)
from qkv.apps.serve.long import map_limit  # noqa: E402
from serve_helpers import one_thread, registry  # noqa: E402

BOY = "The boy trains the puppy."
TIRED = "The animal didn't cross the street because it was tired."
XSS = ["<script>alert(1)</script>", "<img src=x onerror=alert(1)>", "\"'><svg onload=alert(1)>"]


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    return registry(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def client(reg):
    with one_thread(), TestClient(create_app(reg)) as c:
        yield c


def post(client, **body):
    return client.post("/api/attention", json=body)


def test_health_lists_models_and_page_has_csp(client):
    r = client.get("/api/health")
    assert r.status_code == 200
    names = [m["name"] for m in r.json()["models"]]
    assert {"minilm", "random", "tiny-fr"} <= set(names)
    assert [m["random"] for m in r.json()["models"] if m["name"] == "random"] == [True]
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-security-policy"] == CSP
    assert '<script src="/static/app.js"' in page.text and "script-src 'self'" in CSP
    assert "'unsafe-inline'" not in CSP
    for path in ("/static/app.js", "/static/compare.js", "/static/app.css",
                 "/static/i18n/strings.json"):  # fmt: skip
        assert client.get(path).status_code == 200
    strings = client.get("/static/i18n/strings.json").json()
    assert set(strings["languages"]) == {"en", "my", "vi", "bn", "zh"}
    assert all(set(strings[k]) == set(strings["en"]) for k in strings["languages"])
    holes = lambda s: sorted(re.findall(r"\{\w+\}", s))  # noqa: E731
    for lang in strings["languages"]:  # every placeholder of the English text, none more
        bad = [k for k, v in strings[lang].items() if holes(v) != holes(strings["en"][k])]
        assert bad == [], (lang, bad)
    labelled = {m["name"]: m["label_key"] for m in r.json()["models"]}
    assert labelled["random"] == "model.random" and labelled["tiny-fr"] == ""  # a DIR: its name


def _torch_weights(module, x: torch.Tensor) -> torch.Tensor:
    """softmax(Q Kᵀ / √d_k) with plain torch from the module's projection weights."""
    h, dk = module.n_heads, module.d_k
    q = torch.nn.functional.linear(x, module.w_q.weight, module.w_q.bias)  # (T, h·d_k)
    k = torch.nn.functional.linear(x, module.w_k.weight, module.w_k.bias)
    q, k = (t.view(-1, h, dk).transpose(0, 1) for t in (q, k))  # (h, T, d_k)
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dk), dim=-1)  # (h, T, T)


def test_random_model_maps_and_steps_match_torch(client, reg):
    r = post(client, text=BOY, model="random", layer="encoder.layers.1.self_attn", head=2)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["random"] is True and d["truncated"] is False and d["notice"] is None
    assert d["tokens"] == ["[CLS]", "The", "boy", "trains", "the", "puppy", ".", "[SEP]"]
    T = len(d["tokens"])
    assert [(lay["name"], lay["kind"]) for lay in d["layers"]] == [
        ("encoder.layers.0.self_attn", "self"), ("encoder.layers.1.self_attn", "self")]  # fmt: skip
    model = reg.get("random").loaded.model
    st = d["step"]
    assert (st["layer"], st["head"], st["kind"]) == ("encoder.layers.1.self_attn", 2, "self")
    mats = {m["key"]: m for m in st["matrices"]}
    assert list(mats) == ["x", "q", "k", "v", "scores", "scaled", "mask", "masked", "weights",
                          "output", "concat", "wo"]  # fmt: skip
    x = torch.tensor(mats["x"]["values"])  # (T, d_model=32): the layer's real input
    want = _torch_weights(model.encoder.layers[1].self_attn, x)  # (h, T, T)
    got = torch.tensor(d["layers"][1]["weights"])  # (h, T, T)
    assert got.shape == (4, T, T)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
    torch.testing.assert_close(torch.tensor(mats["weights"]["values"]), want[2], atol=2e-3, rtol=0)
    scaled = torch.tensor(mats["scores"]["values"]) * st["scale"]
    torch.testing.assert_close(torch.tensor(mats["scaled"]["values"]), scaled, atol=5e-3, rtol=0)
    assert st["check"] < 1e-4  # W_O output recomputed = the module's real output
    assert len(d["stats"]) == 8 and {s["layer"] for s in d["stats"]} == {
        "encoder.layers.0.self_attn",
        "encoder.layers.1.self_attn",
    }


def test_minilm_maps_equal_hf_attentions(client, reg):
    transformers = pytest.importorskip("transformers")
    r = post(client, text=TIRED, model="minilm", probe={"token": "it",
             "candidates": ["animal", "street"]})  # fmt: skip
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["limit"] == map_limit(512) == 511 and d["tokens"][0] == "[CLS]"  # its positions
    assert len(d["tokens"]) <= encoder_limit(72) and "exact" not in d  # every map as JSON
    assert len(d["layers"]) == 6 and all(len(lay["weights"]) == 12 for lay in d["layers"])
    loaded = reg.get("minilm").loaded
    hf = transformers.BertModel.from_pretrained(
        str(loaded.model.source_dir), attn_implementation="eager", local_files_only=True
    ).eval()
    _, (ids, mask) = loaded.encode(TIRED)
    with torch.no_grad():
        want = torch.stack(hf(ids, attention_mask=mask, output_attentions=True).attentions)
    got = torch.tensor([lay["weights"] for lay in d["layers"]])  # (L, h, T, T)
    torch.testing.assert_close(got, want[:, 0], atol=1e-3, rtol=0)
    probe = d["probe"]
    assert probe["n_heads"] == 72 and len(probe["rows"]) == 12
    assert probe["deciding"] == sum(probe["votes"].values())


def test_translation_steps_kinds_and_beam(client):
    r = post(client, text="the boy trains the puppy", model="tiny-fr", translate=True, beam=2,
             layer="decoder.layers.1.cross_attn", head=1)  # fmt: skip
    assert r.status_code == 200, r.text
    d = r.json()
    tr = d["translation"]
    assert tr["text"] and tr["beam"] == 2
    assert 1 <= len(tr["target_tokens"]) <= target_limit(len(tr["source_tokens"]))
    assert "greedy_text" in tr
    beams = tr["beams"]  # the hypotheses beam search kept, best first, the chosen one first
    assert 1 <= len(beams) <= 2 and beams[0]["chosen"] and beams[0]["text"] == tr["text"]
    assert [b["score"] for b in beams] == sorted((b["score"] for b in beams), reverse=True)
    assert d["tokens"] == tr["source_tokens"] and d["tokens"][-1] == "</s>"
    kinds = {lay["name"]: lay["kind"] for lay in d["layers"]}
    assert kinds["encoder.layers.0.self_attn"] == "self"
    assert kinds["decoder.layers.0.self_attn"] == "causal"
    assert kinds["decoder.layers.1.cross_attn"] == "cross"
    n, S = len(tr["target_tokens"]), len(tr["source_tokens"])
    for lay in d["layers"]:
        w = torch.tensor(lay["weights"])
        if lay["kind"] == "cross":
            assert w.shape == (4, n, S) and lay["q_tokens"] == tr["target_tokens"]
        if lay["kind"] == "causal":  # step s sees decoder inputs 0..s only
            assert w.shape == (4, n, n) and float(w.triu(1).abs().max()) == 0.0
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:2]), atol=5e-3, rtol=0)
    st = d["step"]
    assert st["kind"] == "cross" and st["head"] == 1 and st["check"] < 1e-4
    keys = [m["key"] for m in st["matrices"]]
    assert keys[:2] == ["x", "context"] and "wo" in keys
    cross = next(lay for lay in d["layers"] if lay["name"] == "decoder.layers.1.cross_attn")
    w_step = torch.tensor(next(m for m in st["matrices"] if m["key"] == "weights")["values"])
    torch.testing.assert_close(w_step, torch.tensor(cross["weights"][1]), atol=2e-3, rtol=0)


def test_heads_off_changes_the_result(client):
    every = [["decoder.layers.0.self_attn", h] for h in range(4)]
    r = post(client, text="the boy trains the puppy", model="tiny-fr", translate=True,
             ablate=every)  # fmt: skip
    d = r.json()
    assert r.status_code == 200 and len(d["ablation"]["heads"]) == 4
    assert d["ablation"]["baseline"]["translation"] != d["translation"]["text"]
    r = post(client, text=BOY, model="random", ablate=[["encoder.layers.0.self_attn", 1]],
             layer="encoder.layers.0.self_attn", head=1)  # fmt: skip
    d = r.json()
    assert d["ablation"]["hidden_change"] > 0 and d["step"]["head_off"] is True
    concat = torch.tensor(next(m for m in d["step"]["matrices"] if m["key"] == "concat")["values"])
    assert float(concat[:, 8:16].abs().max()) == 0.0  # head 1's slice of concat is zero
    assert d["step"]["check"] < 1e-4


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "JSON"),
        (b"[1, 2]", 400, "object"),
        (json.dumps({"text": BOY, "model": "nope"}).encode(), 404, "model must be one of"),
        (json.dumps({"text": "   ", "model": "random"}).encode(), 400, "text"),
        (json.dumps({"text": 5}).encode(), 400, "text must be a string"),
        (json.dumps({"text": BOY, "model": "random", "beam": 0}).encode(), 400, "beam"),
        (json.dumps({"text": BOY, "model": "random", "layer": "x"}).encode(), 400, "layer"),
        (json.dumps({"text": BOY, "model": "random", "head": 9}).encode(), 400, "head"),
        (
            json.dumps(
                {"text": BOY, "model": "random", "ablate": [["encoder.layers.0.self_attn", 7]]}
            ).encode(),
            400,
            "out of range",
        ),  # fmt: skip
        (
            json.dumps({"text": BOY, "model": "minilm", "translate": True}).encode(),
            400,
            "does not translate",
        ),  # fmt: skip
        (b'{"text": "' + b"a " * MAX_BODY_BYTES + b'"}', 413, "at most"),
    ],
)
def test_bad_requests_get_json_errors_and_server_keeps_serving(client, body, status, needle):
    r = client.post("/api/attention", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status and needle in r.json()["error"]
    assert client.get("/api/health").status_code == 200


def test_other_routes_answer_json(client):
    assert client.get("/api/attention").status_code == 405
    r = client.get("/nope")
    assert r.status_code == 404 and r.json() == {"error": "not found"}


@pytest.mark.parametrize("model", ["random", "minilm", "tiny-fr"])
def test_5000_words_are_cut_with_notice_and_bounded(client, model):
    text = " ".join(f"word{i % 50}" for i in range(5000))
    r = post(client, text=text, model=model, translate=model == "tiny-fr")
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["truncated"] is True and str(d["limit"]) in d["notice"]
    assert d["limit"] // 2 <= len(d["tokens"]) <= d["limit"]  # whole words: a few pieces short
    # more than 128 tokens (random: 2,048; MiniLM: 511) are answered long (test_serve_long.py)
    assert len(r.content) < (MAX_LONG_BYTES if len(d["tokens"]) > TOKEN_LIMIT else 4_000_000)
    assert d["text"] == " ".join(text.split()[: len(d["text"].split())])  # a prefix, whole words


def test_unspaced_text_is_cut_too(client):
    r = post(client, text="猫" * 3000, model="minilm")
    d = r.json()
    assert r.status_code == 200 and d["truncated"] and len(d["tokens"]) <= d["limit"]


def test_hostile_tokens_are_data(client):
    r = post(client, text=" ".join(XSS), model="random")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    toks = r.json()["tokens"]
    assert "script" in toks and "<" in toks and "onerror" in toks  # split, kept as text


def test_cli_parses_and_rejects(capsys):
    args = build_parser().parse_args(["serve", "--model", "x=/tmp"])
    assert (args.host, args.port, args.model) == ("127.0.0.1", 8000, [("x", "/tmp")])
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--port", "70000"])
    assert e.value.code == 2 and "--port" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "nodir"])


def test_cli_missing_model_dir_is_one_line(capsys, tmp_path):
    from qkv.apps.cli import main

    for argv in (["serve", "--model", f"x={tmp_path / 'missing'}"], ["serve", "--preload", "x"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("qkv serve: error:")


def test_a_translation_far_from_the_training_data_comes_with_a_note(client):
    """Capitals fall apart into pieces the vocabulary does not know: said in the answer, as a
    code for the page (in the reader's language) and as an English note."""
    r = post(client, text="A GROUP OF MUSICIANS IS PLAYING ON THE STAGE.", model="en-fr",
             translate=True)  # fmt: skip
    tr = r.json()["translation"]
    assert [w["code"] for w in tr["warnings"]] == ["pieces"] and "vocabulary" in tr["note"]
    tr = post(client, text=BOY, model="en-fr", translate=True).json()["translation"]
    assert tr["warnings"] == [] and tr["note"] is None
    assert tr["text"] in ("Le garçon entraîne le chiot.", "Le garçon dresse le chiot.")


def test_a_model_dir_without_tokenizer_is_refused_at_start(capsys, tmp_path, reg):
    """Not served and then refused on every request: one line at start, exit 2."""
    from qkv.apps.cli import main
    from serve_helpers import _SAVED

    tiny = Path(_SAVED["tiny-fr"])  # saved by the reg fixture
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny / f, bare / f)
    hf = tmp_path / "hf"  # a transformers directory: weights and config, no tokenizer
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "bert"}')
    (hf / "model.safetensors").write_bytes(b"")
    for d, want in ((bare, "tokenizer.json"), (hf, "vocab.txt"), (tmp_path, "no config.json")):
        assert main(["serve", "--model", f"mine={d}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("qkv serve: error: --model mine=") and want in err[0]


def test_qkv_view_writes_the_explorer_page_with_the_same_limits(tmp_path, capsys):
    from qkv.apps.cli import main

    out = tmp_path / "long.html"
    text = " ".join(f"w{i % 40}" for i in range(5000))
    assert main(["view", text, "--model", "random", "--out", str(out)]) == 0
    page = out.read_text()
    assert out.stat().st_size < 4_000_000 and 'id="qkv-data"' in page
    data = json.loads(page.split('id="qkv-data">')[1].split("</script>")[0])
    assert data["response"]["truncated"] and len(data["response"]["tokens"]) == 128
    assert 'src="/static' not in page and 'href="/static' not in page  # self-contained
    assert "cut to its first 128 tokens" in capsys.readouterr().err  # a note, on stderr
    for argv in (["view", "", "--out", str(tmp_path / "a.html")],
                 ["view", "x", "--beam", "0", "--out", str(tmp_path / "b.html")],
                 ["view", "x", "--png", "x.jpg", "--out", str(tmp_path / "c.html")]):  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("qkv view: error:")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["long.html"]


def test_random_model_translates_with_labelled_steps(client):
    d = post(client, text=BOY, model="random", translate=True).json()
    tr = d["translation"]
    n = len(tr["target_tokens"])
    assert d["random"] and tr["steps"] == n == len(tr["decoder_inputs"])
    assert tr["decoder_inputs"][0] == "<s>" and tr["decoder_inputs"][1:] == tr["target_tokens"][:-1]
    assert d["step"]["layer"] == "decoder.layers.1.cross_attn"  # default when translating
    for lay in d["layers"]:
        if lay["kind"] == "cross":
            assert lay["q_tokens"] == tr["target_tokens"] and lay["k_tokens"] == d["tokens"]
