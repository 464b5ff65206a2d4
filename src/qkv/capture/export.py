"""One head's attention map as files: SVG (drawn from the numbers), JSON and CSV.

The same files as the explorer's download buttons (``apps/serve/static/export.js``), for
``qkv view --svg/--json/--csv`` and :meth:`AttentionMaps.to_svg`/``to_json``/``to_csv``:

* **JSON**: ``tokens``, ``layer``, ``kind``, ``head``, ``q_tokens`` (rows), ``k_tokens``
  (columns) and ``weights`` ``[Tq][Tk]`` exactly as given (no re-rounding), enough to redraw
  the figure; ``picture`` says how it was drawn (colour scale, cell size).
* **CSV**: a header row (``query \\ key``, then the key tokens), one row per query token.
  A token label that starts with ``=``, ``+``, ``-``, ``@``, a tab or a carriage return gets a
  leading ``'`` (a spreadsheet would run it as a formula); numbers are written as they are.
* **SVG**: one ``<rect>`` per weight, token labels on both axes, the colour scale; token text
  is XML-escaped (characters XML cannot hold become U+FFFD).

Bounds: a data export holds at most :data:`MAX_EXPORT_TOKENS` tokens per side (a 512 × 512
CSV is about 2 MB); a larger map raises :class:`ExportTooLarge` (a ``ValueError``) saying so.
A picture draws at most :data:`PICTURE_MAX_SIDE` cells per side: a larger map is drawn as the
means of k × k blocks, and the picture says so.

>>> m = AttentionMaps([torch.eye(2)[None]], ["enc.0"], ["self"], [[0]], [["a", "<b>"]],
...                   [["a", "<b>"]])
>>> to_csv(head_map(m)).splitlines()
['query \\\\ key,a,<b>', 'a,1.0,0.0', '<b>,0.0,1.0']
>>> "&lt;b&gt;" in to_svg(head_map(m))
True
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any

import torch

from qkv.capture.maps import AttentionMaps

__all__ = [
    "MAX_EXPORT_TOKENS",
    "PICTURE_MAX_SIDE",
    "ExportTooLarge",
    "HeadMap",
    "head_map",
    "to_csv",
    "to_json",
    "to_svg",
    "xml_text",
]

MAX_EXPORT_TOKENS = 512  # per side of a JSON/CSV export: 262,144 weights, ~2 MB of CSV
PICTURE_MAX_SIDE = 128  # cells per side of a picture (the explorer's token limit)
FORMAT = 1  # "qkv_export" in the JSON: bumped when a field changes meaning

# Characters XML 1.0 cannot hold (C0 controls but tab/newline/return, lone surrogates, U+FFFE/F)
_NOT_XML = re.compile("[^\t\n\r\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


class ExportTooLarge(ValueError):
    """A map too large to export as data; the message says the limit and what to do."""


@dataclass
class HeadMap:
    """One head's ``(Tq, Tk)`` weights with their tokens, as exported."""

    layer: str
    kind: str
    head: int
    q_tokens: list[str]
    k_tokens: list[str]
    weights: list[list[float | None]]
    meta: dict[str, Any] = field(default_factory=dict)  # model, text, tokens, notice …


def head_map(
    source: AttentionMaps | dict, layer: int | str | None = None, head: int | None = None,
    *, decimals: int = 4,
) -> HeadMap:  # fmt: skip
    """The map of ``layer`` (index or name; default: the first) and ``head`` (an original
    head index; default: the layer's first) of captured maps or an ``/api/attention``
    answer (whose numbers are taken as they are; captured maps are rounded to ``decimals``)."""
    if isinstance(source, AttentionMaps):
        i = source.index(0 if layer is None else layer)
        h = source.heads[i][0] if head is None else head
        w = source.select(i, h)
        _check_size(source.layers[i], h, *w.shape)
        values = w.double().round(decimals=decimals)
        rows = [[float(v) if math.isfinite(v) else None for v in r] for r in values.tolist()]
        return HeadMap(source.layers[i], source.kinds[i], h, list(source.q_tokens[i]),
                       list(source.k_tokens[i]), rows, {"step": source.step})  # fmt: skip
    layers = source["layers"]
    names = [x["name"] for x in layers]
    if layer is None:
        i = 0
    elif isinstance(layer, int):
        if not -len(layers) <= layer < len(layers):
            raise IndexError(f"layer index {layer} out of range for {len(layers)} layers")
        i = layer % len(layers)
    elif layer in names:
        i = names.index(layer)
    else:
        raise KeyError(f"no layer named {layer!r}; have {names}")
    lay = layers[i]
    h = lay["heads"][0] if head is None else head
    if h not in lay["heads"]:
        raise KeyError(f"head {h} of layer {lay['name']!r} not captured: {lay['heads']}")
    w = lay["weights"][lay["heads"].index(h)]
    _check_size(lay["name"], h, len(w), len(w[0]) if w else 0)
    meta = {k: source[k] for k in ("model", "random", "text", "tokens", "truncated", "notice")
            if k in source}  # fmt: skip
    return HeadMap(lay["name"], lay["kind"], h, list(lay["q_tokens"]), list(lay["k_tokens"]),
                   w, meta)  # fmt: skip


