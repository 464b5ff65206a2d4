"""``qkv web build DIR``: the explorer as a static site that runs in the browser (see
``docs/web.md``, "Building the site").

    qkv web build site/live                      # every shipped model
    qkv web build site/live --models en-fr,random
    python -m http.server -d site/live           # then open http://127.0.0.1:8000/
"""

from __future__ import annotations

import argparse
import time

from qkv.apps.cli_args import Parser

__all__ = ["add_parser"]


def _models(value: str) -> list[str]:
    from qkv.apps.web.build import check_models

    try:
        return check_models(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _target(value: str):
    from qkv.apps.web.build import check_target

    try:
        return check_target(value)
    except (OSError, ValueError) as err:  # also a name too long, a NUL byte
        raise argparse.ArgumentTypeError(str(err)) from None


def _build(args: argparse.Namespace) -> int:
    from qkv.apps.web.build import build_site

    t0 = time.perf_counter()
    say = lambda line: print(f"qkv web build: {line}", flush=True)  # noqa: E731
    summary = build_site(args.dir, args.models, progress=say)
    names = ", ".join(m["name"] for m in summary["models"])
    engine = "in-page engine" if summary["engine"] else "saved answers only, no in-page engine"
    say(f"site written: {args.dir}/ ({summary['bytes'] / 1e6:.1f} MB; {names}; {engine}) in "
        f"{time.perf_counter() - t0:.0f} s; try it: python -m http.server -d {args.dir}")  # fmt: skip
    return 0


def add_parser(sub) -> None:
    from qkv.apps.web.build import SITE_MODELS

    p = sub.add_parser("web", help="the explorer as a static site (runs in the browser)",
                       description="The attention explorer as a static site that any static "
                       "file server serves: the shipped models run in the page.")  # fmt: skip
    web = p.add_subparsers(dest="web_command", required=True, metavar="COMMAND",
                           parser_class=Parser)  # fmt: skip
    b = web.add_parser("build", help="write the site into DIR",
                       description="Write the explorer as a self-contained static site into "
                       "DIR (replaced whole if an earlier build wrote it): the page, each "
                       "model's first view computed now, the in-page engine's files.")  # fmt: skip
    b.add_argument("dir", type=_target, metavar="DIR",
                   help="a new or empty directory, or a site built before")  # fmt: skip
    b.add_argument("--models", type=_models, metavar="A,B",
                   help=f"models in the site, from {','.join(SITE_MODELS)} (default: all)")  # fmt: skip
    b.set_defaults(func=_build)
