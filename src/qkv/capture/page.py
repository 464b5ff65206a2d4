"""The explorer as one self-contained HTML page: the front-end files inlined with the data, for
notebooks (``AttentionMaps._repr_html_``), ``qkv view`` and files that open without a server.

The front-end (``index.html``, its CSS and scripts, ``i18n/strings.json``) is the one
``qkv serve`` serves: package data under ``qkv/apps/serve/static/``, read here as files
(:mod:`importlib.resources`), so the page is the explorer's without the library importing the
application's code. The JSON shapes (:func:`maps_json`, :func:`stats_json`) are the ones
``POST /api/attention`` answers with; ``qkv serve`` builds its answers with them too.

The page holds the maps only (no model runs): the step-by-step view shows the weights, the
probe, head switches and compare need ``qkv serve``. Maps larger than the server's limit
(:data:`~qkv.limits.MAX_CELLS`) are cut to the first tokens (rows and columns), with the
notice on the page, so the page stays small.

>>> from qkv.inspect.tiny import TinyEncoder
>>> from qkv.inspect import capture
>>> enc = TinyEncoder()
>>> toks, ids = enc.tokenize("The boy trains the puppy.")
>>> html = render_page(maps_response(capture(enc, ids, tokens=toks)))
>>> html.startswith("<!DOCTYPE html>") and 'id="qkv-data"' in html
True
"""

from __future__ import annotations

import html as _html
import json
import math
import re
from importlib.resources import files

import torch
from torch import Tensor

from qkv.capture.maps import AttentionMaps
from qkv.capture.stats import head_stats
from qkv.limits import DECIMALS, MAX_CELLS, encoder_limit

__all__ = [
    "OFFLINE_CSP",
    "maps_from_response",
    "maps_json",
    "maps_response",
    "notebook_html",
    "number",
    "render_page",
    "rounded",
    "static_text",
    "stats_json",
]

OFFLINE_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
               "img-src data:")  # fmt: skip


def static_text(name: str) -> str:
    """The text of front-end file ``name`` (e.g. ``"index.html"``, ``"i18n/strings.json"``):
    package data of ``qkv``, read without importing :mod:`qkv.apps`."""
    path = files("qkv") / "apps" / "serve" / "static"
    for part in name.split("/"):
        path = path / part
    return path.read_text(encoding="utf-8")


def rounded(t: Tensor, decimals: int = DECIMALS) -> list:
    """Nested lists with ``decimals`` decimals; non-finite values become ``None``."""
    t = t.detach().double().round(decimals=decimals)
    if bool(torch.isfinite(t).all()):
        return t.tolist()
    return [rounded(r, decimals) for r in t] if t.dim() > 1 else [
        float(x) if math.isfinite(x) else None for x in t.tolist()
    ]  # fmt: skip


def number(x: float | None, decimals: int = DECIMALS) -> float | None:
    """``x`` rounded to ``decimals``, or ``None`` when it is missing or not finite (JSON)."""
    return None if x is None or not math.isfinite(x) else round(float(x), decimals)


def maps_json(maps: AttentionMaps) -> list[dict]:
    """The ``layers`` field: name, kind, heads, tokens and ``weights [h][Tq][Tk]``."""
    return [
        {
            "name": maps.layers[i],
            "kind": maps.kinds[i],
            "heads": maps.heads[i],
            "q_tokens": maps.q_tokens[i],
            "k_tokens": maps.k_tokens[i],
            "weights": rounded(maps.weights[i]),
        }  # fmt: skip
        for i in range(len(maps))
    ]


def stats_json(maps: AttentionMaps) -> list[dict]:
    """The ``stats`` field: :func:`~qkv.capture.stats.head_stats` of every head, rounded."""
    return [{k: (number(v) if isinstance(v, float) else v) for k, v in s.to_dict().items()}
            for s in head_stats(maps)]  # fmt: skip


