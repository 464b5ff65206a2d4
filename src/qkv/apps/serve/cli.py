"""``qkv serve``: the attention explorer in the browser (see ``docs/serve.md``).

qkv serve                                   # http://127.0.0.1:8000, MiniLM + random
qkv serve --model enfr=runs/enfr/best       # add a translation model directory
"""

from __future__ import annotations

import argparse

__all__ = ["add_parser"]


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {value!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {port}")
    return port


def _named_dir(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"must be NAME=DIR, got {value!r}")
    return name, path


def _serve(args: argparse.Namespace) -> int:
    from qkv.apps.serve.models import default_registry

    registry = default_registry(dict(args.model or []))  # checks every directory first
    unknown = [n for n in args.preload or [] if n not in registry.names()]
    if unknown:
        raise ValueError(f"--preload must name models from {registry.names()}, got {unknown}")
    for name in args.preload or []:
        registry.get(name)
    import uvicorn

    from qkv.apps.serve.app import create_app

    print(f"qkv serve: http://{args.host}:{args.port}/  (models: {', '.join(registry.names())})")
    uvicorn.run(create_app(registry), host=args.host, port=args.port, log_level=args.log_level)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="the attention explorer in the browser",
        description="Serve the live attention explorer: type a sentence, see every step of "
        "attention, every head, the translation's alignment; switch heads off.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (this machine only)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port")
    p.add_argument("--model", action="append", type=_named_dir, metavar="NAME=DIR",
                   help="also offer a model directory (a qkv translator, BERT, or any local "
                   "transformers model) as NAME; "
                   "repeatable (built in: minilm, random)")  # fmt: skip
    p.add_argument("--preload", action="append", metavar="NAME",
                   help="load this model at start instead of on first request")  # fmt: skip
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")  # fmt: skip
    p.set_defaults(func=_serve)
