"""``qkv serve``: the attention explorer in the browser (see ``docs/serve.md``).

qkv serve                                   # http://127.0.0.1:8000, MiniLM + random
qkv serve --model enfr=runs/enfr/best       # add a translation model directory
qkv serve --allow-host qkv.example.org      # also answer to that name (behind a proxy)
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import re
import socket

from qkv.apps.cli_args import CliError

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


def _host_name(value: str) -> str:
    """A host name or IP address without port or scheme, lowercase (``[::1]`` → ``::1``)."""
    name = value.strip().lower()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        pass
    if not re.fullmatch(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*", name):
        raise argparse.ArgumentTypeError(f"must be a host name without port or scheme, "
                                         f"e.g. qkv.example.org, got {value!r}")  # fmt: skip
    return name


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` as uvicorn binds one (``SO_REUSEADDR``), to be
    handed to it: a port in use, or an address that is not this machine's, is one line and
    exit 2 before any model loads (uvicorn would say ``ERROR: [Errno 98]`` and exit 3)."""
    shown = f"[{host}]" if ":" in host else host  # an IPv6 address
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise CliError(f"port {shown}:{port} is in use (another server?): stop it, or "
                           "choose another port with --port") from None  # fmt: skip
        raise CliError(f"cannot listen on {shown}:{port} (--host, --port): "
                       f"{e.strerror or e}") from None  # fmt: skip
    return sock


def _serve(args: argparse.Namespace) -> int:
    from qkv.apps.serve.models import default_registry

    sock = _listen(args.host, args.port)  # first: a port in use is said before models load
    try:
        registry = default_registry(dict(args.model or []))  # checks every directory first
        unknown = [n for n in args.preload or [] if n not in registry.names()]
        if unknown:
            raise ValueError(f"--preload must name models from {registry.names()}, got {unknown}")
        for name in args.preload or []:
            registry.get(name)
        import uvicorn

        from qkv.apps.serve.app import create_app
        from qkv.apps.serve.server import TimedH11Protocol

        app = create_app(registry, allow_hosts=args.allow_host or [], host=args.host)
        shown = f"[{args.host}]" if ":" in args.host else args.host  # an IPv6 address
        port = sock.getsockname()[1]  # --port 0: the one the system chose
        print(f"qkv serve: http://{shown}:{port}/  (models: {', '.join(registry.names())})",
              flush=True)  # fmt: skip
        config = uvicorn.Config(app, host=args.host, port=port, log_level=args.log_level,
                                http=TimedH11Protocol)  # fmt: skip
        server = uvicorn.Server(config)
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:  # Ctrl-C stops the server: its normal end (as uvicorn.run)
            return 0
        if not server.started:  # uvicorn has logged why
            raise RuntimeError("the server did not start (see uvicorn's messages above)")
        return 0
    finally:
        sock.close()


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
    p.add_argument("--allow-host", action="append", type=_host_name, metavar="NAME",
                   help="also accept requests whose Host (and Origin) is NAME, any port: the "
                   "name of a proxy in front; repeatable (default: only this server's own "
                   "address)")  # fmt: skip
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")  # fmt: skip
    p.set_defaults(func=_serve)