def maps_response(maps: AttentionMaps, *, title: str = "") -> dict:
    """An ``/api/attention``-shaped answer for captured ``maps`` (cut to the limit)."""
    limit = encoder_limit(sum(len(h) for h in maps.heads))
    cells = sum(w.numel() for w in maps.weights)
    cut = cells > MAX_CELLS
    if cut:
        maps = AttentionMaps(
            [w[:, :limit, :limit] for w in maps.weights], maps.layers, maps.kinds, maps.heads,
            [q[:limit] for q in maps.q_tokens], [k[:limit] for k in maps.k_tokens],
            maps.q_offsets, maps.step,
        )  # fmt: skip
    tokens = maps.q_tokens[0] if len(maps) else []
    return {
        "model": title, "random": False, "limit": limit, "truncated": cut,
        "notice": f"Cut to the first {limit} tokens (rows and columns) to keep the page small."
        if cut else None,
        "notice_key": "notice.cutPage",  # the page shows the notice from its strings table
        "text": " ".join(tokens), "tokens": tokens, "layers": maps_json(maps),
        "stats": stats_json(maps), "step": None, "probe": None, "elapsed_ms": 0,
    }  # fmt: skip


def _script_json(data: object) -> str:
    """JSON safe inside ``<script>``: no ``<``, ``>``, ``&`` or line separators left raw."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                    ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):  # fmt: skip
        text = text.replace(ch, esc)
    return text


_LINK = re.compile(r'<link rel="stylesheet" href="/static/([\w.-]+\.css)">\n?')
_SCRIPT = re.compile(r'<script src="/static/([\w.-]+\.js)" defer></script>\n?')


def render_page(response: dict, *, title: str = "qkv attention") -> str:
    """The explorer page with its CSS, JS (every file index.html loads, in its order),
    strings and ``response`` inlined."""
    page = static_text("index.html")
    css = "\n".join(static_text(name) for name in _LINK.findall(page))
    scripts = [static_text(name) for name in _SCRIPT.findall(page)]
    if re.search(r"</style", css, re.I) or any(re.search(r"</script", js, re.I) for js in scripts):
        raise ValueError("static files must not contain </style or </script")
    strings = json.loads(static_text("i18n/strings.json"))
    blob = _script_json({"response": response, "strings": strings})
    head = (f'<meta http-equiv="Content-Security-Policy" content="{OFFLINE_CSP}">\n'
            f"<style>{css}</style>\n</head>")  # fmt: skip
    page = _SCRIPT.sub("", _LINK.sub("", page)).replace("</head>", head, 1)
    page = page.replace("<title>qkv explorer</title>", f"<title>{_html.escape(title)}</title>")
    inline = "".join(f"<script>{js}</script>\n" for js in scripts)
    tail = f'<script type="application/json" id="qkv-data">{blob}</script>\n{inline}</body>'
    return page.replace("</body>", tail)


def notebook_html(maps: AttentionMaps, *, height: int = 760) -> str:
    """The page in an ``<iframe srcdoc>`` (isolated styles and scripts) for Jupyter."""
    page = render_page(maps_response(maps))
    # allow-downloads: the views' download buttons (SVG, PNG, JSON, CSV) work in the notebook
    return (f'<iframe srcdoc="{_html.escape(page, quote=True)}" style="width:100%;'
            f'height:{int(height)}px;border:1px solid #ddd" '
            'sandbox="allow-scripts allow-downloads"></iframe>')  # fmt: skip


def maps_from_response(response: dict) -> AttentionMaps:
    """The maps of an ``/api/attention`` answer as :class:`AttentionMaps` (for pictures)."""
    ls = response["layers"]
    return AttentionMaps(
        [torch.tensor(x["weights"], dtype=torch.float32) for x in ls], [x["name"] for x in ls],
        [x["kind"] for x in ls], [x["heads"] for x in ls], [x["q_tokens"] for x in ls],
        [x["k_tokens"] for x in ls],
    )  # fmt: skip
