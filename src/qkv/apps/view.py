"""``qkv view`` (HTML viewer + pictures) and ``qkv heads`` (statistics, pronoun probe, ablation).

    qkv view "The boy trains the puppy." --model random --out attention.html --png attention.png
    qkv view "The boy trains the puppy." --layer 1 --head 2 --svg h2.svg --json h2.json --csv h2.csv
    qkv view --model random --translate "The boy trains the puppy." --out translate.html
    qkv heads "The animal didn't cross the street because it was tired." --token it \\
        --candidates animal street --ablate
    qkv view --model runs/enfr/best --translate "The boy trains the puppy." --png align.png
    qkv heads --model runs/enfr/best --ablate decoder.layers.2.cross_attn:0 --data-split val
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

import torch
from rich import box
from rich.console import Console
from rich.table import Table

from qkv.apps.cli_args import CliError, int_range, note, output_file, positive_int, text
from qkv.atomic import atomic_write_text
from qkv.capture.stats import ProbeRow, head_stats, normalize_token, pronoun_probe
from qkv.inspect.ablate import ablate, ablation_scan, parse_heads
from qkv.inspect.loaders import load
from qkv.limits import MAX_TOKENS, fit_text

if TYPE_CHECKING:
    from qkv.capture.export import HeadMap

console = Console()


def _f(v: float) -> str:
    return "–" if isinstance(v, float) and math.isnan(v) else f"{v:.3f}"


def _fit(loaded, text: str, command: str, what: str) -> str:
    """``text`` cut to the command's token limit (with a note when cut)."""
    limit = MAX_TOKENS[command]
    cut, n_words = fit_text(text, limit, lambda t: len(loaded.encode(t)[0]) if t.strip() else 0)
    if n_words:
        note(f"{what} cut to its first {limit} tokens ({len(cut.split())} of {n_words} words); "
             f"qkv {command} reads at most {limit} tokens", command)  # fmt: skip
    return cut


def run_view(args: argparse.Namespace) -> int:
    """The explorer page of ``qkv serve`` as one offline file, with the server's limits."""
    from qkv.apps.serve.page import view_page
    from qkv.capture.page import maps_from_response
    from qkv.inspect.plot import plot_alignment, plot_grid

    if args.translate is None and args.sentence is None:
        raise CliError("give a sentence, or --translate SENTENCE")
    text = args.translate if args.translate is not None else args.sentence
    if not text.strip():
        raise CliError("the sentence is empty; give text to look at")
    if args.translate and args.beam > 1 and args.model == "random":
        raise CliError("--model random decodes greedily only; drop --beam")
    title = f"qkv: translating {text!r}" if args.translate else f"qkv: {text!r}"
    if (args.layer is not None or args.head is not None) and not any(
        getattr(args, fmt) for fmt in EXPORTS
    ):
        raise CliError("--layer/--head choose what --svg, --json or --csv write; give one")
    page, response = view_page(args.model, text, translate=bool(args.translate), beam=args.beam,
                               title=title)  # fmt: skip
    hm = _export_map(args, response)
    out = atomic_write_text(args.out, page)
    if response["notice"]:
        note(response["notice"], "view")
    if response.get("random"):
        note(RANDOM_NOTE, "view")
    console.print(f"viewer written: [bold]{out.resolve()}[/] (open it in a browser)")
    if hm is not None:
        _write_exports(args, hm)
    maps = maps_from_response(response)
    if args.png:
        plot_grid(maps, args.png)
        console.print(f"picture written: [bold]{args.png}[/]")
        if args.translate:
            align = args.png.with_name(f"{args.png.stem}-alignment{args.png.suffix}")
            plot_alignment(maps, path=align)
            console.print(f"alignment written: [bold]{align}[/]")
    return 0


EXPORTS = ("svg", "json", "csv")


def _export_map(args: argparse.Namespace, response: dict) -> HeadMap | None:
    """``--svg/--json/--csv``: the map of one layer and head (default: the page's first
    selection), its numbers exactly as the page holds them (cut to the server's limits, so
    bounded); ``None`` when no export is asked for. Checked before anything is written."""
    from qkv.capture.export import head_map

    if not any(getattr(args, fmt) for fmt in EXPORTS):
        return None
    step = response.get("step") or {}
    layer = args.layer if args.layer is not None else step.get("layer")
    head = args.head if args.head is not None else step.get("head")
    if isinstance(layer, str) and layer.lstrip("-").isdigit():
        layer = int(layer)
    try:
        hm = head_map(response, layer, head)
    except (KeyError, IndexError, ValueError) as e:
        raise CliError(str(e).strip("'\"")) from None
    return hm


def _write_exports(args: argparse.Namespace, hm: HeadMap) -> None:
    from qkv.capture.export import to_csv, to_json, to_svg

    write = {"svg": to_svg, "json": to_json, "csv": to_csv}
    for fmt in EXPORTS:
        path = getattr(args, fmt)
        if path:
            atomic_write_text(path, write[fmt](hm))
            console.print(f"{fmt.upper()} of {hm.layer} head {hm.head} written: [bold]{path}[/]")


