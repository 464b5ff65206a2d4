"""The in-page engine's files: the shipped models as ONNX graphs, their tokenizers, the
runtime and the engine's scripts, written into a static site.

:func:`export_site_models` writes, under ``out``:

* ``models/index.json``: ``{"models": [names]}``, the models the site holds;
* ``models/<name>/``: the graphs traced from the PyTorch modules
  (:mod:`qkv.apps.web.onnx_graphs`; ``manifest.json``'s ``graphs`` names them by role:
  ``encoder`` the maps of one forward pass, ``source`` and ``decoder`` a translation's, and
  for a translator ``lens``, :mod:`qkv.apps.web.lens_graph`), ``weights.bin`` (their weights
  once, in the precision the Python API uses: fp16 as the translators ship, widened to fp32
  inside the graphs as ``qkv.translate.load`` widens them; MiniLM in fp32),
  ``tokenizer.json`` and ``manifest.json`` (the model's sizes, layer names, limits, files);
* ``ort/``: ONNX Runtime Web's WebAssembly-only bundle (``ort.wasm.min.js`` and its SIMD
  ``.wasm``; not the default bundle, which also fetches the 28 MB WebGPU build);
* ``engine/``: the engine's scripts (``static/`` beside this file), :data:`ENGINE_SCRIPTS`
  in the order a page loads them.

Each model is traced in a child process with qkv's compiled kernels off (``QKV_NATIVE=0``):
the tracer records graph operations only, and the kernels' Python-side helpers (call
signatures, the NaN/inf look) are not. Every graph is checked against PyTorch on a sentence
before it is kept (:func:`check_parity`); a model is written to a temporary folder and renamed
into place, so a failed export leaves nothing behind.

    python -m qkv.apps.web.export DIR en-fr     # one model, as the site build does
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["ENGINE_SCRIPTS", "MODELS", "ORT_FILES", "check_parity", "export_model",
           "export_site_models", "ort_dist"]  # fmt: skip

# the models the page can run, named and ordered as in qkv serve's registry
MODELS = ("minilm", "random", "en-fr", "fr-en")

# ONNX Runtime Web's WebAssembly build, single-threaded SIMD (the threaded build needs
# cross-origin isolation, which GitHub Pages cannot give); the .mjs is its loader
ORT_FILES = ("ort.wasm.min.js", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm")

# paths relative to the site root, in load order: the runtime, the tokenizers, the engine
ENGINE_SCRIPTS = ["ort/ort.wasm.min.js", "engine/tokenize.js", "engine/runtime.js",
                  "engine/decode.js", "engine/answer.js", "engine/long-answer.js", "engine/text.js",
                  "engine/local-engine.js"]  # fmt: skip

STATIC = Path(__file__).parent / "static"
# the largest file a site may hold (GitHub refuses files over 100 MiB; Pages serves a site
# from the repository's artifact): MiniLM's fp32 weights are 90.1 MB
MAX_FILE_BYTES = 95_000_000
OPSET = 17
# the sentence every export is checked on, in the model's source language
PARITY_TEXTS = {"en": "Two dogs play in the snow near a big red house.",
                "fr": "Deux chiens jouent dans la neige près d'une grande maison rouge."}  # fmt: skip


def ort_dist() -> Path:
    """``onnxruntime-web``'s ``dist/`` as ``npm ci --prefix web`` installs it from the
    repository's lock file (``QKV_ORT_DIST`` names another folder)."""
    env = os.environ.get("QKV_ORT_DIST")
    root = Path(__file__).resolve().parents[4]  # src/qkv/apps/web -> the repository
    dist = Path(env) if env else root / "web" / "node_modules" / "onnxruntime-web" / "dist"
    missing = [f for f in ORT_FILES if not (dist / f).is_file()]
    if missing:
        raise FileNotFoundError(f"ONNX Runtime Web is not installed: {dist} lacks "
                                f"{', '.join(missing)}; run `npm ci --prefix web` in the "
                                "repository (or set QKV_ORT_DIST to its dist/ folder)")  # fmt: skip
    return dist


def _check_names(names: list[str]) -> None:
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"names must be a list of model names, got {names!r}")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise ValueError(f"names must be among {sorted(MODELS)}, got {unknown}")


