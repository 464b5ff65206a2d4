"""Turn a ``qkv train`` run into a shipped model: compact weights, tokenizer, model card.

    python scripts/ship_translator.py /work/runs/enfr en-fr --commit c90958c

A run trained on another machine and brought back as ``best/`` and ``log.jsonl`` alone (no
``last/``, whose optimizer state is large) is shipped with ``--command``, the ``qkv train``
command it was started with, and ``--machine``, where it ran.

Picks the run's ``best/`` or the average of its last epochs (``--average N``), whichever has
the higher BLEU on all of val (greedy), or the kept epoch ``--epoch N``; tunes the length penalty for beam search on val;
stores the weights in float16 (or ``--storage int8-rows``: each weight matrix row in int8 with a
scale, :mod:`qkv.models.int8_rows`) under ``src/qkv/models/shipped/NAME``; evaluates the shipped
files themselves (what users load) on val, test_2016_flickr and test_2017_flickr, greedy and
beam; writes ``README.md`` (the model card) and ``generation.json``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch

from qkv.apps.train import STATE_FILE, average_epochs, bleu_chrf, load_pairs, parse_args
from qkv.data import Tokenizer, multi30k
from qkv.models import load_pretrained, save_pretrained
from qkv.models.shipped import HERE
from qkv.translate import GENERATION_FILE, load

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from _measure import cpu_name  # noqa: E402

SPLITS = ("val", "test_2016_flickr", "test_2017_flickr")
STORED = {"float16": "float16", "int8-rows": "int8-row"}
STORED_AS = {
    "float16": "in float16",
    "int8-rows": "as int8 rows, one fp32 scale per row of each weight matrix (qkv.models.int8_rows; "
    "the rest in float16), loaded back into float",
}
LANGUAGES = {"en": "English", "fr": "French", "de": "German", "cs": "Czech"}


def limits_section(src: str, tgt: str, vocab: int) -> list[str]:
    """The card's "what it is for" section: the training data, and what it is not for."""
    s, t = LANGUAGES.get(src, src), LANGUAGES.get(tgt, tgt)
    return [
        "## What it learned from, and what it is not for",
        "",
        f"- Trained on Multi30k task 1 only: 29,000 {s} captions of Flickr photos with their "
        f"{t} translations. Short, literal descriptions of people, animals and scenes (\"Two "
        "dogs play in the snow.\"): at most about 40 words, most under 20; a vocabulary of "
        f"{vocab:,} pieces.",
        "- For: short, everyday descriptive sentences, one at a time, and for studying how a "
        "small translator attends (`qkv serve`, `qkv tour`).",
        "- Not for: long sentences, several sentences that depend on each other, questions and "
        "dialogue, technical, legal, medical or formal text, names and words outside the "
        "captions, or anything where a wrong translation does harm. Outside its data it can "
        "write fluent nonsense; the checks below catch only the plain cases.",
        "- What `qkv.translate` does about it: no 4-gram of tokens is written twice (a sentence "
        "it cannot handle ends instead of looping), the output has at most 2·source + 10 "
        "tokens, a line in capitals is translated in sentence case and put back into capitals, "
        "and a line of more than 40 words or of many unknown words gets a warning (a note on "
        "stderr from `qkv translate`, `warnings` in `qkv serve`'s answer).",
        "",
    ]


def score(tr, pairs, beam: int, lenpen: float) -> tuple[float, float, float]:
    t0 = time.monotonic()
    hyps = tr([s for s, _ in pairs], beam=beam, length_penalty=lenpen)
    bleu, chrf = bleu_chrf(hyps, [t for _, t in pairs])
    return bleu, chrf, time.monotonic() - t0