def _check_size(layer: str, head: int, n_rows: int, n_cols: int) -> None:
    if max(n_rows, n_cols) > MAX_EXPORT_TOKENS:
        raise ExportTooLarge(
            f"{layer} head {head} is {n_rows} × {n_cols} ({n_rows * n_cols:,} weights); an "
            f"export holds at most {MAX_EXPORT_TOKENS} tokens per side: export a shorter text, "
            f"or maps cut to their first {MAX_EXPORT_TOKENS} tokens"
        )


def to_json(hm: HeadMap, *, view: str = "heatmap", shown: dict | None = None) -> str:
    """The map as JSON (see the module's docstring); ``shown``: what else the view showed."""
    data = {
        "qkv_export": FORMAT, "view": view, **hm.meta, "layer": hm.layer, "kind": hm.kind,
        "head": hm.head, "q_tokens": hm.q_tokens, "k_tokens": hm.k_tokens,
        "weights": hm.weights, "shown": shown or {}, "picture": _picture_note(hm),
    }  # fmt: skip
    return json.dumps(data, ensure_ascii=False, allow_nan=False) + "\n"


# A text cell starting with one of these is read as a formula by spreadsheets (OWASP's "CSV
# injection"): it gets a leading single quote. Numbers are never changed (-0.25 stays a number).
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _csv_field(value: object) -> str:
    s = "" if value is None else str(value)
    if isinstance(value, str) and s.startswith(_FORMULA_START):
        s = "'" + s
    if any(c in s for c in ',"\r\n') or s != s.strip():
        return '"' + s.replace('"', '""') + '"'
    return s


def to_csv(hm: HeadMap) -> str:
    """The weights as CSV (RFC 4180, CRLF line ends): key tokens across, a query per row."""
    lines = [",".join(map(_csv_field, ["query \\ key", *hm.k_tokens]))]
    for tok, row in zip(hm.q_tokens, hm.weights):
        lines.append(",".join(map(_csv_field, [tok, *row])))
    return "\r\n".join(lines) + "\r\n"


