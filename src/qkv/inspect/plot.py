"""Pictures of attention (matplotlib, no display needed): grid, one head, alignment.

Every function returns a :class:`matplotlib.figure.Figure` and, given ``path``, saves it as
PNG or SVG (by the suffix). Rows and columns carry their tokens as tick labels (every token up
to :data:`MAX_LABELS` per axis, every n-th above), in the fallback fonts of
:mod:`qkv.inspect.fonts`, so tokens in any script render.

>>> fig = plot_grid(maps, "grid.png")  # layers × heads  # doctest: +SKIP
>>> plot_head(maps, "encoder.layers.1.self_attn", 3, "head.svg")  # doctest: +SKIP
>>> plot_alignment(maps, path="align.png")  # source × target  # doctest: +SKIP
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from matplotlib import rc_context
from matplotlib.figure import Figure

from qkv.atomic import atomic_path
from qkv.capture.maps import AttentionMaps
from qkv.inspect.fonts import font_families

__all__ = ["MAX_LABELS", "label_step", "plot_alignment", "plot_grid", "plot_head", "save"]

CMAP = "viridis"
MAX_LABELS = 60  # tick labels per axis: beyond this they overlap, so label every n-th token
GRID_LABEL_IN = 0.075  # inches per labelled token in the grid (5 pt labels)
HEAD_LABEL_IN = 0.2  # inches per labelled token in one head's map (9 pt labels)


def label_step(n: int, most: int = MAX_LABELS) -> int:
    """Label every ``label_step(n)``-th of ``n`` tokens so that at most ``most`` labels show."""
    return max(1, math.ceil(n / most))


def _label(ax, axis: str, tokens: Sequence[str], **text) -> None:
    """Token tick labels on ``axis`` ("x" or "y"), every n-th above :data:`MAX_LABELS`.
    ``parse_math=False``: a token such as ``$x$`` is text, not mathtext."""
    step = label_step(len(tokens))
    idx = range(0, len(tokens), step)
    setter = ax.set_xticks if axis == "x" else ax.set_yticks
    setter(idx, [str(tokens[i]) for i in idx], parse_math=False, **text)
    ax.tick_params(axis=axis, length=2, pad=1)


def _side(n: int) -> float:
    """Inches of a one-head map over ``n`` tokens: roomy cells (with numbers) for short
    inputs, one readable label per labelled token for long ones."""
    return 2 + max(HEAD_LABEL_IN * min(n, MAX_LABELS), min(0.45 * n, 7.2))


@contextmanager
def _style() -> Iterator[None]:
    with rc_context({"font.family": font_families(), "font.size": 9, "svg.fonttype": "path"}):
        yield


def save(fig: Figure, path: str | os.PathLike) -> Path:
    """Write ``fig`` as PNG or SVG (chosen by the suffix) via a temporary file and a rename."""
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in ("png", "svg"):
        raise ValueError(f"path must end in .png or .svg, got {path.name!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with _style(), atomic_path(path) as tmp:
        fig.savefig(tmp, format=fmt, dpi=120, bbox_inches="tight")
    return path


def plot_grid(
    maps: AttentionMaps, path: str | os.PathLike | None = None, *, cell: float = 1.6
) -> Figure:
    """Every captured layer (rows) × head (columns) as a small heatmap, queries down.

    The first map of each layer carries the query tokens (its heads share them); key tokens
    go under the bottom row when every layer has the same keys, else beside each layer.
    """
    if len(maps) == 0:
        raise ValueError("maps hold no layer")
    n_cols = max(len(h) for h in maps.heads)
    n_tok = max(max(len(q), len(k)) for q, k in zip(maps.q_tokens, maps.k_tokens))
    side = max(cell, GRID_LABEL_IN * min(n_tok, MAX_LABELS))
    shared_keys = all(k == maps.k_tokens[0] for k in maps.k_tokens)
    small = {"fontsize": 5}
    with _style():
        fig = Figure(figsize=(side * n_cols + 1.6, side * len(maps) + 1.2), layout="constrained")
        axes = fig.subplots(len(maps), n_cols, squeeze=False)
        for i, w in enumerate(maps.weights):
            for c in range(n_cols):
                ax = axes[i][c]
                ax.set_xticks([])
                ax.set_yticks([])
                if c >= w.shape[0]:
                    ax.set_axis_off()
                    continue
                ax.imshow(w[c].numpy(), cmap=CMAP, vmin=0, vmax=1, aspect="auto")
                ax.set_title(f"h{maps.heads[i][c]}", fontsize=7)
                last_row = i == len(maps) - 1
                if (shared_keys and last_row) or (not shared_keys and c == 0):
                    _label(ax, "x", maps.k_tokens[i], rotation=90, **small)
            _label(axes[i][0], "y", maps.q_tokens[i], **small)
            axes[i][0].set_ylabel(f"{maps.layers[i]}\n({maps.kinds[i]})", fontsize=6)
        fig.suptitle("attention: rows = queries, columns = keys", fontsize=9)
    if path is not None:
        save(fig, path)
    return fig


def _heatmap(fig: Figure, w, q_tokens: list[str], k_tokens: list[str], title: str) -> None:
    ax = fig.subplots()
    im = ax.imshow(w, cmap=CMAP, vmin=0, vmax=1, aspect="auto")
    _label(ax, "x", k_tokens, rotation=60, ha="right")
    _label(ax, "y", q_tokens)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    ax.set_title(title)
    if w.shape[0] * w.shape[1] <= 256:  # write the numbers when they fit
        for r in range(w.shape[0]):
            for c in range(w.shape[1]):
                ax.text(c, r, f"{w[r, c]:.2f}", ha="center", va="center", fontsize=6,
                        color="black" if w[r, c] > 0.6 else "white")  # fmt: skip
    fig.colorbar(im, ax=ax, shrink=0.8)


def plot_head(
    maps: AttentionMaps, layer: int | str, head: int, path: str | os.PathLike | None = None
) -> Figure:
    """One head's ``(Tq, Tk)`` map with token labels on both axes."""
    i = maps.index(layer)
    w = maps.select(i, head).numpy()
    n = max(len(maps.q_tokens[i]), len(maps.k_tokens[i]))
    with _style():
        fig = Figure(figsize=(_side(n), _side(n) - 0.5), layout="constrained")
        _heatmap(fig, w, maps.q_tokens[i], maps.k_tokens[i],
                 f"{maps.layers[i]} head {head} ({maps.kinds[i]})")  # fmt: skip
    if path is not None:
        save(fig, path)
    return fig


def plot_alignment(
    maps: AttentionMaps,
    layer: int | str | None = None,
    head: int | None = None,
    path: str | os.PathLike | None = None,
) -> Figure:
    """Cross-attention of a translation: target tokens (rows) × source tokens (columns).

    ``layer`` defaults to the last cross-attention layer, ``head`` to the mean over heads.
    """
    if layer is None:
        cross = [i for i, k in enumerate(maps.kinds) if k == "cross"]
        if not cross:
            raise ValueError(f"no cross-attention layer among {maps.kinds}; pass layer=")
        layer = cross[-1]
    i = maps.index(layer)
    w = maps.weights[i].mean(0) if head is None else maps.select(i, head)
    label = "mean of heads" if head is None else f"head {head}"
    n = max(len(maps.q_tokens[i]), len(maps.k_tokens[i]))
    with _style():
        fig = Figure(figsize=(_side(n), _side(n) - 0.5), layout="constrained")
        _heatmap(fig, w.numpy(), maps.q_tokens[i], maps.k_tokens[i],
                 f"alignment: {maps.layers[i]}, {label}")  # fmt: skip
        fig.axes[0].set_xlabel("source")
        fig.axes[0].set_ylabel("target")
    if path is not None:
        save(fig, path)
    return fig
