"""The in-page engine against the Python API, in Debian's chromium: the shipped en-fr model
exported by ``qkv.apps.web.export``, run by ONNX Runtime Web in a page served by
``python -m http.server`` on 127.0.0.1 (no request may leave it), answering
``/api/attention`` requests for fixed sentences as ``qkv.apps.serve.compute.attention``
answers them: the same tokens, translations and labels, every attention weight within 1e-4
(unrounded; the answers' 3-decimal numbers within one unit of the last decimal), the same
step-by-step matrices, statistics and probe."""

from __future__ import annotations

import pytest
from engine_helpers import build, check, check_lens, harness, lens_refusal, registry_entry

from serve_helpers import playwright_or_skip

playwright_or_skip()


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    with harness(build(tmp_path_factory, ["en-fr"])) as p:
        yield p


@pytest.fixture(scope="module")
def entry():
    with registry_entry("en-fr") as e:
        yield e


CASES = [
    {"text": "The boy trains the puppy.", "model": "en-fr", "translate": True},
    {"text": "Two dogs play in the snow near a big red house.", "model": "en-fr", "translate": True,
     "layer": "encoder.layers.1.self_attn", "head": 2},
    {"text": "A man in a blue shirt is riding a bike down the street.", "model": "en-fr",
     "translate": True, "layer": "decoder.layers.0.self_attn", "head": 5},
    {"text": "A dog 🐕 runs past the café in Zürich.", "model": "en-fr", "translate": True},
]


@pytest.mark.parametrize("body", CASES, ids=["notes", "encoder-step", "decoder-step", "unicode"])
def test_greedy_translation_as_python(page, entry, body):
    check(page, entry, body)


def test_beam_translation_as_python(page, entry):
    body = {"text": "A little girl climbs into a wooden playhouse.", "model": "en-fr",
            "translate": True, "beam": 4}
    check(page, entry, body)


def test_heads_off_and_probe_as_python(page, entry):
    body = {"text": "The boy trains the puppy because it is young.", "model": "en-fr",
            "translate": True, "ablate": [["decoder.layers.2.cross_attn", 0],
                                          ["encoder.layers.0.self_attn", 3]],
            "probe": {"token": "it", "candidates": ["boy", "puppy"]},
            "layer": "decoder.layers.2.cross_attn", "head": 0}  # fmt: skip
    ours = check(page, entry, body)
    assert ours["step"]["head_off"] is True


def test_encoder_view_as_python(page, entry):
    """translate: false on a translator: the maps of its encoder alone (compute._encoder)."""
    check(page, entry, {"text": "The boy trains the puppy.", "model": "en-fr", "head": 1,
                        "layer": "encoder.layers.2.self_attn",
                        "ablate": [["encoder.layers.0.self_attn", 0]]})  # fmt: skip


@pytest.mark.parametrize("body", [
    {"text": "The boy trains the puppy.", "model": "en-fr", "translate": True},
    {"text": "Two dogs play in the snow.", "model": "en-fr", "translate": True, "position": 2,
     "top_k": 3, "ablate": [["decoder.layers.1.cross_attn", 4]]},
], ids=["last", "position-heads-off"])  # fmt: skip
def test_lens_as_python(page, entry, body):
    ours = check_lens(page, entry, body)
    assert len(ours["lens"]["tokens"]) == 4  # the embeddings and each of the 3 blocks


def test_lens_refusals_as_the_server(page, entry):
    from qkv.apps.serve.compute_lens import lens_answer, parse_lens
    from qkv.apps.serve.limits import BadRequest

    for body in ({"text": "A dog.", "model": "en-fr"},
                 {"text": "A dog.", "model": "en-fr", "translate": True, "position": 40},
                 {"text": "A dog.", "model": "en-fr", "translate": True, "top_k": 11}):
        with pytest.raises(BadRequest) as err:
            lens_answer(entry, parse_lens(body))
        ours = lens_refusal(page, body)
        assert ours == [400, str(err.value)]


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