def xml_text(s: object) -> str:
    """``s`` as XML character data or attribute value: escaped, and every character that
    XML 1.0 cannot hold replaced by U+FFFD."""
    s = _NOT_XML.sub("\ufffd", str(s))
    return (s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;").replace("'", "&#39;"))  # fmt: skip


def _text_width(s: str, size: float) -> float:
    """Rough width of ``s`` at font ``size`` px (for the layout: wide CJK, zero-width marks)."""
    w = 0.0
    for c in s:
        if unicodedata.combining(c) or unicodedata.category(c) == "Mn":
            continue
        w += 1.0 if unicodedata.east_asian_width(c) in "WF" else 0.62
    return w * size


def _clip(s: str, n: int = 16) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def seq_colour(v: float | None) -> str:
    """0..1 → white..blue, the explorer's colour scale (``seq`` in static/export.js); None → grey."""
    if v is None:
        return "#bbbbbb"
    t = max(0.0, min(1.0, v))
    # int(x + 0.5): JavaScript's Math.round, so both pictures get the same colours
    return "#" + "".join(f"{int(255 - d * t + 0.5):02x}" for d in (218, 168, 56))


def _blocks(hm: HeadMap) -> tuple[list[list[float | None]], int]:
    """The weights as drawn: ≤ PICTURE_MAX_SIDE cells a side (means of k × k blocks)."""
    R, C = len(hm.weights), len(hm.weights[0]) if hm.weights else 0
    k = max(1, math.ceil(max(R, C) / PICTURE_MAX_SIDE))
    if k == 1:
        return hm.weights, 1
    t = torch.tensor([[math.nan if v is None else v for v in r] for r in hm.weights])
    out = []
    for i in range(0, R, k):
        row = []
        for j in range(0, C, k):
            b = t[i : i + k, j : j + k]
            b = b[~b.isnan()]
            row.append(round(float(b.mean()), 4) if b.numel() else None)
        out.append(row)
    return out, k


def _picture_note(hm: HeadMap) -> dict:
    _, k = _blocks(hm)
    return {"colour_scale": "white (0) → blue (1), grey = no value", "rows": "queries",
            "columns": "keys", "block": k}  # fmt: skip


def to_svg(hm: HeadMap, *, title: str | None = None) -> str:
    """The map as an SVG picture built from the numbers: a ``<rect>`` per weight in
    ``<g class="cells">`` (or per block mean, above :data:`PICTURE_MAX_SIDE`), token labels
    (``text.tok-q``, ``text.tok-k``), colour scale."""
    values, k = _blocks(hm)
    R, C = len(values), len(values[0]) if values else 0
    cell = max(4, min(32, 560 // max(1, R, C)))
    font = 11
    rows = [_clip(t) for t in hm.q_tokens[::k]]
    cols = [_clip(t) for t in hm.k_tokens[::k]]
    step_r = max(1, math.ceil((font + 1) / cell))  # every n-th label when cells are small
    step_c = step_r
    lab_w = 6 + max([_text_width(t, font) for t in rows[::step_r]] or [0])
    lab_h = 6 + max([_text_width(t, font) for t in cols[::step_c]] or [0]) * math.sin(math.pi / 3)
    title = title or f"{hm.layer} ({hm.kind}), head {hm.head}"
    top = 44
    x0, y0 = 12 + lab_w, top + lab_h
    W = math.ceil(max(x0 + C * cell + 12, 12 + _text_width(title, 14) + 12, 340))
    H = math.ceil(y0 + R * cell + 58)
    out = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        f'viewBox="0 0 {W} {H}" font-family="Noto Sans, Noto Sans CJK SC, DejaVu Sans, '
        f'sans-serif">',
        f"<title>{xml_text(title)}</title>",
        '<defs><linearGradient id="qkv-seq"><stop offset="0" stop-color="#ffffff"/>'
        '<stop offset="1" stop-color="#2557c7"/></linearGradient></defs>',
        f'<rect width="{W}" height="{H}" fill="#ffffff"/>',
        f'<text x="12" y="20" font-size="14" font-weight="600" fill="#1d2330">'
        f"{xml_text(title)}</text>",
        '<text x="12" y="36" font-size="11" fill="#667">rows: queries (attending), '
        "columns: keys (attended to)</text>",
        f'<g class="cells" transform="translate({x0:g},{y0:g})" shape-rendering="crispEdges">',
    ]
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            out.append(f'<rect x="{j * cell}" y="{i * cell}" width="{cell}" height="{cell}" '
                       f'fill="{seq_colour(v)}"/>')  # fmt: skip
    out.append(f'</g><rect x="{x0:g}" y="{y0:g}" width="{C * cell}" height="{R * cell}" '
               'fill="none" stroke="#ccd" stroke-width="0.5"/>')  # fmt: skip
    out.append(f'<g class="rows" font-size="{font}" fill="#222" text-anchor="end">')
    for i in range(0, R, step_r):
        out.append(f'<text class="tok-q" x="{x0 - 4:g}" y="{y0 + (i + 0.5) * cell:g}" '
                   f'dominant-baseline="central">{xml_text(rows[i])}</text>')  # fmt: skip
    out.append("</g>")
    out.append(f'<g class="cols" font-size="{font}" fill="#222">')
    for j in range(0, C, step_c):
        x, y = x0 + (j + 0.5) * cell, y0 - 4
        out.append(f'<text class="tok-k" transform="translate({x:g},{y:g}) rotate(-60)" '
                   f'dominant-baseline="central">{xml_text(cols[j])}</text>')  # fmt: skip
    out.append("</g>")
    sy = y0 + R * cell + 14
    out += [
        f'<g class="scale" font-size="10" fill="#667" transform="translate(12,{sy:g})">',
        '<text x="0" y="9">0</text>',
        '<rect x="12" y="0" width="160" height="10" fill="url(#qkv-seq)" stroke="#ccd"/>',
        '<text x="178" y="9">1 (attention weight)</text>',
    ]
    notes = []
    if any(v is None for r in values for v in r):
        notes.append("grey = no value")
    if k > 1:
        notes.append(f"each cell: the mean of {k}×{k} weights ({len(hm.weights)} × "
                     f"{len(hm.weights[0])} tokens; labels: the first token of each block)")  # fmt: skip
    if notes:
        out.append(f'<text x="0" y="28">{xml_text("; ".join(notes))}</text>')
    out += ["</g>", "</svg>", ""]
    return "\n".join(out)
