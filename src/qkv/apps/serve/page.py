"""``qkv view``: the explorer as one self-contained HTML page, computed as ``qkv serve`` does.

The page itself (the ``static/`` files inlined with the data) is built by the library,
:mod:`qkv.capture.page`, which also gives the notebook view (``AttentionMaps._repr_html_``);
its functions are re-exported here. This module adds :func:`view_page`: the server's
computation and limits for one text, as one offline page.
"""

from __future__ import annotations

from qkv.capture.page import (
    OFFLINE_CSP,
    maps_from_response,
    maps_response,
    notebook_html,
    render_page,
)

__all__ = [
    "OFFLINE_CSP",
    "maps_from_response",
    "maps_response",
    "notebook_html",
    "render_page",
    "view_page",
]


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
    req.long = False  # the page holds every map as JSON: TOKEN_LIMIT tokens at most
    entry = entry_for(model)
    response = attention(entry, req)
    return render_page(response, title=title), response
