"""Applications built on the library: the ``qkv`` command line and what it runs.

``cli`` (the entry point) and ``cli_args`` (typed options, one-line errors); ``tour``,
``walk`` and ``explain`` (the notes' walk through attention); ``translate`` and ``train``
(``qkv translate``/``evaluate``/``train``); ``embed`` and ``view`` (MiniLM embeddings, attention
maps and head statistics); ``serve`` (the live explorer). The library's layers sit one level up:
``qkv.functional``, ``qkv.attention``, ``qkv.kernels``, ``qkv.models``, ``qkv.inspect``, ...
"""
