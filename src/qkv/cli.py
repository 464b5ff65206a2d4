"""The ``qkv`` command line. Each subcommand lives in its own module with ``add_parser``."""

from __future__ import annotations

import argparse
import importlib
import sys

# name of the module under qkv/ that defines add_parser(subparsers) for each subcommand
SUBCOMMANDS = ["demo", "explain", "tour", "train", "translate", "pretrained.cli", "inspect.cli"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qkv", description="Attention, in full and in the open.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"qkv.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return int(args.func(args) or 0)
