"""The in-page engine's test tools: a site of exported models served by ``python -m
http.server`` on 127.0.0.1, a page of the engine alone (engine_harness.html) that aborts and
records every request leaving that origin, and the comparison of its answers with the Python
API's (``qkv.apps.serve.compute.attention`` on the same registry)."""

from __future__ import annotations

import math
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
from site_helpers import http_server

from serve_helpers import chromium

HERE = Path(__file__).parent
STATIC = HERE.parents[2] / "src" / "qkv" / "apps" / "serve" / "static"
TOL = 1e-4  # unrounded weights against PyTorch
UNIT = 1e-3 + 1e-9  # two 3-decimal roundings of values closer than TOL differ by at most this


def build(tmp_path_factory, names: list[str]) -> Path:
    """A site of the models ``names`` (qkv.apps.web.export) and the harness page."""
    from qkv.apps.web import export

    for module in ("onnx", "onnxruntime"):  # the export's: pip install -e '.[web]'
        pytest.importorskip(module, reason=f"{module} is not installed (the [web] extra)")
    try:
        export.ort_dist()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    out = tmp_path_factory.mktemp("engine-site")
    export.export_site_models(out, names, progress=lambda line: None)
    shutil.copyfile(STATIC / "engine.js", out / "engine.js")
    for f in ("engine_harness.html", "engine_harness.js"):
        shutil.copyfile(HERE / f, out / f)
    return out


@contextmanager
def harness(site: Path):
    """The harness page on ``site``, its engine ready (window.engine); on leaving, no request
    may have left the origin and no error reached the console."""
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
        p.wait_for_selector("body[data-engine='1']", state="attached")
        yield p
        assert not outside, f"requests outside the origin: {outside}"
        assert not [e for e in errors if "favicon" not in e], errors


@contextmanager
def registry_entry(name: str):
    from qkv.apps.serve.models import default_registry

    yield default_registry().get(name)


def ask(page, body: dict) -> tuple[dict, list]:
    """The engine's answer to ``body`` and its unrounded weights ``[layer][h][Tq][Tk]``."""
    return page.evaluate("""async (body) => {
        const out = await window.engine.attention(body);
        return [out, window.engine.lastLayers];
    }""", body)  # fmt: skip


def reference(entry, body: dict) -> tuple[dict, list]:
    """The Python API's answer, and its unrounded maps (the same computation)."""
    import torch

    from qkv.apps.serve.compute import attention, decode_translation
    from qkv.apps.serve.limits import parse_request
    from qkv.capture.maps import merge_steps
    from qkv.capture.record import capture
    from qkv.inspect.ablate import heads_off

    req = parse_request(body)
    out = attention(entry, req)
    spec: dict[str, list[int]] = {}
    for layer, head in req.ablate:
        spec.setdefault(layer, []).append(head)
    loaded = entry.loaded
    with torch.no_grad():
        if req.translate:
            beam = req.beam if loaded.tokenizer is not None else 1
            with heads_off(loaded.full_model, spec):
                maps = merge_steps(decode_translation(entry, out["text"], beam)["steps"])
        else:
            tokens, inputs = loaded.encode(out["text"])
            with heads_off(loaded.model, spec):
                maps = capture(loaded.model, *inputs, tokens=tokens)
    return out, [w.tolist() for w in maps.weights]


def check(page, entry, body: dict) -> dict:
    """The engine's answer to ``body`` against the Python API's: every field (:func:`compare`)
    and every weight unrounded within TOL. Returns the engine's answer."""
    ours, raw = ask(page, body)
    theirs, ref = reference(entry, body)
    compare(ours, theirs)
    for i, (a, b) in enumerate(zip(raw, ref, strict=True)):
        close(a, b, TOL, f"layer {i} unrounded")
    return ours


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
    for key in ("model", "random", "limit", "text", "tokens", "truncated", "notice",
                "step_unavailable", "positions"):
        assert ours.get(key) == theirs.get(key), key
    for lo, lt in zip(ours["layers"], theirs["layers"], strict=True):
        for key in ("name", "kind", "heads", "q_tokens", "k_tokens", "pooled"):
            assert lo.get(key) == lt.get(key), (lo["name"], key)
        close(lo["weights"], lt["weights"], UNIT, lo["name"])
    assert ("exact" in ours) == ("exact" in theirs)
    if "exact" in theirs:  # a long answer (qkv.apps.serve.long)
        compare_long(ours, theirs)
    for so, st in zip(ours["stats"], theirs["stats"], strict=True):
        assert {k: so[k] for k in ("layer", "head", "kind")} == {k: st[k] for k in ("layer", "head", "kind")}
        for k in ("entropy", "distance", "prev", "next", "self", "first", "punct"):
            close(so[k], st[k], UNIT, f"stats {so['layer']} {so['head']} {k}")
    assert ("translation" in ours) == ("translation" in theirs)
    to, tt = ours.get("translation"), theirs.get("translation")
    for key in () if tt is None else ("source_tokens", "target_tokens", "decoder_inputs", "text", "beam", "steps",
                "length_penalty", "pieces", "piece", "warnings", "note", "greedy_text"):
        assert to.get(key) == tt.get(key), f"translation.{key}"
    if tt is not None:
        assert [(b["text"], b["chosen"]) for b in to["beams"]] == \
            [(b["text"], b["chosen"]) for b in tt["beams"]]  # fmt: skip
        close([b["score"] for b in to["beams"]], [b["score"] for b in tt["beams"]], 1e-4 + 1e-9,
              "beam scores")  # fmt: skip
    so, st = ours["step"], theirs["step"]
    for key in ("layer", "kind", "head", "n_heads", "d_k", "d_model", "scale", "head_off"):
        assert so[key] == st[key], f"step.{key}"
    assert so["check"] < 1e-4 and st["check"] < 1e-4
    for mo, mt in zip(so["matrices"], st["matrices"], strict=True):
        for key in ("key", "shape", "rows", "cols", "enc", "of", "by"):
            assert mo.get(key) == mt.get(key), (mo["key"], key)
        # projections of 384-wide rows: PyTorch's and ONNX Runtime's sums differ in the last
        # bits, a little more than the weights
        if mt.get("enc") in ("u16", "bits"):
            close(unpacked(mo), unpacked(mt), 2e-3 + mo.get("step", 0) + mt.get("step", 0),
                  f"step {mo['key']} (packed)")  # fmt: skip
        elif "values" in mt:
            close(mo["values"], mt["values"], 2e-3, f"step {mo['key']}")
    if theirs["probe"] is None:
        assert ours["probe"] is None
    else:
        assert [(r["layer"], r["head"], r["best"]) for r in ours["probe"]["rows"]] == \
            [(r["layer"], r["head"], r["best"]) for r in theirs["probe"]["rows"]]  # fmt: skip
    assert ("ablation" in ours) == ("ablation" in theirs)
    if "ablation" in theirs:
        ao, at = ours["ablation"], theirs["ablation"]
        assert ao["heads"] == at["heads"]
        assert ao["baseline"].get("translation") == at["baseline"].get("translation")
        if "hidden_change" in at:
            close(ao["hidden_change"], at["hidden_change"], 2e-4, "hidden_change")
        po, pt = ao["baseline"]["probe"], at["baseline"]["probe"]
        assert (po is None) == (pt is None)
        if pt is not None:
            assert [(r["layer"], r["head"], r["best"]) for r in po["rows"]] == \
                [(r["layer"], r["head"], r["best"]) for r in pt["rows"]]  # fmt: skip