def export_site_models(out: Path, names: list[str],
                       progress: Callable[[str], object] = print) -> list[dict]:  # fmt: skip
    """Write the models ``names`` (of :data:`MODELS`), the runtime and the engine's scripts
    under ``out``; one dict per model: ``name``, ``bytes`` (what the page downloads for it),
    ``files`` (paths relative to ``out``) and the manifest's ``label``."""
    _check_names(names)
    dist = ort_dist()  # before anything is written
    scripts = [STATIC / Path(s).name for s in ENGINE_SCRIPTS[1:]]
    missing = [str(f) for f in scripts if not f.is_file()]
    if missing:  # an install without the package data: say so, write nothing
        raise FileNotFoundError(f"the engine's scripts are missing: {', '.join(missing)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for sub, files in (("ort", [dist / f for f in ORT_FILES]), ("engine", scripts)):
        (out / sub).mkdir(exist_ok=True)
        for f in files:
            _copy(f, out / sub / f.name)
    result = []
    for name in names:
        progress(f"exporting {name} (traced from PyTorch, checked against it)")
        env = {**os.environ, "QKV_NATIVE": "0"}
        proc = subprocess.run([sys.executable, "-m", "qkv.apps.web.export", str(out), name],
                              env=env, capture_output=True, text=True)  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"exporting {name} failed:\n{proc.stderr.strip()[-3000:]}")
        manifest = json.loads((out / "models" / name / "manifest.json").read_text("utf-8"))
        files = [f"models/{name}/{f}" for f in manifest["files"]]
        big = [f for f in files if (out / f).stat().st_size > MAX_FILE_BYTES]
        if big:
            raise RuntimeError(f"exporting {name}: {', '.join(big)} larger than "
                               f"{MAX_FILE_BYTES / 1e6:.0f} MB")  # fmt: skip
        size = sum((out / f).stat().st_size for f in files)
        progress(f"  {name}: {size / 1e6:.1f} MB")
        result.append({"name": name, "bytes": size, "files": files, "label": manifest["label"]})
    # the models this site holds, in the registry's order: what the engine offers
    held = [n for n in MODELS if (out / "models" / n / "manifest.json").is_file()]
    tmp = out / "models" / "index.json.part"
    tmp.write_text(json.dumps({"models": held}), "utf-8")
    tmp.replace(out / "models" / "index.json")
    return result


def _copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".part")
    shutil.copyfile(src, tmp)
    tmp.replace(dst)


def _loaded(name: str):
    """``(registry entry info, Loaded, {graph: Spec}, tokenizer.json path, tokenizer kind)``."""
    import torch

    from qkv.apps.serve.models import default_registry
    from qkv.apps.web.onnx_graphs import encoder_spec, seq2seq_spec, tiny_seq2seq_spec

    reg = default_registry()
    entry = reg.get(name)
    info = entry.info()
    loaded = entry.loaded
    if name == "minilm":
        bert = loaded.model

        def hidden(ids):  # qkv.inspect.minilm's hidden: one sentence, no padding
            return bert(ids, attention_mask=torch.ones_like(ids)).last_hidden_state

        path = Path(bert.tokenizer.name_or_path) / "tokenizer.json"
        return info, loaded, {"encoder": encoder_spec(bert, hidden)}, path, "wordpiece"
    if name == "random":
        specs = {"encoder": encoder_spec(loaded.model, loaded.model),
                 "source": tiny_seq2seq_spec(loaded.full_model)}  # fmt: skip
        specs["decoder"] = specs["source"]
        return info, loaded, specs, None, "hashed"
    from qkv.models.shipped import shipped_dir

    spec = seq2seq_spec(loaded.full_model)
    path = shipped_dir(name) / "tokenizer.json"
    return info, loaded, {"encoder": spec, "source": spec, "decoder": spec}, path, "bpe"


