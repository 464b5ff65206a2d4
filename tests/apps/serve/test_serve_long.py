"""Long inputs in ``qkv serve``'s API (qkv.apps.serve.long): a 2,048-token text on ``random``
answers within MAX_LONG_BYTES, its exact head and step matrices equal an fp64 computation to
their stated precision, its pooled maps and top keys are those of the fp64 maps; a model's
own positions cap the text (MiniLM 511, a translator 255); short texts are answered as before."""

from __future__ import annotations

import base64
import copy
import math
import os
import time

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("starlette")
pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402

from qkv.apps.serve.app import create_app  # noqa: E402
from qkv.apps.serve.limits import MAX_LONG_BYTES, TOKEN_LIMIT  # noqa: E402
from qkv.apps.serve.long import TOP_K, map_limit, pack, unpack  # noqa: E402
from qkv.capture.record import capture  # noqa: E402
from qkv.limits import LONG_TOKEN_LIMIT, MAX_CELLS  # noqa: E402
from serve_helpers import one_thread, registry  # noqa: E402

LONG = " ".join(f"w{i % 97}" for i in range(2046))  # [CLS] + 2,046 words + [SEP]


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    return registry(tmp_path_factory.mktemp("serve-long"))


@pytest.fixture(scope="module")
def client(reg):
    with one_thread(), TestClient(create_app(reg)) as c:
        yield c


@pytest.fixture(scope="module")
def long_answer(client):
    client.post("/api/attention", json={"text": "warm up", "model": "random"})
    t0 = time.perf_counter()
    r = client.post("/api/attention", json={"text": LONG, "model": "random", "head": 1,
                                            "layer": "encoder.layers.1.self_attn"})  # fmt: skip
    seconds = time.perf_counter() - t0
    assert r.status_code == 200, r.text[:300]
    print(f"\n2,048 tokens on random: {len(r.content) / 1e6:.1f} MB, {seconds:.2f} s "
          f"(server {r.json()['elapsed_ms'] / 1000:.2f} s) on {os.cpu_count()} CPUs")  # fmt: skip
    return r, r.json()


def _fp64_maps(reg, text: str):
    """The random encoder's maps of ``text``, computed in float64."""
    loaded = reg.get("random").loaded
    tokens, (ids,) = loaded.encode(text)
    model = copy.deepcopy(loaded.model).double()
    with torch.no_grad():
        return tokens, capture(model, ids, tokens=tokens)


def test_2048_tokens_answer_long_and_bounded(long_answer):
    r, d = long_answer
    assert len(d["tokens"]) == LONG_TOKEN_LIMIT == d["limit"] and not d["truncated"]
    assert d["notice"] is None and d["positions"] is None  # sinusoidal: no table to run out of
    assert len(r.content) <= MAX_LONG_BYTES
    pooled = sum(len(w) * len(w[0]) for lay in d["layers"] for w in lay["weights"])
    assert pooled <= MAX_CELLS  # the JSON maps: pooled within the short answers' bound
    for lay in d["layers"]:
        assert lay["pooled"] == {"k": 16, "rows": 2048, "cols": 2048, "how": "max"}
    encs = {m["key"]: m.get("enc") for m in d["step"]["matrices"]}
    assert encs == {"x": "u16", "q": "u16", "k": "u16", "v": "u16", "scores": "u16",
                    "scaled": "scaled", "mask": "bits", "masked": "masked", "weights": "ref",
                    "output": "u16", "concat": "u16", "wo": "u16"}  # fmt: skip
    assert all("values" not in m for m in d["step"]["matrices"])
    # the packed bytes: 2 a cell (the mask: a bit), as stated in the limits' table
    sizes = {m["key"]: len(base64.b64decode(m.get("data", ""))) for m in d["step"]["matrices"]}
    assert sizes["scores"] == 2 * 2048 * 2048 and sizes["mask"] == 2048 * 2048 // 8
    assert len(base64.b64decode(d["exact"]["data"])) == 2 * 2048 * 2048


