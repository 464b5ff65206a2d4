"""Which engine runs the explorer's models in the page: MiniLM's forward (6 layers, d_model 384,
12 heads) in headless chromium, one page, one run, on

- ONNX Runtime Web (WebAssembly with SIMD, one thread) with the site's exported graph
  (``qkv.apps.web.export``), as the site's runtime makes its session: every output (what the
  site asks for: each step of every head) and the hidden state alone;
- ``bench/web_engines/encoder.js``, the same encoder in plain JavaScript on typed arrays.

Each engine's hidden state is checked against PyTorch's (qkv's ``BertModel``, fp32; and its
fp64 copy) before its time is reported: a figure of an engine that strays past ``TOL`` says so.

    python bench/web_engines.py                                   # exports MiniLM's graph (~30 s)
    python bench/web_engines.py --site site/live --out bench/results/web_engines.md

``--site``: a site built by ``qkv web build`` with MiniLM (its ``models/minilm/`` and ``ort/``
are used as they are).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import machine_header  # noqa: E402
from qkv.atomic import atomic_write_text  # noqa: E402
from web import BenchError, chromium, site_server  # noqa: E402

HERE = Path(__file__).resolve().parent / "web_engines"
LENGTHS = (16, 128)
REPS = {16: 15, 128: 5}  # timed runs per engine (after WARM)
WARM = 2
TOL = 1e-4  # the largest |engine − PyTorch fp32| of the hidden state a timing is reported for
SEED = 20261129


def _model():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from qkv.apps.serve.models import default_registry

    return default_registry().get("minilm").loaded.model


def cases(vocab: int) -> list[dict]:
    """``[CLS] … [SEP]`` of T tokens each, word ids from a fixed seed (no padding)."""
    rng = np.random.default_rng(SEED)
    return [{"T": t, "ids": [101, *rng.integers(1000, vocab, t - 2).tolist(), 102]} for t in LENGTHS]


def references(bert, cs: list[dict]) -> dict:
    """PyTorch's last hidden state of each case, fp32 and fp64: ``{T: (fp32, fp64)}``."""
    import copy

    import torch

    wide = copy.deepcopy(bert).double()
    out = {}
    with torch.no_grad():
        for c in cs:
            ids = torch.tensor([c["ids"]])
            ones = torch.ones_like(ids)
            out[c["T"]] = (bert(ids, attention_mask=ones).last_hidden_state[0].numpy(),
                           wide(ids, attention_mask=ones).last_hidden_state[0].numpy())  # fmt: skip
    return out


def write_weights(bert, folder: Path) -> dict:
    """The state dict as one fp32 file and its layout (encoder.js reads them)."""
    folder.mkdir(parents=True)
    tensors, parts, offset = {}, [], 0
    for name, t in bert.state_dict().items():
        if not name.startswith(("embeddings.", "encoder.")):
            continue  # the pooler: not part of the hidden state
        a = t.detach().float().contiguous().numpy().ravel()
        tensors[name] = [offset, list(t.shape)]
        parts.append(a)
        offset += a.size
    np.concatenate(parts).astype("<f4").tofile(folder / "minilm.f32")
    cfg = bert.config
    layout = {"config": {"d_model": cfg.d_model, "n_heads": cfg.n_heads, "d_ff": cfg.d_ff,
                         "n_layers": cfg.n_layers, "eps": cfg.layer_norm_eps}, "tensors": tensors}  # fmt: skip
    (folder / "layout.json").write_text(json.dumps(layout))
    return layout


def prepare(root: Path, site: Path | None) -> Path:
    """The page's folder: this bench's files, the site's ORT runtime and MiniLM (exported here
    without ``--site``)."""
    if site is None:
        from qkv.apps.web.export import export_site_models

        site = root / "export"
        export_site_models(site, ["minilm"], progress=lambda line: print(line, flush=True))
    page = root / "page"
    page.mkdir()
    for f in HERE.iterdir():
        shutil.copyfile(f, page / f.name)
    (page / "models").mkdir()
    (page / "ort").symlink_to((site / "ort").resolve())
    (page / "models" / "minilm").symlink_to((site / "models" / "minilm").resolve())
    return page


def run_page(url: str, cs: list[dict], layers: int, heads: int) -> tuple[dict, str]:
    with chromium() as browser:
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{url}/index.html")
        page.wait_for_function("() => typeof window.runBench === 'function'")
        page.set_default_timeout(600_000)
        cfg = {"cases": cs, "reps": {str(k): v for k, v in REPS.items()}, "warm": WARM,
               "layers": layers, "heads": heads}  # fmt: skip
        try:
            res = page.evaluate("(cfg) => runBench(cfg)", cfg)
        except Exception as e:  # noqa: BLE001 — the page's own error says more
            raise BenchError(f"the page failed: {errors or e}") from None
        return res, browser.version


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ms (best {min(xs):.1f})"