def export_model(out: Path, name: str) -> dict:
    """Export model ``name`` into ``out/models/<name>/`` (run with ``QKV_NATIVE=0``: see the
    module docstring); returns its manifest."""
    import torch

    from qkv.apps.serve.compute import translator_limit
    from qkv.apps.serve.decoding import page_settings
    from qkv.apps.serve.limits import LONG_TOKEN_LIMIT
    from qkv.apps.serve.long import map_limit, position_limit
    from qkv.apps.web.onnx_graphs import DecoderGraph, EncoderGraph, graph_io
    from qkv.apps.web.weights import shared_weights
    from qkv.positional import SinusoidalPositionalEncoding

    _check_names([name])
    info, loaded, specs, tokenizer, tok_kind = _loaded(name)
    # every position a page may ask for, in the traced table: the model's own, or as many as
    # the explorer shows at most
    table = position_limit(loaded.full_model or loaded.model) or LONG_TOKEN_LIMIT
    for spec in specs.values():
        spec.model.eval().requires_grad_(False)
        for m in spec.model.modules():
            if isinstance(m, SinusoidalPositionalEncoding):
                m.table(table)
    final = Path(out) / "models" / name
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
    tmp.chmod(0o755)  # a web server serves it (mkdtemp makes it private)
    try:
        paths: dict[str, Path] = {}
        files: dict[str, str] = {}
        for role, spec in specs.items():
            kind = "decoder" if role == "decoder" else "encoder"
            same = [r for r in paths if specs[r] is spec and (r == "decoder") == (role == "decoder")]
            if same:  # the translators' encoder serves the encoder view and translation
                files[role] = files[same[0]]
                continue
            graph = (DecoderGraph if kind == "decoder" else EncoderGraph)(spec)
            args, inputs, outputs, dynamic = graph_io(kind, spec)
            paths[role] = tmp / f"{role}.fp32.onnx"
            files[role] = f"{role}.onnx"
            with torch.no_grad():
                torch.onnx.export(graph.eval(), args, str(paths[role]), dynamo=False,
                                  opset_version=OPSET, input_names=inputs,
                                  do_constant_folding=False, output_names=outputs,
                                  dynamic_axes=dynamic)  # fmt: skip
        if name in ("en-fr", "fr-en"):  # the Lens view reads a translator's decoder
            from qkv.apps.web.lens_graph import LensGraph, lens_io

            args, inputs, outputs, dynamic = lens_io(loaded.full_model)
            paths["lens"], files["lens"] = tmp / "lens.fp32.onnx", "lens.onnx"
            with torch.no_grad():
                torch.onnx.export(LensGraph(loaded.full_model).eval(), args, str(paths["lens"]),
                                  dynamo=False, opset_version=OPSET, input_names=inputs,
                                  do_constant_folding=False, output_names=outputs,
                                  dynamic_axes=dynamic)  # fmt: skip
        shared_weights({r: p for r, p in paths.items()}, tmp, "weights.bin")
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / "tokenizer.json")
        s2s = specs.get("decoder")
        model = loaded.full_model or loaded.model
        positions = position_limit(model)
        enc = specs["encoder"]
        manifest = {
            **{k: info[k] for k in ("name", "label", "label_key", "translator", "random")},
            "tokenizer": tok_kind, "graphs": files,
            "encoder": {"layers": [n for n, _ in enc.encoder], **enc.dims(),
                        "limit": map_limit(positions), "positions": positions},
            "files": sorted({*files.values(), "weights.bin",
                             *(["tokenizer.json"] if tokenizer is not None else [])}),
        }  # fmt: skip
        if s2s is not None:
            m = s2s.model
            cfg = getattr(m, "cfg", None)
            manifest["translation"] = {
                "layers": [n for n, _ in _attention_names(m)], **s2s.dims(),
                "limit": translator_limit(m),
                "vocab_size": cfg.tgt_vocab_size if cfg else m.vocab_size,
                "max_len": cfg.max_len if cfg else None,
                "pad_id": cfg.pad_id if cfg else None, "bos_id": cfg.bos_id if cfg else 3,
                "eos_id": cfg.eos_id if cfg else 4,
                # qkv translate's guards and notes (the random model: none)
                **(page_settings(loaded) if cfg else {"no_repeat_ngram": 0, "repeat_guard": False}),
            }  # fmt: skip
        if "lens" in files:
            from qkv.apps.serve.compute_lens import NOTE
            from qkv.apps.web.lens_graph import TOP_K, lens_names

            manifest["lens"] = {**lens_names(loaded.full_model), "top_k": TOP_K, "note": NOTE}
        manifest["sha256"] = {f: hashlib.sha256((tmp / f).read_bytes()).hexdigest()
                              for f in manifest["files"]}  # fmt: skip
        check_parity(tmp, manifest, specs, loaded)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1), "utf-8")
        if final.exists():
            shutil.rmtree(final)
        tmp.replace(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _attention_names(model) -> list[tuple[str, object]]:
    from qkv.capture.record import attention_modules

    return attention_modules(model)


def _source_ids(name: str, loaded, text: str):
    """A translation's source ids ``(1, S)``, as qkv.apps.serve.compute.decode_translation
    makes them."""
    import torch

    if name == "random":
        from qkv.inspect.tiny import simple_tokenize, token_id

        words = ["<s>", *simple_tokenize(text), "</s>"]
        return torch.tensor([[token_id(t, loaded.full_model.vocab_size) for t in words]])
    return loaded.encode(text)[1][0]


def check_parity(folder: Path, manifest: dict, specs: dict, loaded, tol: float = 1e-4) -> float:
    """Run the graphs in ``folder`` (onnxruntime) on a sentence and compare with PyTorch:
    the encoder's output and every layer's weights; for a translator, greedy decoding step by
    step over the graphs' caches against the teacher-forced PyTorch forward of the same tokens
    (every step's logits, its argmax, every weight). Raises if anything differs by more than
    ``tol``; returns the largest difference."""
    import numpy as np
    import onnxruntime as ort
    import torch

    from qkv.capture.maps import merge_steps
    from qkv.capture.record import recording

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    graphs = manifest["graphs"]
    session = {r: ort.InferenceSession(str(folder / f), opts) for r, f in graphs.items()}
    worst = 0.0

    def close(what: str, a, b) -> None:
        nonlocal worst
        diff = float(np.abs(np.asarray(a) - np.asarray(b)).max())
        worst = max(worst, diff)
        if not diff <= tol:
            raise AssertionError(f"{what}: the graph differs from PyTorch by {diff:.3g} > {tol}")

    def run(role: str, feeds: dict) -> dict:
        sess = session[role]
        names = {i.name for i in sess.get_inputs()}
        out = sess.run(None, {k: v for k, v in feeds.items() if k in names})
        return dict(zip([o.name for o in sess.get_outputs()], out))

    text = PARITY_TEXTS["fr" if manifest["name"] == "fr-en" else "en"]
    enc = specs["encoder"]
    d = enc.dims()
    ids = loaded.encode(text)[1][0]  # (1, S)
    e = run("encoder", {"src": ids.numpy(), "head_mask": np.ones((d["n_encoder_layers"], d["n_heads"]), np.float32)})
    with torch.no_grad(), recording(enc.model) as rec:
        close("encoder output", e["memory"], enc.encode(ids))
    maps = merge_steps(rec.steps())
    for i, (n, _) in enumerate(enc.encoder):
        close(f"{n} weights", e["weights"][i, 0], maps.weights[maps.index(n)])
    if "decoder" not in specs:
        return worst
    s2s, t = specs["decoder"], manifest["translation"]
    L, h, kv, d_k = t["n_decoder_layers"], t["n_heads"], t["n_kv_heads"], t["d_k"]
    src = _source_ids(manifest["name"], loaded, text)
    S = src.shape[1]
    e = run("source", {"src": src.numpy(), "head_mask": np.ones((t["n_encoder_layers"], h), np.float32)})
    past = np.zeros((L, 1, kv, 0, d_k), np.float32)
    pk, pv, tok, steps = past, past.copy(), t["bos_id"], []
    for _ in range(min(2 * S + 10, 24)):
        out = run("decoder", {"tgt": np.array([[tok]]), "memory_mask": np.ones((1, 1, 1, S), bool),
                              "past_k": pk, "past_v": pv, "memory_k": e["memory_k"],
                              "memory_v": e["memory_v"], "head_mask": np.ones((2 * L, h), np.float32)})  # fmt: skip
        steps.append(out)
        pk, pv, tok = out["next_k"], out["next_v"], int(out["logits"][0].argmax())
        if tok == t["eos_id"]:
            break
    tgt = [t["bos_id"]] + [int(o["logits"][0].argmax()) for o in steps[:-1]]
    with torch.no_grad(), recording(s2s.model) as rec:
        logits = s2s.model(src, torch.tensor([tgt]))[0]  # (T, V)
    maps = merge_steps(rec.steps())
    for j, o in enumerate(steps):
        close(f"step {j} logits", o["logits"][0], logits[j])
        if int(o["logits"][0].argmax()) != int(logits[j].argmax()):
            raise AssertionError(f"step {j}: the graph's token differs from PyTorch's")
    if "lens" in session:  # the lens graph against qkv.inspect.lens.lens on the same run
        from qkv.inspect.lens import lens

        n_all = t["n_encoder_layers"] + 2 * L
        for p in (0, len(tgt) - 1):
            o = run("lens", {"src": src.numpy(), "tgt": np.array([tgt]), "position": np.array(p),
                             "head_mask": np.ones((n_all, h), np.float32)})  # fmt: skip
            ref = lens(s2s.model, src, torch.tensor([tgt]), position=p, top_k=manifest["lens"]["top_k"])
            if not (o["lens_ids"] == ref.top_ids.numpy()).all() or int(o["target"]) != ref.target:
                raise AssertionError(f"lens at position {p}: the graph's top tokens differ")
            close(f"lens probabilities at {p}", o["lens_probs"], ref.top_probs)
            close(f"head attributions at {p}", o["head_target"], [x.target for x in ref.heads])
            close(f"other attributions at {p}", o["others"], [v for _, v in ref.others])
    T = len(steps)
    for i in range(L):
        self_w = np.zeros((h, T, T), np.float32)
        for j, o in enumerate(steps):
            self_w[:, j, : j + 1] = o["self.weights"][i, 0, :, 0]
        cross_w = np.concatenate([o["cross.weights"][i, 0] for o in steps], axis=1)
        close(f"decoder layer {i} self weights", self_w, maps.weights[maps.index(f"decoder.layers.{i}.self_attn")])
        close(f"decoder layer {i} cross weights", cross_w, maps.weights[maps.index(f"decoder.layers.{i}.cross_attn")])
    return worst


if __name__ == "__main__":  # python -m qkv.apps.web.export DIR NAME (one model)
    if len(sys.argv) != 3:
        print("usage: python -m qkv.apps.web.export DIR NAME", file=sys.stderr)
        sys.exit(2)
    export_model(Path(sys.argv[1]), sys.argv[2])
