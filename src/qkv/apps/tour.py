"""``qkv tour`` (what ``make demo`` runs): the attention notes' story, on real models.

1. Attention step by step on the notes' sentence: QKᵀ, ÷√d_k, softmax, ·V for one head,
   checked against ``MultiHeadAttention`` (``qkv explain`` prints every step).
2. A real translator (the shipped ``en-fr`` model) reads "The boy trains the puppy.": its
   translation (greedy and beam), which source word each French word looks at
   (cross-attention), and the pictures: ``translation.html`` (every step, every head),
   ``translation-alignment.png`` and ``translation-encoder.png`` (its self-attention).
3. What single heads do: the pronoun probe on all-MiniLM-L6-v2 — which heads send *it* to
   *animal* — and the control sentence ("too wide", where *it* is the street), with the
   conclusion the numbers support. ``attention.html`` / ``attention.png`` for MiniLM.
4. What to run next.

>>> paths = tour("/tmp/qkv-tour")                     # doctest: +SKIP
>>> sorted(paths)                                     # doctest: +SKIP
['alignment', 'encoder', 'html', 'png', 'translation']
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from rich.console import Console
from rich.table import Table

from qkv.apps.cli_args import int_range, note, output_dir
from qkv.apps.cli_args import text as text_arg
from qkv.limits import MAX_TOKENS, fit_text

__all__ = ["NOTES", "PRONOUN", "WIDE", "tour"]

NOTES = "The boy trains the puppy."
PRONOUN = "The animal didn't cross the street because it was tired."
WIDE = "The animal didn't cross the street because it was too wide."
CANDIDATES = ["animal", "street"]


def _weights_table(title: str, w, rows: list[str], cols: list[str]) -> Table:
    t = Table(title=title, title_justify="left")
    t.add_column("")
    for c in cols:
        t.add_column(c, justify="right")
    for r, label in enumerate(rows):
        t.add_row(label, *(f"{float(v):.2f}" for v in w[r]))
    return t


def step_by_step(text: str, console: Console) -> None:
    """Part 1: one head of a small attention layer, the notes' steps with qkv's numbers."""
    from qkv.apps.walk import walk_steps

    w = walk_steps(text)
    console.print(w.header)
    n_steps = sum(not s.title.startswith(" ") for s in w.steps)  # numbered 1..n; subs indented
    weights = next(s for s in w.steps if s.name == "softmax")
    console.print("Q, K, V = x W_Q, x W_K, x W_V  →  scores = Q Kᵀ  →  ÷ √d_k  →  softmax  →  · V")
    console.print(_weights_table("softmax(Q Kᵀ / √d_k), head 0 (each row sums to 1)",
                                 weights.tensor[0], weights.rows or w.words,
                                 weights.cols or w.words))  # fmt: skip
    for line in w.attends:
        console.print(line)
    console.print(f"{n_steps} steps computed; put together by hand they equal "
                  f"MultiHeadAttention.forward: {w.same}. Every step: qkv explain --text \"{text}\"")  # fmt: skip


_LANGUAGES = {"en": "English", "fr": "French", "de": "German"}


def _language(name: str, side: str) -> str:
    """The source or target language of a translator named like ``en-fr`` ("output" for any
    other name)."""
    pair = Path(name).name.split("-")
    if len(pair) == 2 and all(p in _LANGUAGES for p in pair):
        return _LANGUAGES[pair[0] if side == "source" else pair[1]]
    return "source" if side == "source" else "output"


def translation(name: str, text: str, out: Path, console: Console) -> dict[str, Path]:
    """Part 2: the shipped translator on ``text``: output, alignment, pictures."""
    from qkv.capture.maps import merge_steps
    from qkv.inspect.html import write_html
    from qkv.inspect.plot import plot_alignment, plot_grid
    from qkv.inspect.translation import record_translation
    from qkv.models.shipped import shipped
    from qkv.translate import load

    if name not in shipped() and not Path(name).is_dir():
        console.print(f"[yellow]no translator {name!r} in this install[/]; train one with "
                      f"[bold]qkv train --out runs/enfr --max-minutes 60[/]")  # fmt: skip
        return {}
    tr = load(name)
    greedy = tr(text, beam=1)
    beam = tr(text, beam=tr.beam if tr.beam > 1 else 5)
    console.print(f"{text!r} → greedy: [bold]{greedy}[/]")
    console.print(
        f"{' ' * len(repr(text))} → beam {tr.beam if tr.beam > 1 else 5}: [bold]{beam}[/]"
    )
    # the maps of the translation `qkv translate` prints: the model's own decoding
    steps = record_translation(tr.model, tr.tokenizer, text, beam=tr.beam,
                               length_penalty=tr.length_penalty).steps  # fmt: skip
    whole = merge_steps(steps)
    cross = [i for i, k in enumerate(whole.kinds) if k == "cross"][-1]
    w = whole.weights[cross].mean(0)  # (T_tgt, T_src): the last decoder layer, mean of heads
    src, tgt = whole.k_tokens[cross], whole.q_tokens[cross]
    looks = [f"{t.strip() or '·'}→{src[int(w[i].argmax())].strip() or '·'}"
             for i, t in enumerate(tgt)]  # fmt: skip
    console.print(f"cross-attention ({whole.layers[cross]}, mean of {whole.weights[cross].shape[0]}"
                  f" heads): each {_language(name, 'target')} token looks most at  "
                  + "  ".join(looks))  # fmt: skip
    enc = merge_steps([steps[0]]).filter(kind="self")
    paths = {
        "translation": (out / "translation.html").resolve(),
        "alignment": (out / "translation-alignment.png").resolve(),
        "encoder": (out / "translation-encoder.png").resolve(),
    }
    write_html(whole, paths["translation"], steps=steps, title=f"qkv: {name} translating {text!r}")
    plot_alignment(whole, path=paths["alignment"])
    plot_grid(enc, paths["encoder"])
    console.print(f"every step and head: [bold]{paths['translation']}[/]; alignment "
                  f"{paths['alignment'].name}, encoder self-attention {paths['encoder'].name}")  # fmt: skip
    return paths


def heads_at_work(model: str, sentence: str, variant: str | None, top: int, out: Path,
                  console: Console) -> dict[str, Path]:  # fmt: skip
    """Part 3: the pronoun probe, the control, and what they show."""
    from qkv.apps.view import print_probe
    from qkv.inspect import capture, pronoun_probe
    from qkv.inspect.html import write_html
    from qkv.inspect.loaders import load
    from qkv.inspect.plot import plot_grid

    loaded = load(model)
    if model == "random":
        console.print("[yellow]random weights[/]: the heads below have learned nothing")
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
        # a real switch: a clear weight on animal, then a clear weight on street
        flips = [r for r in rows if r.best == "animal" and r.scores["animal"] >= 0.1
                 and v_rows[(r.layer, r.head)].best == "street"
                 and v_rows[(r.layer, r.head)].scores["street"] >= 0.1]  # fmt: skip
        if not flips:
            console.print("[bold]What this shows:[/] heads do send 'it' to 'animal', but none "
                          "moves it clearly to 'street' when the meaning says so: no single "
                          "head of this model resolves the pronoun; they follow the words, "
                          "not the sense.")  # fmt: skip
        else:
            named = ", ".join(f"{r.layer} head {r.head}" for r in flips[:3])
            console.print(f"[bold]What this shows:[/] {len(flips)} of {len(rows)} heads move "
                          f"'it' from 'animal' to 'street' with the meaning ({named}), each "
                          "with a weight ≥ 0.1: those track the referent; the others follow "
                          "the words.")  # fmt: skip
    paths = {"html": (out / "attention.html").resolve(), "png": (out / "attention.png").resolve()}
    write_html(maps, paths["html"], title=f"qkv: {sentence!r} ({model})")
    plot_grid(maps, paths["png"])
    return paths


def tour(
    out_dir: str | os.PathLike = "qkv-tour",
    *,
    text: str = NOTES,
    sentence: str = PRONOUN,
    variant: str | None = WIDE,
    model: str = "minilm",
    translator: str | None = "en-fr",
    top: int = 5,
    console: Console | None = None,
) -> dict[str, Path]:
    """Run the story; write the pages and pictures into ``out_dir``; return their paths."""
    console = console or Console()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    console.rule("[bold]1/4  Attention, step by step (a small layer, random weights)")
    step_by_step(text, console)
    paths: dict[str, Path] = {}
    if translator:
        console.rule(f"[bold]2/4  A real translator ({translator}) reads the notes' sentence")
        paths.update(translation(translator, text, out, console))
    console.rule(f"[bold]3/4  What single heads do: where does 'it' look in {model}?")
    paths.update(heads_at_work(model, sentence, variant, top, out, console))
    console.rule("[bold]4/4  Next")
    console.print(
        '  qkv translate "Two dogs play in the snow."      translate (en-fr; --model fr-en)'
    )
    console.print('  qkv explain --text "The boy trains the puppy."  every step of attention')
    console.print(
        "  qkv serve                                       the live explorer in a browser"
    )
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
    variant = WIDE if args.sentence == PRONOUN else None  # the control fits the notes' sentence
    translator = None if args.translator == "none" else args.translator
    tour(args.out_dir, text=args.text, sentence=args.sentence, variant=variant,
         model=args.model, translator=translator, top=args.top)  # fmt: skip
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tour", help="the notes' story on real models: attention, translation, heads"
    )
    p.add_argument("--out-dir", type=output_dir, default="qkv-tour",
                   help="the folder the pages and pictures go into (made if needed)")  # fmt: skip
    p.add_argument("--text", type=text_arg, default=NOTES, help="the sentence to translate")
    p.add_argument("--sentence", type=text_arg, default=PRONOUN, help="the pronoun sentence")
    p.add_argument("--model", default="minilm", help="model for the probe: minilm | random | DIR")
    p.add_argument("--translator", default="en-fr", help="en-fr | fr-en | DIR | none")
    p.add_argument("--top", type=int_range(1, 1000), default=5, help="heads shown")
    p.set_defaults(func=run)
