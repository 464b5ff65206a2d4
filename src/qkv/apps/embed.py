"""``qkv embed "sentence" ...``: sentence embeddings from a pretrained encoder run by qkv.

One sentence prints its embedding (shortened); several print their cosine-similarity matrix.

    $ qkv embed "A man is playing a guitar." "Someone plays an instrument."
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

from qkv.apps.cli_args import CliError, int_range, note, text
from qkv.limits import MAX_SENTENCES, MAX_TOKENS

__all__ = ["add_parser", "format_embedding", "similarity_table"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "embed",
        help="sentence embeddings (all-MiniLM-L6-v2 through qkv); several → cosine matrix",
        description="Embed sentences with a pretrained BERT encoder running on qkv's attention.",
    )
    p.add_argument("sentences", nargs="+", type=text,
                   help=f"one to {MAX_SENTENCES} sentences, each read up to "
                   f"{MAX_TOKENS['embed']} tokens")  # fmt: skip
    p.add_argument(
        "--model", default="all-MiniLM-L6-v2",
        help="all-MiniLM-L6-v2 (default) or a HuggingFace BERT directory",
    )  # fmt: skip
    p.add_argument("--show", type=int_range(0, 4096), default=8,
                   help="values shown for a single embedding")  # fmt: skip
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

    for i, s in enumerate(args.sentences, 1):
        if not s.strip():
            raise CliError(f"sentence {i} is empty; give text to embed")
    if len(args.sentences) > MAX_SENTENCES:
        raise CliError(f"at most {MAX_SENTENCES} sentences, got {len(args.sentences)}")
    console = Console()
    model = load(args.model)
    limit = min(MAX_TOKENS["embed"], model.max_seq_length or MAX_TOKENS["embed"])
    for i, s in enumerate(args.sentences, 1):
        n = len(model.tokenizer(s[: 16 * limit * 4], add_special_tokens=True)["input_ids"])
        if n > limit:
            note(f"sentence {i} is longer than {limit} tokens; its embedding reads the first "
                 f"{limit}", "embed")  # fmt: skip
    emb = model.encode(args.sentences, max_length=limit)  # (N, d), unit rows
    if len(args.sentences) == 1:
        first = args.sentences[0]
        console.print(first if len(first) <= 200 else first[:199] + "…", markup=False)
        console.print(format_embedding(emb[0], args.show), highlight=False, soft_wrap=True)
    else:
        console.print(similarity_table(args.sentences, cosine_similarity_matrix(emb)))
    return 0