def command_of(args: dict) -> str:
    """The ``qkv train`` command line that the saved arguments stand for."""
    skip = {"resume", "train_files", "val_files", "out", "no_progress"}
    parts = ["qkv", "train", "--out", "RUN"]
    for k, v in sorted(args.items()):
        if k in skip or v is None or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        parts += [flag] if v is True else [flag, str(v)]
    return shlex.join(parts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path)
    p.add_argument("name", help="shipped name, e.g. en-fr")
    p.add_argument("--commit", required=True, help="the commit the run was trained with")
    p.add_argument("--average", type=int, default=5)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--lenpens", type=float, nargs="+", default=[0.6, 1.0, 1.5])
    p.add_argument("--data", default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--note", default="", help="extra text for the card (what was tried)")
    p.add_argument("--epoch", type=int, default=None,
                   help="ship this kept epoch (RUN/epochs/epoch-NNN.safetensors) instead of "
                   "choosing between best/ and the average; say why in --note")  # fmt: skip
    p.add_argument("--command", help="the run's `qkv train ...` command (a run without last/)")
    p.add_argument("--machine", help="where the run was trained (default: this machine)")
    p.add_argument("--storage", choices=["float16", "int8-rows"], default="float16",
                   help="how the weights are stored (int8-rows: half float16's bytes)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    log = [json.loads(x) for x in (a.run / "log.jsonl").read_text().splitlines() if x.strip()]
    if a.command:
        words = shlex.split(a.command)
        if words[:2] != ["qkv", "train"]:
            p.error(f"--command must start with 'qkv train', got {a.command[:40]!r}")
        device = words[words.index("--device") + 1] if "--device" in words else None
        if device:  # (parse_args checks the device is here; the run's machine had it)
            i = words.index("--device")
            words = words[:i] + words[i + 2 :]
        targs = {**vars(parse_args(words[2:])), "device": device}
        end = max((r for r in log if "step" in r), key=lambda r: r["step"])
        full = max((r for r in log if "train_loss" in r), key=lambda r: r["step"])  # epochs' ends
        state = {"elapsed": end["elapsed_min"] * 60, "step": end["step"],
                 "epoch": full["epoch"], "pos": end["step"] - full["step"]}  # fmt: skip
    else:
        state = torch.load(a.run / "last" / STATE_FILE, map_location="cpu", weights_only=True)
        targs = state["args"]
    src, tgt = targs["src"], targs["tgt"]
    val = multi30k("val", src, tgt, a.data)
    tok = Tokenizer.load(a.run / "best" / "tokenizer.json")

    # 1. which weights: best/ or the average of the last epochs (all of val, greedy)
    from qkv.translate import Translator

    candidates = {"best": load_pretrained(a.run / "best")}
    snaps = sorted((a.run / "epochs").glob("epoch-*.safetensors"))[-a.average :]
    at_epoch = None  # the log record of the shipped epoch (--epoch)
    if a.epoch is not None:
        f = a.run / "epochs" / f"epoch-{a.epoch:03d}.safetensors"
        kept = [e.stem for e in sorted((a.run / "epochs").glob("epoch-*.safetensors"))]
        if not f.exists():
            print(f"ship: {f} not found; kept: {', '.join(kept)}", file=sys.stderr)
            return 2
        candidates = {f"epoch {a.epoch}": average_epochs(candidates["best"], [f]).eval()}
        at_epoch = next(r for r in log if r.get("epoch") == a.epoch and "val_bleu" in r)
        snaps = []
    if len(snaps) > 1:
        candidates[f"average of {len(snaps)} epochs ({snaps[0].stem}..{snaps[-1].stem})"] = (
            average_epochs(candidates["best"], snaps).eval()
        )
    choice = {}
    for name, m in candidates.items():
        choice[name] = score(Translator(m, tok), val, 1, 1.0)[0]
        print(f"val greedy BLEU, {name}: {choice[name]:.2f}", flush=True)
    picked = max(choice, key=choice.get)

    # 2. store (float16 or int8 rows: what users get), then evaluate those very files
    out = HERE / a.name
    if out.exists():
        shutil.rmtree(out)
    if a.storage == "int8-rows":
        save_pretrained(candidates[picked], out, tokenizer=tok, storage="int8-rows")
    else:
        save_pretrained(candidates[picked].half(), out, tokenizer=tok)
    tr = load(a.name)
    lenpen_scores = {lp: score(tr, val, a.beam, lp)[0] for lp in a.lenpens}
    lenpen = max(lenpen_scores, key=lenpen_scores.get)
    print(f"val beam {a.beam} BLEU by length penalty: {lenpen_scores} -> {lenpen}", flush=True)
    gen = {"src": src, "tgt": tgt, "beam": a.beam, "length_penalty": lenpen}
    (out / GENERATION_FILE).write_text(json.dumps(gen, indent=2) + "\n")
    tr = load(a.name)
    rows = []
    for split in SPLITS:
        pairs = multi30k(split, src, tgt, a.data)
        for beam, lp in ((1, 1.0), (a.beam, lenpen)):
            b, c, s = score(tr, pairs, beam, lp)
            rows.append((split, beam, lp, b, c, s, len(pairs)))
            print(f"{split} beam {beam}: BLEU {b:.2f} chrF {c:.2f} ({s:.1f}s)", flush=True)
    sub = multi30k("test_2016_flickr", src, tgt, a.data)[:200]
    tr.name_placeholders = False  # the model's own figure, as tests/models/test_shipped.py takes it
    sub_bleu = score(tr, sub, 1, 1.0)[0]
    tr.name_placeholders = True

    n_params = sum(p.numel() for p in tr.model.parameters())
    augment = targs.get("augment") or "none"
    augmented = "" if augment == "none" else (
        f" and the pairs `--augment {augment}` adds to them "
        f"({len(load_pairs(argparse.Namespace(**{**targs, 'data': a.data}), 'train')):,} in all)")
    hist = [r for r in log if "val_bleu" in r and "averaged" not in r]
    if at_epoch is not None:
        hist = [r for r in hist if r["epoch"] <= a.epoch]
        trained = (f"{at_epoch['elapsed_min']:.0f} min wall clock, {at_epoch['step']} updates, "
                   f"{a.epoch} epochs")  # fmt: skip
    else:
        trained = (f"{state['elapsed'] / 60:.0f} min wall clock, {state['step']} updates, "
                   f"{state['epoch']} epochs and {state['pos']} batches")  # fmt: skip
    card = [
        f"# qkv translator {a.name}: {src} → {tgt}",
        "",
        f"A {n_params / 1e6:.2f}M-parameter encoder–decoder built from qkv's own modules and "
        f"trained with `qkv train` on Multi30k task 1 ({src}→{tgt}, 29,000 training pairs).",
        "",
        "```python",
        "import qkv.translate",
        f'tr = qkv.translate.load("{a.name}")',
        "```",
        "",
        f"## Scores (sacreBLEU 13a, detokenised, cased; the {STORED[a.storage]} weights shipped here)",
        "",
        f"| split | sentences | decoding | BLEU | chrF | time ({a.threads} thread"
        f"{'s' if a.threads > 1 else ''}, {cpu_name()}) |",
        "|---|---|---|---|---|---|",
    ]
    for split, beam, lp, b, c, s, n in rows:
        dec = "greedy" if beam == 1 else f"beam {beam}, length penalty {lp}"
        card.append(f"| {split} | {n} | {dec} | {b:.2f} | {c:.2f} | {s:.1f} s |")
    card += [
        "",
        f"Regression guard: greedy BLEU on the first 200 sentences of test_2016_flickr = "
        f"**{sub_bleu:.2f}** (`tests/models/test_shipped.py`).",
        "",
        *limits_section(src, tgt, tr.tokenizer.vocab_size),
        "## How it was made",
        "",
        f"- Command (every option spelled out): `{command_of(targs)}`",
        f"- Code: commit `{a.commit}`",
        f"- Data: Multi30k task 1 `train.{src}/{tgt}` (29,000 pairs){augmented}; validation on "
        "`val`",
        f"- Weights: {picked}; stored {STORED_AS[a.storage]} ({(out / 'model.safetensors').stat().st_size / 1e6:.1f} MB)",
        f"- Training time: {trained}",
        f"- Machine: {a.machine}" if a.machine else
        f"- Machine: {cpu_name()}, 2 cores, {targs.get('threads') or 'all'} torch thread(s) "
        "(the run's last setting), shared with other jobs",
        f"- Length penalty {lenpen} chosen on val among {a.lenpens} (beam {a.beam})",
        f"- Shipped: {time.strftime('%Y-%m-%d')}",
        "",
        "## Validation during training (first sentences of val, greedy)",
        "",
        "| epoch | step | val loss | val BLEU |",
        "|---|---|---|---|",
    ]
    card += [
        f"| {r['epoch']} | {r['step']} | {r['val_loss']} | {r['val_bleu']:.1f} |" for r in hist
    ]
    card += ["", "Checkpoint choice (all of val, greedy): "
             + "; ".join(f"{k}: {v:.2f}" for k, v in choice.items())]  # fmt: skip
    if a.note:
        card += ["", "## What was tried", "", a.note]
    (out / "README.md").write_text("\n".join(card) + "\n", encoding="utf-8")
    (out / "scores.json").write_text(json.dumps(
        {"test_2016_flickr_first200_greedy_bleu": round(sub_bleu, 2),
         "rows": [dict(zip(("split", "beam", "length_penalty", "bleu", "chrf", "seconds",
                            "sentences"), r)) for r in rows]}, indent=1) + "\n")  # fmt: skip
    print(f"shipped {a.name} -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
