"""qkv in the browser: the static site and its in-page model engine.

``qkv web build DIR`` (:mod:`qkv.apps.web.build`) writes the explorer as a static site: its
own front-end (``qkv/apps/serve/static/``) with an engine that runs in the page. Each model's
first view is computed at build time by the server's code and saved as JSON; other requests go
to the in-page engine, whose models and scripts :mod:`qkv.apps.web.export` writes. See
``docs/web.md`` ("Building the site") and, for readers, ``docs/explorer.md``.

    build.py        the site: files, saved answers, the page, size checks
    site_static/    the site's own files: site.js (the engine the page talks to), its words
    export.py       the in-page engine's models (ONNX graphs) and runtime
    static/         the in-page engine's scripts
"""