RANDOM_NOTE = (
    "random weights (no trained model): the numbers show the mechanics, not what trained heads"
    " do; --model minilm (or en-fr, fr-en, DIR) for a real one"
)


def _similarity_metric(loaded, inputs, tokens, token: str, candidates: list[str]):
    """cos(token, candidate₀) − cos(token, candidate₁) of the final representations."""
    norm = [normalize_token(t) for t in tokens]
    try:
        i = norm.index(normalize_token(token))
        c = [norm.index(normalize_token(x)) for x in candidates[:2]]
    except ValueError as e:
        raise CliError(f"token or candidate not in {tokens}: {e}") from None

    def metric(_model) -> float:
        h = loaded.hidden(*inputs)[0]  # (T, d)
        sims = [float(torch.cosine_similarity(h[i], h[j], dim=0)) for j in c]
        return sims[0] - (sims[1] if len(sims) > 1 else 0.0)

    return metric


def _table(title: str, columns: tuple[str, ...], layers: list[str]) -> Table:
    """A compact table whose first column (the layer's full module name, which ``--ablate``
    takes back) is never cut: at 80 columns the numbers get the room that borders took."""
    t = Table(title=title, box=box.SIMPLE_HEAD, padding=0, pad_edge=False)
    width = max([len(columns[0]), *map(len, layers)])
    t.add_column(columns[0], justify="left", no_wrap=True, min_width=width)
    for col in columns[1:]:
        t.add_column(col, justify="right", no_wrap=True)
    return t


def _scan_layers(scan: list) -> list[str]:
    """The layer names of an ablation scan's rows."""
    return [str(layer) for r in scan for layer in r.heads]


def print_probe(
    rows: list[ProbeRow], token: str, candidates: list[str], top: int = 10,
    console: Console = console,
) -> None:  # fmt: skip
    """The pronoun probe's table (``top`` heads) and how many heads prefer each candidate."""
    t = _table(f"where does {token!r} look? (top {top} of {len(rows)} heads)",
               ("layer", "head", *candidates, "best", "margin"), [r.layer for r in rows])  # fmt: skip
    for r in rows[:top]:
        t.add_row(r.layer, str(r.head), *(_f(r.scores[c]) for c in candidates), r.best,
                  _f(r.margin))  # fmt: skip
    console.print(t)
    votes = {c: sum(r.best == c for r in rows) for c in candidates}
    console.print(
        "heads preferring each candidate: " + ", ".join(f"{c}: {n}" for c, n in votes.items())
    )


def run_bleu_ablation(args: argparse.Namespace) -> int:
    """``qkv heads --model DIR --ablate [LAYER:HEADS ...] --data-split val --n 100``."""
    from qkv.data import multi30k
    from qkv.inspect.translation import bleu_metric
    from qkv.translate import load_translator

    model, tok = load_translator(args.model)
    pairs = multi30k(args.data_split, args.src, args.tgt, args.data)[: args.n]
    metric = bleu_metric(model, [s for s, _ in pairs], [t for _, t in pairs], tok, beam=args.beam)
    what = f"BLEU ({args.data_split}, first {len(pairs)}, beam {args.beam})"
    if args.ablate:
        r = ablate(model, parse_heads(args.ablate), metric)
        console.print(f"{what}: {r.baseline:.2f} → {r.ablated:.2f} with {r.heads} off "
                      f"(Δ {r.delta:+.2f})")  # fmt: skip
        return 0
    scan = ablation_scan(model, metric, args.layers)
    t = _table(
        f"one head off at a time: change in {what} (base {scan[0].baseline:.2f})",
        ("layer", "head", "BLEU", "Δ"),
        _scan_layers(scan),
    )
    for r in scan[: args.top or 10]:
        ((layer, hs),) = r.heads.items()
        t.add_row(str(layer), str(hs[0]), f"{r.ablated:.2f}", f"{r.delta:+.2f}")
    console.print(t)
    return 0


