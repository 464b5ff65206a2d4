"""The in-page engine's files: the shipped models as ONNX graphs, their tokenizers, the
runtime and the engine's scripts, written into a static site.

:func:`export_site_models` writes, under ``out``:

* ``models/<name>/``: ``encoder.onnx`` and ``decoder.onnx`` (:mod:`qkv.apps.web.onnx_graphs`,
  traced from the PyTorch modules), ``weights.bin`` (their weights once, in the precision the
  package ships them: fp16 for the translators, widened to fp32 inside the graphs as
  ``qkv.translate.load`` widens them), ``tokenizer.json`` and ``manifest.json`` (the
  model's sizes, layer names, limits and files);
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

# the models the page can run: name -> the argument of qkv.translate.load
MODELS = {"en-fr": "en-fr", "fr-en": "fr-en"}

# ONNX Runtime Web's WebAssembly build, single-threaded SIMD (the threaded build needs
# cross-origin isolation, which GitHub Pages cannot give); the .mjs is its loader
ORT_FILES = ("ort.wasm.min.js", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm")

# paths relative to the site root, in load order: the runtime, the tokenizers, the engine
ENGINE_SCRIPTS = ["ort/ort.wasm.min.js", "engine/tokenize.js", "engine/runtime.js",
                  "engine/decode.js", "engine/answer.js", "engine/local-engine.js"]  # fmt: skip

STATIC = Path(__file__).parent / "static"
OPSET = 17
# a sentence every export is checked on (the notes' sentence and a longer one)
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
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for sub, files in (("ort", [dist / f for f in ORT_FILES]),
                       ("engine", [STATIC / Path(s).name for s in ENGINE_SCRIPTS[1:]])):  # fmt: skip
        (out / sub).mkdir(exist_ok=True)
        for f in files:
            if f.is_file():  # tokenize.js: another module's, absent until it lands
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
        size = sum((out / f).stat().st_size for f in files)
        progress(f"  {name}: {size / 1e6:.1f} MB")
        result.append({"name": name, "bytes": size, "files": files, "label": manifest["label"]})
    return result


def _copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".part")
    shutil.copyfile(src, tmp)
    tmp.replace(dst)


def export_model(out: Path, name: str) -> dict:
    """Export model ``name`` into ``out/models/<name>/`` (run with ``QKV_NATIVE=0``: see the
    module docstring); returns its manifest."""
    import torch

    from qkv.apps.serve.compute import translator_limit
    from qkv.apps.web.onnx_graphs import DecoderGraph, EncoderGraph, graph_io
    from qkv.apps.web.weights import shared_fp16
    from qkv.translate import NO_REPEAT_NGRAM, load

    _check_names([name])
    tr = load(MODELS[name])
    model = tr.model.eval().requires_grad_(False)
    cfg = model.cfg
    for embed in (model.encoder.embed, model.decoder.embed):  # every position, traced once
        embed.position.table(cfg.max_len)
    final = Path(out) / "models" / name
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
    tmp.chmod(0o755)  # a web server serves it (mkdtemp makes it private)
    try:
        graphs = {}
        for kind, graph in (("encoder", EncoderGraph(model)), ("decoder", DecoderGraph(model))):
            args, inputs, outputs, dynamic = graph_io(kind, model)
            path = tmp / f"{kind}.fp32.onnx"
            with torch.no_grad():
                torch.onnx.export(graph.eval(), args, str(path), dynamo=False,
                                  opset_version=OPSET, input_names=inputs, do_constant_folding=False,
                                  output_names=outputs, dynamic_axes=dynamic)  # fmt: skip
            graphs[kind] = path
        shared_fp16(graphs, tmp, "weights.bin")  # -> encoder.onnx, decoder.onnx, weights.bin
        shutil.copyfile(tr.path / "tokenizer.json", tmp / "tokenizer.json")
        layers = [n for n, _ in _attention_names(model)]
        manifest = {
            "name": name, "kind": "seq2seq", "label": f"translator {name}",
            "src": tr.src, "tgt": tr.tgt,
            "config": {"d_model": cfg.d_model, "n_heads": cfg.n_heads, "d_k": cfg.d_k,
                       "n_kv_heads": cfg.kv_heads, "n_encoder_layers": cfg.n_encoder_layers,
                       "n_decoder_layers": cfg.n_decoder_layers, "max_len": cfg.max_len,
                       "vocab_size": cfg.tgt_vocab_size, "pad_id": cfg.pad_id,
                       "bos_id": cfg.bos_id, "eos_id": cfg.eos_id},
            "layers": layers, "limit": translator_limit(model),
            "no_repeat_ngram": NO_REPEAT_NGRAM,
            "files": ["encoder.onnx", "decoder.onnx", "weights.bin", "tokenizer.json"],
            "sha256": {},
        }  # fmt: skip
        manifest["sha256"] = {f: hashlib.sha256((tmp / f).read_bytes()).hexdigest()
                              for f in manifest["files"]}  # fmt: skip
        check_parity(tmp, model, tr.tokenizer, PARITY_TEXTS.get(tr.src or "en", PARITY_TEXTS["en"]))
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


def check_parity(folder: Path, model, tokenizer, text: str, tol: float = 1e-4) -> float:
    """Greedy-decode ``text`` with the graphs in ``folder`` (onnxruntime) and with ``model``
    step by step over its own cache; raise if the tokens differ or any logit or attention
    weight differs by more than ``tol``. Returns the largest difference."""
    import numpy as np
    import onnxruntime as ort
    import torch

    from qkv.capture.maps import merge_steps
    from qkv.capture.record import recording

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    enc = ort.InferenceSession(str(folder / "encoder.onnx"), opts)
    dec = ort.InferenceSession(str(folder / "decoder.onnx"), opts)
    cfg = model.cfg
    L_enc, L_dec, h = cfg.n_encoder_layers, cfg.n_decoder_layers, cfg.n_heads
    src = torch.tensor([tokenizer.encode(text) + [tokenizer.eos_id]])  # (1, S)
    S = src.shape[1]
    e = dict(zip([o.name for o in enc.get_outputs()],
                 enc.run(None, {"src": src.numpy(), "head_mask": np.ones((L_enc, h), np.float32)})))  # fmt: skip
    worst = 0.0

    def close(name: str, a, b) -> None:
        nonlocal worst
        diff = float(np.abs(np.asarray(a) - b.numpy()).max())
        worst = max(worst, diff)
        if not diff <= tol:
            raise AssertionError(f"{name}: the graph differs from PyTorch by {diff:.3g} > {tol}")

    with torch.no_grad(), recording(model) as rec:
        mask = model.src_mask(src)
        memory = model.encode(src, mask)
        close("memory", e["memory"], memory)
        cache = model.new_cache()
        past = np.zeros((L_dec, 1, cfg.kv_heads, 0, cfg.d_k), np.float32)
        pk, pv, tok, rows = past, past.copy(), cfg.bos_id, []
        for _ in range(2 * S + 10):
            logits = model.decode(torch.tensor([[tok]]), memory, mask, cache=cache)[0, -1]
            d = dict(zip([o.name for o in dec.get_outputs()], dec.run(None, {
                "tgt": np.array([[tok]]), "memory_mask": np.ones((1, 1, 1, S), bool),
                "past_k": pk, "past_v": pv, "memory_k": e["memory_k"], "memory_v": e["memory_v"],
                "head_mask": np.ones((2 * L_dec, h), np.float32)})))  # fmt: skip
            close("logits", d["logits"][0], logits)
            rows.append(d)
            pk, pv = d["next_k"], d["next_v"]
            ours, theirs = int(d["logits"][0].argmax()), int(logits.argmax())
            if ours != theirs:
                raise AssertionError(f"greedy token differs: graph {ours}, PyTorch {theirs}")
            tok = ours
            if tok == cfg.eos_id:
                break
    maps = merge_steps(rec.steps())  # each layer's rows over the steps: (h, T, Tk)
    T = len(rows)
    for i in range(L_enc):
        close(f"encoder layer {i} weights", e["weights"][i, 0],
              maps.weights[maps.index(f"encoder.layers.{i}.self_attn")])  # fmt: skip
    for i in range(L_dec):
        self_w = np.zeros((h, T, T), np.float32)
        for t, d in enumerate(rows):
            self_w[:, t, : t + 1] = d["self.weights"][i, 0, :, 0]
        cross_w = np.concatenate([d["cross.weights"][i, 0] for d in rows], axis=1)
        close(f"decoder layer {i} self weights", self_w,
              maps.weights[maps.index(f"decoder.layers.{i}.self_attn")])  # fmt: skip
        close(f"decoder layer {i} cross weights", cross_w,
              maps.weights[maps.index(f"decoder.layers.{i}.cross_attn")])  # fmt: skip
    return worst


if __name__ == "__main__":  # python -m qkv.apps.web.export DIR NAME (one model)
    if len(sys.argv) != 3:
        print("usage: python -m qkv.apps.web.export DIR NAME", file=sys.stderr)
        sys.exit(2)
    export_model(Path(sys.argv[1]), sys.argv[2])
