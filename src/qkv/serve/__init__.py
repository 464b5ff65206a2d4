"""``qkv serve``: a live attention explorer in the browser, over a small JSON API.

:func:`qkv.serve.app.create_app` builds the Starlette app; :mod:`qkv.serve.compute` is the
one computation per request; :mod:`qkv.serve.models` the shared, lazily loaded models;
:mod:`qkv.serve.limits` what one request may ask for. The front-end lives in ``static/``.
"""