def run_heads(args: argparse.Namespace) -> int:
    if args.data_split is not None:
        if args.ablate is None:
            raise CliError("--data-split goes with --ablate (BLEU of a translation model)")
        return run_bleu_ablation(args)
    if not args.sentence or not args.sentence.strip():
        raise CliError("give a sentence (or --ablate ... --data-split SPLIT for BLEU)")
    loaded = load(args.model)
    if loaded.name == "random":
        note(RANDOM_NOTE, "heads")
    args.sentence = _fit(loaded, args.sentence, "heads", "the sentence")
    tokens, inputs = loaded.encode(args.sentence)
    maps = loaded.maps(*inputs, tokens=tokens)
    if args.token is None:
        stats = head_stats(maps)
        title = f"head statistics — {args.sentence!r}"
        if args.top is not None and args.top < len(stats):  # the most focused heads
            title += f" (the {args.top} of {len(stats)} heads with the lowest entropy)"
            stats = sorted(stats, key=lambda s: s.entropy)[: args.top]
        t = _table(
            title,
            ("layer", "head", "entropy", "dist", "prev", "next", "self", "first", "punct"),
            maps.layers,
        )
        for s in stats:
            vals = (s.entropy, s.distance, s.prev, s.next, s.self, s.first, s.punct)
            t.add_row(s.layer, str(s.head), *map(_f, vals))
        console.print(t)
        return 0
    print_probe(pronoun_probe(maps, args.token, args.candidates), args.token,
                args.candidates, 10 if args.top is None else args.top)  # fmt: skip
    if args.ablate is not None:
        metric = _similarity_metric(loaded, inputs, tokens, args.token, args.candidates)
        what = f"cos({args.token},{args.candidates[0]})" + (
            f" − cos({args.token},{args.candidates[1]})" if len(args.candidates) > 1 else ""
        )
        if args.ablate:
            r = ablate(loaded.model, parse_heads(args.ablate), metric)
            console.print(f"{what}: {r.baseline:.4f} → {r.ablated:.4f} with {r.heads} off "
                          f"(Δ {r.delta:+.4f})")  # fmt: skip
        else:
            scan = ablation_scan(loaded.model, metric)
            t = _table(
                f"one head off at a time: change in {what} (base {scan[0].baseline:.4f})",
                ("layer", "head", "Δ"),
                _scan_layers(scan),
            )
            for r in scan[: args.top or 10]:
                ((layer, hs),) = r.heads.items()
                t.add_row(str(layer), str(hs[0]), f"{r.delta:+.4f}")
            console.print(t)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    limit = MAX_TOKENS["view"]
    p = sub.add_parser("view", help="interactive HTML attention viewer (+ PNG/SVG grid)")
    p.add_argument("sentence", nargs="?", default=None, type=text,
                   help=f"the text to look at (at most {limit} tokens are read)")  # fmt: skip
    p.add_argument(
        "--model",
        default="random",
        help="random | a registered name | DIR (qkv, BERT or transformers model)",
    )
    p.add_argument("--out", default="attention.html", type=output_file(".html", ".htm"),
                   help="HTML file to write")  # fmt: skip
    p.add_argument("--png", default=None, type=output_file(".png", ".svg"),
                   help="also draw the layers × heads grid (.png/.svg)")  # fmt: skip
    for fmt, what in (("svg", "an SVG picture"), ("json", "JSON (tokens, weights)"),
                      ("csv", "CSV (key tokens across, a query per row)")):  # fmt: skip
        p.add_argument(f"--{fmt}", default=None, type=output_file(f".{fmt}"),
                       help=f"also write one layer and head (--layer/--head) as {what}")  # fmt: skip
    p.add_argument("--layer", default=None,
                   help="layer for --svg/--json/--csv: name or index (default: the page's "
                   "first, the last cross-attention when translating)")  # fmt: skip
    p.add_argument("--head", type=int_range(0, None), default=None,
                   help="head for --svg/--json/--csv (default: 0)")  # fmt: skip
    p.add_argument(
        "--translate",
        default=None,
        type=text,
        help=f"translate this sentence (at most {limit} tokens); cross-attention",
    )
    p.add_argument("--beam", type=int_range(1, 16), default=1,
                   help="beam size for --translate (1 = greedy)")  # fmt: skip
    p.set_defaults(func=run_view)

    h = sub.add_parser("heads", help="head statistics, pronoun probe and head ablation")
    h.add_argument(
        "sentence",
        nargs="?",
        default=None,
        type=text,
        help=f"the text to look at (at most {MAX_TOKENS['heads']} tokens are read)",
    )
    h.add_argument(
        "--model",
        default="random",
        help="random | a registered name | DIR (qkv, BERT or transformers model)",
    )
    h.add_argument("--token", default=None, type=text, help="query token to probe (e.g. it)")
    h.add_argument("--candidates", nargs="+", default=[], type=text,
                   help="antecedents to compare")  # fmt: skip
    h.add_argument("--top", type=positive_int, default=None,
                   help="rows shown: the heads with the lowest entropy (default: every head's "
                   "statistics; 10 rows of the probe and of an ablation scan)")  # fmt: skip
    h.add_argument("--ablate", nargs="*", default=None, metavar="LAYER:HEADS",
                   help="switch heads off (none given: each head in turn) and report the "
                   "change in cos(token, cand₀) − cos(token, cand₁)")  # fmt: skip
    h.add_argument("--data-split", default=None, help="with --ablate and a translation model "
                   "DIR: report the change in BLEU on this Multi30k split (e.g. val)")  # fmt: skip
    h.add_argument("--n", type=positive_int, default=100, help="sentences for --data-split")
    h.add_argument("--src", default="en")
    h.add_argument("--tgt", default="fr")
    h.add_argument("--data", default=None, help="Multi30k directory")
    h.add_argument("--beam", type=int_range(1, 16), default=1,
                   help="beam size for BLEU (1 = greedy)")  # fmt: skip
    h.add_argument("--layers", nargs="+", default=None,
                   help="layers (names/globs) to scan one head at a time (BLEU mode)")  # fmt: skip
    h.set_defaults(func=run_heads)
