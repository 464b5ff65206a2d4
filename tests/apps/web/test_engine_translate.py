"""The in-page engine against the Python API, in Debian's chromium: the shipped en-fr model
exported by ``qkv.apps.web.export``, run by ONNX Runtime Web in a page served by
``python -m http.server`` on 127.0.0.1 (no request may leave it), answering
``/api/attention`` requests for fixed sentences as ``qkv.apps.serve.compute.attention``
answers them: the same tokens, translations and labels, every attention weight within 1e-4
(unrounded; the answers' 3-decimal numbers within one unit of the last decimal), the same
step-by-step matrices, statistics and probe."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
from site_helpers import http_server

from serve_helpers import chromium, playwright_or_skip

playwright_or_skip()

HERE = Path(__file__).parent
STATIC = HERE.parents[2] / "src" / "qkv" / "apps" / "serve" / "static"
TOL = 1e-4  # unrounded weights against PyTorch
UNIT = 1e-3 + 1e-9  # two 3-decimal roundings of values closer than TOL differ by at most this


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    from qkv.apps.web import export

    try:
        export.ort_dist()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    out = tmp_path_factory.mktemp("engine-site")
    export.export_site_models(out, ["en-fr"], progress=lambda line: None)
    shutil.copyfile(STATIC / "engine.js", out / "engine.js")
    for f in ("engine_harness.html", "engine_harness.js"):
        shutil.copyfile(HERE / f, out / f)
    return out


@pytest.fixture(scope="module")
def page(site):
    with http_server(site) as url, chromium() as browser:
        p = browser.new_page()
        errors, outside = [], []
        p.on("pageerror", lambda e: errors.append(str(e)))
        p.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)

        def route(r):
            if r.request.url.startswith(url + "/"):
                r.continue_()
            else:
                outside.append(r.request.url)
                r.abort()

        p.route("**/*", route)
        p.goto(url + "/engine_harness.html")
        p.wait_for_function("window.engine !== undefined")
        yield p
        assert not outside, f"requests outside the origin: {outside}"
        assert not errors, errors


@pytest.fixture(scope="module")
def entry():
    from qkv.apps.serve.models import default_registry

    return default_registry().get("en-fr")


def ask(page, body: dict) -> tuple[dict, list]:
    """The engine's answer to ``body`` and its unrounded weights ``[layer][h][Tq][Tk]``."""
    return page.evaluate("""async (body) => {
        const out = await window.engine.attention(body);
        return [out, window.engine.lastLayers];
    }""", body)  # fmt: skip


def reference(entry, body: dict) -> tuple[dict, list]:
    """The Python API's answer, and its unrounded merged maps (the same decoding)."""
    import torch

    from qkv.apps.serve.compute import attention, decode_translation
    from qkv.apps.serve.limits import parse_request
    from qkv.capture.maps import merge_steps
    from qkv.inspect.ablate import heads_off

    req = parse_request(body)
    out = attention(entry, req)
    spec: dict[str, list[int]] = {}
    for layer, head in req.ablate:
        spec.setdefault(layer, []).append(head)
    with torch.no_grad(), heads_off(entry.loaded.full_model, spec):
        maps = merge_steps(decode_translation(entry, out["text"], req.beam)["steps"])
    return out, [w.tolist() for w in maps.weights]


def close(a, b, tol: float, where: str) -> None:
    """Nested lists of numbers (``None`` for -inf) equal within ``tol``."""
    if isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{where}: shapes differ"
        for i, (x, y) in enumerate(zip(a, b)):
            close(x, y, tol, f"{where}[{i}]")
        return
    if a is None or b is None:
        assert a is None and b is None, f"{where}: {a} != {b}"
        return
    assert math.isclose(a, b, rel_tol=0, abs_tol=tol), f"{where}: {a} != {b} (tol {tol})"


