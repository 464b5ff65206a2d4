"""``qkv explain``: the attention notes' step-by-step walk, with the library's real numbers.

The steps (embedding + positional encoding, Q/K/V, QKᵀ, √d_k scaling, mask, softmax, weighted
sum, heads, concat, W_O) are computed once by :func:`qkv.apps.walk.walk_steps`; this module renders
them in the terminal (rich tables, tokens as row labels), as Markdown or as a self-contained
HTML page.

    qkv explain --text "The boy trains the puppy ." --causal
    qkv explain --text "Le garçon" --cross --source "The boy" --out walk.md
"""

from __future__ import annotations

import argparse
import html
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from qkv.apps.cli_args import CliError, int_range, nonneg_int, output_file, text
from qkv.apps.walk import DEFAULT_TEXT, Step, Walk, fit_words, walk_steps
from qkv.atomic import atomic_write_text
from qkv.limits import MAX_TOKENS

__all__ = ["render_html", "render_markdown", "render_terminal"]


def _cell(v: torch.Tensor) -> str:
    if v.dtype == torch.bool:
        return "✓" if bool(v) else "·"
    x = float(v)
    return "-inf" if x == float("-inf") else f"{x:.3f}"


def _matrices(step: Step) -> list[tuple[str, torch.Tensor]]:
    """A step's tensor as 2-D matrices: one per head for ``(h, T, ·)``."""
    t = step.tensor
    if t.dim() == 2:
        return [("", t)]
    return [(f"head {i}", t[i]) for i in range(t.shape[0])]


def _labels(step: Step, m: torch.Tensor) -> tuple[list[str], list[str]]:
    rows = (
        step.rows
        if step.rows and len(step.rows) == m.shape[0]
        else list(map(str, range(m.shape[0])))
    )
    cols = (
        step.cols
        if step.cols and len(step.cols) == m.shape[1]
        else list(map(str, range(m.shape[1])))
    )
    return rows, cols


def render_terminal(w: Walk, console: Console | None = None) -> None:
    """Print the walk with rich: one table per step (per head for per-head steps)."""
    console = console or Console()
    console.print(f"[bold]{w.header}[/]")
    for step in w.steps:
        note = f"  ({step.note})" if step.note else ""
        console.rule(f"{step.title}  shape {list(step.tensor.shape)}{note}", align="left")
        for name, m in _matrices(step):
            rows, cols = _labels(step, m)
            t = Table(title=name or None, show_edge=False, pad_edge=False)
            t.add_column("")
            for c in cols:
                t.add_column(c, justify="right")
            for r, vals in zip(rows, m):
                t.add_row(r, *(_cell(v) for v in vals))
            console.print(t)
        if step.name == "softmax":
            for line in w.attends:
                console.print(line)
    console.print(f"\nStep by step equals MultiHeadAttention.forward: [bold]{w.same}[/]")


def render_markdown(w: Walk) -> str:
    """The walk as Markdown: a heading and a table per step (and per head)."""
    esc = lambda s: s.replace("|", "\\|")  # noqa: E731
    out = ["# Attention, step by step", "", w.header, ""]
    for step in w.steps:
        out += [f"## {step.title.strip()}", "", f"shape `{list(step.tensor.shape)}`"
                + (f" — {step.note}" if step.note else ""), ""]  # fmt: skip
        for name, m in _matrices(step):
            rows, cols = _labels(step, m)
            if name:
                out += [f"**{name}**", ""]
            out.append("| | " + " | ".join(map(esc, cols)) + " |")
            out.append("|---" * (len(cols) + 1) + "|")
            out += ["| " + esc(r) + " | " + " | ".join(_cell(v) for v in vals) + " |"
                    for r, vals in zip(rows, m)]  # fmt: skip
            out.append("")
        if step.name == "softmax":
            out += ["```", *w.attends, "```", ""]
    out.append(f"Step by step equals `MultiHeadAttention.forward`: **{w.same}**")
    return "\n".join(out) + "\n"


def render_html(w: Walk) -> str:
    """The walk as one self-contained HTML page (every token escaped)."""
    e = html.escape
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<title>qkv explain</title><style>body{font-family:'Noto Sans',sans-serif;margin:20px}"
        "table{border-collapse:collapse;margin:6px 0}td,th{border:1px solid #ccc;padding:2px 6px;"
        "text-align:right;font-family:monospace}th{background:#f3f3f3}</style></head><body>",
        "<h1>Attention, step by step</h1>",
        f"<p>{e(w.header)}</p>",
    ]
    for step in w.steps:
        note = f" — {e(step.note)}" if step.note else ""
        parts.append(
            f"<h2>{e(step.title.strip())}</h2><p>shape {list(step.tensor.shape)}{note}</p>"
        )
        for name, m in _matrices(step):
            rows, cols = _labels(step, m)
            parts.append(f"<h3>{e(name)}</h3>" if name else "")
            parts.append(
                "<table><tr><th></th>" + "".join(f"<th>{e(c)}</th>" for c in cols) + "</tr>"
            )
            for r, vals in zip(rows, m):
                parts.append(f"<tr><th>{e(r)}</th>" + "".join(f"<td>{_cell(v)}</td>" for v in vals)
                             + "</tr>")  # fmt: skip
            parts.append("</table>")
        if step.name == "softmax":
            parts.append("<pre>" + e("\n".join(w.attends)) + "</pre>")
    parts.append(f"<p>Step by step equals MultiHeadAttention.forward: <b>{w.same}</b></p>")
    return "\n".join(parts) + "</body></html>\n"


def run(args: argparse.Namespace) -> int:
    if args.cross and not args.source:
        raise CliError("--cross needs --source SENTENCE (the keys' and values' sentence)")
    texts = {}
    for name in ("text", "source"):
        value = getattr(args, name)
        if value is not None:
            texts[name] = fit_words(value, name, "explain")
    w = walk_steps(texts["text"], d_model=args.d_model, n_heads=args.heads, causal=args.causal,
                   source=texts.get("source") if args.cross or args.source else None,
                   seed=args.seed)  # fmt: skip
    if args.out is None:
        render_terminal(w)
        return 0
    path = Path(args.out)
    page = render_html(w) if path.suffix.lower() in (".html", ".htm") else render_markdown(w)
    atomic_write_text(path, page)
    print(f"explanation written: {path}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explain",
        help="the notes' walk through attention, step by step, with real numbers (tiny random model)",
    )
    limit = MAX_TOKENS["explain"]
    p.add_argument("--text", default=DEFAULT_TEXT, type=text,
                   help=f"the sentence (queries; at most {limit} tokens)")  # fmt: skip
    p.add_argument("--d-model", type=int_range(2, 512), default=8, help="even, divisible by heads")
    p.add_argument("--heads", type=int_range(1, 64), default=2)
    p.add_argument("--causal", action="store_true", help="apply the causal mask")
    p.add_argument("--cross", action="store_true", help="cross-attention to --source")
    p.add_argument("--source", default=None, type=text,
                   help=f"the source sentence (keys and values; at most {limit} tokens)")  # fmt: skip
    p.add_argument("--seed", type=nonneg_int, default=0)
    p.add_argument("--out", default=None, type=output_file(".md", ".html", ".htm"),
                   help="write Markdown (.md) or HTML (.html) instead of printing")  # fmt: skip
    p.set_defaults(func=run)
