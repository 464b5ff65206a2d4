"""``qkv tour`` (what ``make demo`` runs): attention step by step, then inside a real model.

1. ``qkv explain`` on a short sentence: every step of multi-head attention with qkv's numbers.
2. The pronoun probe on all-MiniLM-L6-v2 (qkv's own BERT, real weights): which of its
   6 × 12 heads send *it* to *animal* and which to *street*, and the same heads on the
   "too wide" variant, where *it* is the street.
3. ``qkv view``: ``attention.html`` (interactive, self-contained) and ``attention.png``
   (every layer × head) for the pronoun sentence, and where they are.

>>> paths = tour("/tmp/qkv-tour")                     # doctest: +SKIP
>>> sorted(paths)                                     # doctest: +SKIP
['html', 'png']
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from rich.console import Console

from qkv.cli_args import note, output_dir, positive_int, text
from qkv.limits import MAX_TOKENS, fit_text

__all__ = ["PRONOUN", "SHORT", "WIDE", "tour"]

SHORT = "The boy trains the puppy ."
PRONOUN = "The animal didn't cross the street because it was tired."
WIDE = "The animal didn't cross the street because it was too wide."
CANDIDATES = ["animal", "street"]


def tour(
    out_dir: str | os.PathLike = ".",
    *,
    text: str = SHORT,
    sentence: str = PRONOUN,
    variant: str | None = WIDE,
    model: str = "minilm",
    top: int = 5,
    console: Console | None = None,
) -> dict[str, Path]:
    """Run the three steps; write ``attention.html`` and ``attention.png`` into ``out_dir``.

    Returns ``{"html": path, "png": path}`` (absolute paths).
    """
    from qkv.demo import walk_steps
    from qkv.explain import render_terminal
    from qkv.inspect import capture, pronoun_probe
    from qkv.inspect.cli import print_probe
    from qkv.inspect.html import write_html
    from qkv.inspect.loaders import load
    from qkv.inspect.plot import plot_grid

    console = console or Console()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    console.rule(f"[bold]1/3  qkv explain: attention step by step on {text!r}")
    render_terminal(walk_steps(text), console)

    console.rule(f"[bold]2/3  qkv heads: which {model} heads resolve the pronoun?")
    loaded = load(model)
    tokens, inputs = loaded.encode(sentence)
    console.print(f"{sentence!r} → {len(tokens)} tokens: {' '.join(tokens)}")
    maps = capture(loaded.model, *inputs, tokens=tokens)
    rows = pronoun_probe(maps, "it", CANDIDATES)
    print_probe(rows, "it", CANDIDATES, top, console=console)
    if variant:
        v_tokens, v_inputs = loaded.encode(variant)
        v_maps = capture(loaded.model, *v_inputs, tokens=v_tokens)
        v_rows = {(r.layer, r.head): r for r in pronoun_probe(v_maps, "it", CANDIDATES)}
        console.print(f"the same heads on {variant!r} (there, it = street):")
        for r in rows[:top]:
            v = v_rows[(r.layer, r.head)]
            console.print(f"  {r.layer} head {r.head:>2}: animal {r.scores['animal']:.3f} → "
                          f"{v.scores['animal']:.3f}, street {r.scores['street']:.3f} → "
                          f"{v.scores['street']:.3f}")  # fmt: skip

    console.rule("[bold]3/3  qkv view: the pictures")
    paths = {"html": (out / "attention.html").resolve(), "png": (out / "attention.png").resolve()}
    write_html(maps, paths["html"], title=f"qkv: {sentence!r} ({model})")
    plot_grid(maps, paths["png"])
    console.print(f"\n[bold green]Done.[/] Open [bold]{paths['html']}[/] in a browser "
                  f"(hover a token, pick a layer); every layer × head of {model} is drawn in "
                  f"[bold]{paths['png']}[/].")  # fmt: skip
    return paths


def run(args: argparse.Namespace) -> int:
    for name, key in (("text", "explain"), ("sentence", "view")):
        value, n_words = fit_text(getattr(args, name), MAX_TOKENS[key])
        if n_words:
            note(f"--{name} cut to its first {MAX_TOKENS[key]} words (of {n_words})", "tour")
            setattr(args, name, value)
    variant = WIDE if args.sentence == PRONOUN else None  # the comparison fits the notes' sentence
    tour(args.out_dir, text=args.text, sentence=args.sentence, variant=variant,
         model=args.model, top=args.top)  # fmt: skip
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tour", help="explain + MiniLM pronoun probe + attention.html/.png")
    p.add_argument("--out-dir", default=".", type=output_dir,
                   help="where attention.html/.png go")  # fmt: skip
    p.add_argument("--text", default=SHORT, type=text,
                   help=f"the sentence for the step-by-step walk (at most {MAX_TOKENS['explain']} "
                   "words)")  # fmt: skip
    p.add_argument("--sentence", default=PRONOUN, type=text,
                   help=f"the pronoun sentence (at most {MAX_TOKENS['view']} tokens)")  # fmt: skip
    p.add_argument("--model", default="minilm", help="minilm | random | DIR")
    p.add_argument("--top", type=positive_int, default=5, help="heads listed")
    p.set_defaults(func=run)