def check_lens(page, entry, body: dict) -> dict:
    """The engine's ``lens(body)`` against ``qkv.apps.serve.compute_lens.lens_answer``: the
    same tokens, rows, top tokens and names; the numbers within one unit of their last
    decimal (the attributions' sum ``check`` small in both)."""
    from qkv.apps.serve.compute_lens import lens_answer, parse_lens

    ours = page.evaluate("(body) => window.engine.lens(body)", body)
    theirs = lens_answer(entry, parse_lens(body))
    for key in ("model", "random", "limit", "text", "tokens", "truncated", "translation",
                "position", "predicted", "dla_unavailable"):
        assert ours[key] == theirs[key], key
    lo, lt = ours["lens"], theirs["lens"]
    assert (lo["layers"], lo["top_k"], lo["tokens"]) == (lt["layers"], lt["top_k"], lt["tokens"])
    close(lo["probs"], lt["probs"], UNIT, "lens probs")
    close(ours["logit"], theirs["logit"], UNIT, "logit")
    do, dt = ours["dla"], theirs["dla"]
    assert do["note"] == dt["note"] and do["check"] < 1e-4 and dt["check"] < 1e-4
    assert [o["name"] for o in do["others"]] == [o["name"] for o in dt["others"]]
    close([o["target"] for o in do["others"]], [o["target"] for o in dt["others"]], UNIT, "others")
    for ho, ht in zip(do["heads"], dt["heads"], strict=True):
        assert (ho["layer"], ho["head"]) == (ht["layer"], ht["head"])
        close(ho["target"], ht["target"], UNIT, f"{ho['layer']} {ho['head']}")
        for side in ("up", "down"):
            assert [n for n, _ in ho[side]] == [n for n, _ in ht[side]], (ho["layer"], side)
            close([v for _, v in ho[side]], [v for _, v in ht[side]], UNIT, side)
    return ours


def unpacked(p: dict) -> list:
    """A packed matrix of a long answer as nested lists (-inf as None)."""
    from qkv.apps.serve.long import unpack

    rows = len(p["rows"]) if "rows" in p else p["shape"][0]
    cols = len(p["cols"]) if "cols" in p else p["shape"][1]
    t = unpack(p, (rows, cols))
    return [[None if v == float("-inf") else v for v in r] for r in t.tolist()]


def compare_long(ours: dict, theirs: dict) -> None:
    """A long answer's ``exact`` (packed: within its steps) and ``top`` (the same largest
    weights, their order where they are not near ties)."""
    eo, et = ours["exact"], theirs["exact"]
    assert (eo["layer"], eo["head"], eo["shape"], eo["enc"]) == (et["layer"], et["head"], et["shape"], et["enc"])
    close(unpacked(eo), unpacked(et), TOL + eo["step"] + et["step"], "exact")
    to, tt = ours["top"], theirs["top"]
    assert (to["layer"], to["k"]) == (tt["layer"], tt["k"])
    close(to["weights"], tt["weights"], UNIT, "top weights")
    same = sum(a == b for h1, h2 in zip(to["index"], tt["index"]) for r1, r2 in zip(h1, h2)
               for a, b in zip(r1, r2))  # fmt: skip
    total = sum(len(r) for h in tt["index"] for r in h)
    assert same >= 0.99 * total, f"top indices: {same} of {total} the same"


def lens_refusal(page, body: dict) -> list | None:
    """``[status, message]`` of the page's engine refusing ``lens(body)``, or None if it
    answered."""
    return page.evaluate("""async (body) => {
        try { await window.engine.lens(body); return null; }
        catch (e) { return [e.status, e.message]; }
    }""", body)  # fmt: skip
