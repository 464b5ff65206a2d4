"""The ``qkv`` command line. Each subcommand lives in its own module with ``add_parser``.

Option values are checked while parsing (:mod:`qkv.apps.cli_args`); every failure is one line on
stderr, ``qkv <command>: error: ...``, exit 2 for bad input (and output that cannot be
written, stdout included) and 1 for an internal error (``QKV_DEBUG=1`` shows its traceback).
A pipe whose reader left (``qkv ... | head -1``) ends the command quietly, exit 141. See
``docs/errors.md``.
"""

from __future__ import annotations

import importlib
import sys

from qkv.apps.cli_args import Parser, guard_stdout, run_command

# the module under qkv/apps/ whose add_parser(subparsers) defines each subcommand, in --help order
SUBCOMMANDS = ["tour", "explain", "translate", "train", "data_cli", "embed", "view", "serve.cli",
               "web_cli"]


def build_parser() -> Parser:
    parser = Parser(prog="qkv", description="Attention, in full and in the open.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"qkv.apps.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand; returns its exit code (0 ok, 1 internal error, 2 bad input,
    130 interrupted, 141 stdout's reader left)."""
    guard_stdout()  # a closed stdout: writing to it is an error, not a silent loss
    parser = build_parser()
    parsed: list = []

    def parse() -> int:
        try:
            parsed.append(parser.parse_known_args(sys.argv[1:] if argv is None else argv))
        except SystemExit as e:  # --help (0) or a usage error already printed (2)
            return e.code if isinstance(e.code, int) else 2
        return 0

    code = run_command("", parse)  # an option type failing unexpectedly: still one line
    if not parsed:
        return code
    args, extra = parsed[0]
    if extra:  # reported by the subcommand's name, not by the top-level parser's
        print(f"qkv {args.command}: error: unrecognized arguments: {' '.join(extra)}",
              file=sys.stderr)  # fmt: skip
        return 2
    return run_command(args.command, lambda: args.func(args))
