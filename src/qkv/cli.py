"""The ``qkv`` command line. Each subcommand lives in its own module with ``add_parser``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name of the module under qkv/ that defines add_parser(subparsers) for each subcommand
SUBCOMMANDS = [
    "demo",
    "explain",
    "tour",
    "train",
    "translate",
    "pretrained.cli",
    "inspect.cli",
    "serve.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qkv", description="Attention, in full and in the open.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"qkv.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand. Bad input (a missing file, a wrong option value) prints one line
    ``qkv: error: ...`` and exits 2; ``QKV_DEBUG=1`` shows the traceback instead."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return int(args.func(args) or 0)
    except (FileNotFoundError, NotADirectoryError, ValueError) as err:
        if os.environ.get("QKV_DEBUG"):
            raise
        print(f"qkv {args.command}: error: {err}", file=sys.stderr)
        return 2
