"""``qkv serve``: a live attention explorer in the browser, over a small JSON API.

:func:`qkv.apps.serve.app.create_app` builds the Starlette app; :mod:`qkv.apps.serve.compute` is the
one computation per request (:mod:`qkv.apps.serve.compute_hf` for transformers models, the
parts both answers share in :mod:`qkv.apps.serve.answer`); :mod:`qkv.apps.serve.models` the
shared, lazily loaded models; :mod:`qkv.apps.serve.limits` what one request may ask for. The
front-end lives in ``static/`` (package data; the library's :mod:`qkv.capture.page` reads it
for the notebook view).
"""
