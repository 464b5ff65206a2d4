"""The explorer as one self-contained HTML page: the package's ``static/`` files inlined with
the data, for notebooks (``AttentionMaps._repr_html_``) and files that open without a server.

The page holds the maps only (no model runs): the step-by-step view shows the weights, the
probe and head switches need ``qkv serve``. Maps larger than the server's limit are cut to
the first tokens (rows and columns), with the notice on the page, so the page stays small.

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
import re

import torch

from qkv.apps.serve.limits import MAX_CELLS, encoder_limit
from qkv.inspect.maps import AttentionMaps

__all__ = ["maps_from_response", "maps_response", "notebook_html", "render_page", "view_page"]

OFFLINE_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
               "img-src data:")  # fmt: skip


def _static(name: str) -> str:
    from importlib.resources import files

    return (files("qkv.apps.serve") / "static" / name).read_text(encoding="utf-8")


def maps_response(maps: AttentionMaps, *, title: str = "") -> dict:
    """An ``/api/attention``-shaped answer for captured ``maps`` (cut to the limit)."""
    from qkv.apps.serve.compute import _stats, maps_json

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
        "stats": _stats(maps), "step": None, "probe": None, "elapsed_ms": 0,
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
    page = _static("index.html")
    css = "\n".join(_static(name) for name in _LINK.findall(page))
    scripts = [_static(name) for name in _SCRIPT.findall(page)]
    if re.search(r"</style", css, re.I) or any(re.search(r"</script", js, re.I) for js in scripts):
        raise ValueError("static files must not contain </style or </script")
    blob = _script_json({"response": response, "strings": json.loads(_static("i18n/strings.json"))})
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


def view_page(
    model: str, text: str, *, translate: bool = False, beam: int = 1, title: str = "qkv attention"
) -> tuple[str, dict]:
    """``qkv view``: the server's computation and limits for ``text``, as one offline page.

    Returns ``(html, response)``; bad input raises :class:`~qkv.apps.serve.limits.BadRequest`
    (a ``ValueError``) before anything is computed.
    """
    from qkv.apps.serve.compute import attention
    from qkv.apps.serve.limits import parse_request
    from qkv.apps.serve.models import entry_for

    req = parse_request({"text": text, "model": model, "translate": translate, "beam": beam})
    entry = entry_for(model)
    response = attention(entry, req)
    return render_page(response, title=title), response
