"""``qkv embed "sentence" ...``: sentence embeddings from a pretrained encoder run by qkv.

One sentence prints its embedding (shortened); several print their cosine-similarity matrix.

    $ qkv embed "A man is playing a guitar." "Someone plays an instrument."
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

__all__ = ["add_parser", "format_embedding", "similarity_table"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "embed",
        help="sentence embeddings (all-MiniLM-L6-v2 through qkv); several → cosine matrix",
        description="Embed sentences with a pretrained BERT encoder running on qkv's attention.",
    )
    p.add_argument("sentences", nargs="+", help="one or more sentences")
    p.add_argument(
        "--model", default="all-MiniLM-L6-v2",
        help="all-MiniLM-L6-v2 (default) or a HuggingFace BERT directory",
    )  # fmt: skip
    p.add_argument("--show", type=int, default=8, help="values shown for a single embedding")
    p.set_defaults(func=run)


def format_embedding(e: torch.Tensor, show: int = 8) -> str:
    """``e (d,)`` as ``"384-d, |e|=1.0000: [0.0123, ..., -0.0456]"`` (first/last values)."""
    vals = e.tolist()
    head = ", ".join(f"{v:+.4f}" for v in vals[:show])
    tail = ", ".join(f"{v:+.4f}" for v in vals[-2:])
    body = head if len(vals) <= show + 2 else f"{head}, …, {tail}"
    return f"{len(vals)}-d, |e|={float(e.norm()):.4f}: [{body}]"


def similarity_table(sentences: list[str], sims: torch.Tensor) -> Table:
    """A rich table of the cosine similarities ``sims (N, N)``, rows and columns numbered."""
    table = Table(title="cosine similarity")
    table.add_column("#", justify="right")
    table.add_column("sentence")
    for j in range(len(sentences)):
        table.add_column(str(j + 1), justify="right")
    for i, s in enumerate(sentences):
        cells = []
        for j in range(len(sentences)):
            v = float(sims[i, j])
            style = (
                "dim" if i == j else ("bold green" if v >= 0.5 else "yellow" if v >= 0.2 else "")
            )
            cells.append(f"[{style}]{v:.3f}[/]" if style else f"{v:.3f}")
        table.add_row(str(i + 1), s if len(s) <= 60 else s[:57] + "...", *cells)
    return table


def run(args: argparse.Namespace) -> int:
    from qkv.pretrained.embeddings import cosine_similarity_matrix
    from qkv.pretrained.load import load

    console = Console()
    model = load(args.model)
    emb = model.encode(args.sentences)  # (N, d), unit rows
    if len(args.sentences) == 1:
        console.print(args.sentences[0])
        console.print(format_embedding(emb[0], args.show), highlight=False, soft_wrap=True)
    else:
        console.print(similarity_table(args.sentences, cosine_similarity_matrix(emb)))
    return 0