def report(res: dict, refs: dict, sizes: dict, header: str, version: str, when: datetime,
           loads: tuple[float, float]) -> str:  # fmt: skip
    lines = [
        "# MiniLM's forward in the page: ONNX Runtime Web against plain JavaScript",
        "",
        f"Command: `python bench/web_engines.py {' '.join(sys.argv[1:])}`".rstrip() + "  ",
        f"Date: {when:%Y-%m-%d %H:%M} UTC; load average (1 min) {loads[0]:.1f} at start, {loads[1]:.1f} at the end  ",
        f"Browser: Debian's chromium {version}, headless (Playwright), one page, the engines one after the other",
        "",
        "```",
        header,
        "```",
        "",
        f"MiniLM (all-MiniLM-L6-v2: 6 layers, d_model 384, 12 heads of 32, d_ff 1536), one sentence of T tokens "
        f"(`[CLS]`, word ids from a fixed seed, `[SEP]`; no padding). Times: {WARM} warm-up runs, then "
        f"{REPS[16]} (T = 16) or {REPS[128]} (T = 128) timed, median (best). Error: the largest |engine − PyTorch| "
        f"of the last hidden state (T × 384), against qkv's `BertModel` in fp32 and in fp64; "
        f"a time is reported only for an engine within {TOL:g} of fp32.",
        "",
        "| T | engine | forward | max error vs PyTorch fp32 | vs fp64 | last layer's weights vs ORT's |",
        "|---|---|---|---|---|---|",
    ]
    for r in res["runs"]:
        f32, f64 = refs[r["T"]]
        w_ort = np.array(r["ort_weights"])
        for name, key, hid in (("ONNX Runtime Web, every output (as the site asks)", "ort_all_ms", "ort_all_hidden"),
                               ("ONNX Runtime Web, the hidden state alone", "ort_hidden_ms", "ort_hidden"),
                               ("plain JS (`web_engines/encoder.js`)", "js_ms", "js_hidden")):  # fmt: skip
            h = np.array(r[hid], dtype=np.float64).reshape(f32.shape)
            e32, e64 = np.abs(h - f32).max(), np.abs(h - f64).max()
            w = "–" if key != "js_ms" else f"{np.abs(np.array(r['js_weights']) - w_ort).max():.1e}"
            time = _ms(r[key]) if e32 <= TOL else f"**not reported: error {e32:.1e} > {TOL:g}**"
            lines.append(f"| {r['T']} | {name} | {time} | {e32:.1e} | {e64:.1e} | {w} |")
    by_t = {r["T"]: r for r in res["runs"]}
    ratio = ", ".join(f"T = {t}: {statistics.median(by_t[t]['js_ms']) / statistics.median(by_t[t]['ort_all_ms']):.1f}×"
                      for t in LENGTHS if t in by_t)  # fmt: skip
    lines += [
        "",
        f"Plain JS / ONNX Runtime Web (every output): {ratio}.  ",
        f"Making the engine: ONNX Runtime Web's session {res['load']['ort_ms']:.0f} ms (the graph and "
        f"weights fetched from 127.0.0.1, its WebAssembly compiled); encoder.js {res['load']['js_ms']:.0f} ms "
        "(its weights fetched).",
        "",
        "| download | bytes |",
        "|---|---|",
        *[f"| {k} | {v / 1e6:.2f} MB |" for k, v in sizes.items()],
        "",
    ]
    return "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--site", type=Path, help="a site qkv web build wrote with minilm (default: export MiniLM here)")
    p.add_argument("--out", type=Path, help="also write the markdown here")
    args = p.parse_args(argv)
    if args.site is not None and not (args.site / "models" / "minilm" / "encoder.onnx").is_file():
        p.error(f"--site must be a site built with minilm (models/minilm/encoder.onnx), got {args.site}")
    if args.out is not None and not args.out.parent.is_dir():
        p.error(f"--out: its folder {args.out.parent} does not exist")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    when, load0 = datetime.now(UTC), os.getloadavg()[0]
    header = machine_header()
    print(header, flush=True)
    bert = _model().eval()
    cs = cases(bert.config.vocab_size)
    refs = references(bert, cs)
    root = Path(tempfile.mkdtemp(prefix="qkv-web-engines-"))
    try:
        page = prepare(root, args.site)
        layout = write_weights(bert, page / "weights")
        with site_server(page) as url:
            res, version = run_page(url, cs, layout["config"]["n_layers"], layout["config"]["n_heads"])
        ort_files = sorted((page / "ort").iterdir())
        sizes = {
            "ONNX Runtime Web (" + ", ".join(f.name for f in ort_files) + ")": sum(f.stat().st_size for f in ort_files),
            "MiniLM's graph and weights for it (models/minilm: encoder.onnx, weights.bin)":
                sum((page / "models" / "minilm" / f).stat().st_size for f in ("encoder.onnx", "weights.bin")),
            "encoder.js": (page / "encoder.js").stat().st_size,
            "MiniLM's fp32 weights for encoder.js": (page / "weights" / "minilm.f32").stat().st_size,
        }  # fmt: skip
        text = report(res, refs, sizes, header, version, when, (load0, os.getloadavg()[0]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(text)
    if args.out is not None:
        atomic_write_text(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