def test_exact_head_and_steps_match_fp64(long_answer, reg):
    _, d = long_answer
    tokens, maps = _fp64_maps(reg, LONG)
    assert tokens == d["tokens"]
    want = maps.weights[1][1].double()  # (T, T) layer 1, head 1 (computed in float64)
    ex = d["exact"]
    assert (ex["layer"], ex["head"], ex["shape"]) == ("encoder.layers.1.self_attn", 1, [2048, 2048])
    got = unpack(ex, (2048, 2048))
    assert ex["step"] < 1.6e-5  # weights: the uint16 step, far below the 3 decimals shown
    assert (got - want).abs().max() <= ex["step"] / 2 + 1e-6
    # the step matrices: softmax of the (derived) masked scores gives the exact weights back
    mats = {m["key"]: m for m in d["step"]["matrices"]}
    scores = unpack(mats["scores"], (2048, 2048))
    scale = mats["scaled"]["by"]
    assert scale == pytest.approx(1 / math.sqrt(d["step"]["d_k"]))
    assert bool((unpack(mats["mask"], (2048, 2048)) == 1).all())  # an encoder sees every key
    err = mats["scores"]["step"] / 2 * scale  # the scores' quantisation, scaled
    torch.testing.assert_close(torch.softmax(scores * scale, -1), want, atol=2 * err + 1e-6, rtol=0)
    # the feature matrices: Q of head 1 (the first 64 dims), to its step
    assert mats["q"]["shape"][0] == 2048 and len(mats["q"]["cols"]) == mats["q"]["shape"][1]


def test_pooled_maps_and_top_keys_are_the_fp64_maps(long_answer, reg):
    _, d = long_answer
    _, maps = _fp64_maps(reg, LONG)
    for lay, w in zip(d["layers"], maps.weights, strict=True):
        pooled = torch.nn.functional.max_pool2d(w.double(), 16)  # (h, 128, 128)
        assert (torch.tensor(lay["weights"], dtype=torch.float64) - pooled).abs().max() < 6e-4
    top = d["top"]
    assert top["layer"] == "encoder.layers.1.self_attn" and top["k"] == TOP_K
    w = maps.weights[1].double()  # (h, T, T)
    got = torch.tensor(top["weights"], dtype=torch.float64)  # (h, T, k)
    want = w.topk(TOP_K, dim=-1).values
    assert (got - want).abs().max() < 6e-4
    picked = w.gather(-1, torch.tensor(top["index"]))  # the weights of the keys named
    assert (picked - want).abs().max() < 1e-6


def test_short_texts_are_answered_as_before(client):
    d = client.post("/api/attention", json={"text": "The boy trains the puppy.",
                                            "model": "random"}).json()  # fmt: skip
    assert "exact" not in d and "top" not in d and "pooled" not in d["layers"][0]
    assert all(isinstance(m["values"], list) and "enc" not in m for m in d["step"]["matrices"])
    n = TOKEN_LIMIT - 2  # 128 tokens: every map as JSON still
    d = client.post("/api/attention", json={"text": " ".join(["w"] * n), "model": "random"}).json()
    assert len(d["tokens"]) == TOKEN_LIMIT and "exact" not in d


@pytest.mark.parametrize(("model", "positions"), [("minilm", 512), ("tiny-fr", 256)])
def test_a_model_with_fewer_positions_caps_the_text(client, model, positions):
    r = client.post("/api/attention", json={"text": LONG, "model": model})
    assert r.status_code == 200, r.text[:300]
    d = r.json()
    assert d["positions"] == positions and d["limit"] == map_limit(positions) == positions - 1
    assert d["truncated"] and str(d["limit"]) in d["notice"]
    assert d["limit"] // 2 <= len(d["tokens"]) <= d["limit"]
    assert len(r.content) <= MAX_LONG_BYTES and "exact" in d  # more than 128 tokens: long
    T = len(d["tokens"])
    assert unpack(d["exact"], (T, T)).sum(-1).sub(1).abs().max() < 1e-3  # rows of weights


def test_pack_round_trips_within_its_step():
    t = torch.randn(37, 53, dtype=torch.float64) * 7
    t[3, 4] = -math.inf
    p = pack(t)
    back = unpack(p, (37, 53))
    assert back[3, 4] == -math.inf
    fin = torch.isfinite(t)
    assert (back[fin] - t[fin]).abs().max() <= p["step"] / 2 + 1e-12
    mask = torch.rand(9, 11) > 0.5
    assert torch.equal(unpack(pack(mask.double(), bits=True), (9, 11)), mask.double())
