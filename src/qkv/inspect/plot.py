"""Pictures of attention (matplotlib, no display needed): grid, one head, alignment.

Every function returns a :class:`matplotlib.figure.Figure` and, given ``path``, saves it as
PNG or SVG (by the suffix). Labels use the fallback fonts of :mod:`qkv.inspect.fonts`, so
tokens in any script render.

>>> fig = plot_grid(maps, "grid.png")  # layers × heads  # doctest: +SKIP
>>> plot_head(maps, "encoder.layers.1.self_attn", 3, "head.svg")  # doctest: +SKIP
>>> plot_alignment(maps, path="align.png")  # source × target  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from matplotlib import rc_context
from matplotlib.figure import Figure

from qkv.atomic import atomic_path
from qkv.inspect.fonts import font_families
from qkv.inspect.maps import AttentionMaps

__all__ = ["plot_alignment", "plot_grid", "plot_head", "save"]

CMAP = "viridis"


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
    """Every captured layer (rows) × head (columns) as a small heatmap, queries down."""
    if len(maps) == 0:
        raise ValueError("maps hold no layer")
    n_cols = max(len(h) for h in maps.heads)
    with _style():
        fig = Figure(figsize=(cell * n_cols + 1, cell * len(maps) + 0.6), layout="constrained")
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
            axes[i][0].set_ylabel(f"{maps.layers[i]}\n({maps.kinds[i]})", fontsize=6)
        fig.suptitle("attention: rows = queries, columns = keys", fontsize=9)
    if path is not None:
        save(fig, path)
    return fig


def _heatmap(fig: Figure, w, q_tokens: list[str], k_tokens: list[str], title: str) -> None:
    ax = fig.subplots()
    im = ax.imshow(w, cmap=CMAP, vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(k_tokens)), k_tokens, rotation=60, ha="right")
    ax.set_yticks(range(len(q_tokens)), q_tokens)
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
        fig = Figure(figsize=(2 + 0.45 * n, 1.5 + 0.4 * n), layout="constrained")
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
        fig = Figure(figsize=(2 + 0.45 * n, 1.5 + 0.4 * n), layout="constrained")
        _heatmap(fig, w.numpy(), maps.q_tokens[i], maps.k_tokens[i],
                 f"alignment: {maps.layers[i]}, {label}")  # fmt: skip
        fig.axes[0].set_xlabel("source")
        fig.axes[0].set_ylabel("target")
    if path is not None:
        save(fig, path)
    return fig