def compare(ours: dict, theirs: dict) -> None:
    """Every field of an /api/attention answer: exact where it is text, within one unit of
    the last decimal where it is a rounded number."""
    for key in ("model", "random", "limit", "text", "tokens", "truncated", "notice", "step_unavailable"):
        assert ours[key] == theirs[key], key
    for lo, lt in zip(ours["layers"], theirs["layers"], strict=True):
        for key in ("name", "kind", "heads", "q_tokens", "k_tokens"):
            assert lo[key] == lt[key], (lo["name"], key)
        close(lo["weights"], lt["weights"], UNIT, lo["name"])
    for so, st in zip(ours["stats"], theirs["stats"], strict=True):
        assert {k: so[k] for k in ("layer", "head", "kind")} == {k: st[k] for k in ("layer", "head", "kind")}
        for k in ("entropy", "distance", "prev", "next", "self", "first", "punct"):
            close(so[k], st[k], UNIT, f"stats {so['layer']} {so['head']} {k}")
    to, tt = ours["translation"], theirs["translation"]
    for key in ("source_tokens", "target_tokens", "decoder_inputs", "text", "beam", "steps",
                "length_penalty", "pieces", "piece", "warnings", "note", "greedy_text"):
        assert to.get(key) == tt.get(key), f"translation.{key}"
    assert [(b["text"], b["chosen"]) for b in to["beams"]] == [(b["text"], b["chosen"]) for b in tt["beams"]]
    close([b["score"] for b in to["beams"]], [b["score"] for b in tt["beams"]], 1e-4 + 1e-9, "beam scores")
    so, st = ours["step"], theirs["step"]
    for key in ("layer", "kind", "head", "n_heads", "d_k", "d_model", "scale", "head_off"):
        assert so[key] == st[key], f"step.{key}"
    assert so["check"] < 1e-4 and st["check"] < 1e-4
    for mo, mt in zip(so["matrices"], st["matrices"], strict=True):
        for key in ("key", "shape", "rows", "cols"):
            assert mo[key] == mt[key], (mo["key"], key)
        # projections of 384-wide rows: PyTorch's and ONNX Runtime's sums differ in the last
        # bits, a little more than the weights
        close(mo["values"], mt["values"], 2e-3, f"step {mo['key']}")
    if theirs["probe"] is None:
        assert ours["probe"] is None
    else:
        assert [(r["layer"], r["head"], r["best"]) for r in ours["probe"]["rows"]] == \
            [(r["layer"], r["head"], r["best"]) for r in theirs["probe"]["rows"]]  # fmt: skip
    assert ("ablation" in ours) == ("ablation" in theirs)
    if "ablation" in theirs:
        assert ours["ablation"]["heads"] == theirs["ablation"]["heads"]
        assert ours["ablation"]["baseline"]["translation"] == theirs["ablation"]["baseline"]["translation"]


CASES = [
    {"text": "The boy trains the puppy.", "model": "en-fr", "translate": True},
    {"text": "Two dogs play in the snow near a big red house.", "model": "en-fr", "translate": True,
     "layer": "encoder.layers.1.self_attn", "head": 2},
    {"text": "A man in a blue shirt is riding a bike down the street.", "model": "en-fr",
     "translate": True, "layer": "decoder.layers.0.self_attn", "head": 5},
]


@pytest.mark.parametrize("body", CASES, ids=["notes", "encoder-step", "decoder-step"])
def test_greedy_translation_as_python(page, entry, body):
    ours, raw = ask(page, body)
    theirs, ref = reference(entry, body)
    compare(ours, theirs)
    for i, (a, b) in enumerate(zip(raw, ref, strict=True)):
        close(a, b, TOL, f"layer {i} unrounded")


def test_beam_translation_as_python(page, entry):
    body = {"text": "A little girl climbs into a wooden playhouse.", "model": "en-fr",
            "translate": True, "beam": 4}
    ours, raw = ask(page, body)
    theirs, ref = reference(entry, body)
    compare(ours, theirs)
    for i, (a, b) in enumerate(zip(raw, ref, strict=True)):
        close(a, b, TOL, f"layer {i} unrounded")


def test_heads_off_and_probe_as_python(page, entry):
    body = {"text": "The boy trains the puppy because it is young.", "model": "en-fr",
            "translate": True, "ablate": [["decoder.layers.2.cross_attn", 0],
                                          ["encoder.layers.0.self_attn", 3]],
            "probe": {"token": "it", "candidates": ["boy", "puppy"]},
            "layer": "decoder.layers.2.cross_attn", "head": 0}  # fmt: skip
    ours, raw = ask(page, body)
    theirs, ref = reference(entry, body)
    assert ours["step"]["head_off"] is True
    compare(ours, theirs)
    for i, (a, b) in enumerate(zip(raw, ref, strict=True)):
        close(a, b, TOL, f"layer {i} unrounded")


def test_bad_requests_as_the_server(page):
    """The server's statuses and messages for what it refuses."""
    errors = page.evaluate("""async () => {
        const out = [];
        for (const body of [{text: " ", model: "en-fr", translate: true},
                            {text: "A dog.", model: "nope", translate: true},
                            {text: "A dog.", model: "en-fr", translate: true, head: 6},
                            {text: "A dog.", model: "en-fr", translate: true, beam: 9}]) {
            try { await window.engine.attention(body); out.push(null); }
            catch (e) { out.push([e.status, e.message]); }
        }
        return out;
    }""")  # fmt: skip
    assert errors[0] == [400, "text must contain at least one non-space character"]
    assert errors[1][0] == 404 and "got 'nope'" in errors[1][1]
    assert errors[2] == [400, "head must be in [0, 5], got 6"]
    assert errors[3] == [400, "beam must be in [1, 8], got 9"]
