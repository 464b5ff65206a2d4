"""``qkv data fetch``: Multi30k task 1 into the directory ``qkv train``/``qkv evaluate`` read.

    qkv data fetch                          # into $QKV_DATA, else ~/.cache/qkv/multi30k
    qkv data fetch --dir data/multi30k      # anywhere; then qkv train --data data/multi30k
    qkv data fetch --url file:///mnt/mirror/multi30k   # a mirror with the same file names

One line per file on stdout (what was written, its size, checked), progress on stderr while a
file takes more than a second, and a last line naming the directory and how to use it. The
download itself, pinned and checked, is :mod:`qkv.data.fetch`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from qkv.apps.cli_args import output_dir
from qkv.data.corpus import default_data_dir, user_data_dir
from qkv.data.fetch import BASE_URL, Fetched, base_url, fetch


def _url(s: str) -> str:
    try:
        return base_url(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_url.__name__ = "URL"


class _Progress:
    """``name  45%  256/569 KiB`` on stderr once a file has taken a second: redrawn in place
    on a terminal, a line every 10 s otherwise (a log)."""

    def __init__(self, stream=None, clock=time.monotonic) -> None:
        self.stream, self.clock = stream or sys.stderr, clock
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.name, self.start, self.last, self.drawn = "", 0.0, 0.0, False

    def __call__(self, name: str, done: int, total: int) -> None:
        now = self.clock()
        if name != self.name:
            self.name, self.start, self.last = name, now, -float("inf")
        if now - self.start < 1.0 or (done < total and now - self.last < (0.2 if self.tty else 10)):
            return
        self.last = now
        line = f"{name}  {100 * done // max(total, 1):3d}%  {done // 1024}/{total // 1024} KiB"
        self.stream.write(f"\r{line}\033[K" if self.tty else line + "\n")
        self.stream.flush()
        self.drawn = self.tty

    def clear(self) -> None:
        if self.drawn:  # the per-file line on stdout replaces it
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.drawn = False


def _fetch(args: argparse.Namespace) -> int:
    directory = Path(args.dir).expanduser() if args.dir else user_data_dir()
    print(f"Multi30k task 1 (en, fr, de) from {args.url}")
    progress = _Progress()

    def said(f: Fetched) -> None:
        progress.clear()
        print(f"{f.status:<10}  {f.path}  ({f.size:,} bytes, sha256 checked)", flush=True)

    try:
        got = fetch(directory, args.url, said=said, progress=progress)
    finally:
        progress.clear()
    directory = directory.resolve()  # the last line is to be copied: from anywhere
    d = shlex.quote(str(directory))
    found = default_data_dir()
    where = ("; train and evaluate find it there without --data"
             if found is not None and found.resolve() == directory
             else f"; or export QKV_DATA={d} and leave --data out")  # fmt: skip
    total = sum(f.size for f in got) / 1e6
    print(f"Multi30k is in {directory} ({len(got)} files, {total:.1f} MB): "
          f"qkv train --data {d}{where}")  # fmt: skip
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("data", help="get the data qkv trains and evaluates on (Multi30k)",
                       description="Get the data qkv trains and evaluates on.")  # fmt: skip
    actions = p.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    f = actions.add_parser(
        "fetch", help="download Multi30k task 1 (en, fr, de), pinned and sha256-checked",
        description="Download Multi30k task 1 (train, val, test_2016_flickr, "
        "test_2017_flickr × en, fr, de; ~2 MB) from its repository at a pinned commit, check "
        "every file's sha256 and write them where qkv train/evaluate read. Resumable: files "
        "already there are checked, not downloaded again.",
    )  # fmt: skip
    f.add_argument("--dir", type=output_dir, default=None,
                   help="directory to write into (default: $QKV_DATA, else "
                   "~/.cache/qkv/multi30k: where train and evaluate look without --data)")  # fmt: skip
    f.add_argument("--url", type=_url, default=BASE_URL,
                   help="base URL of the files: a mirror (https://, http://, file://) or a "
                   "local directory holding them")  # fmt: skip
    # errors and notes say "qkv data fetch", not "qkv data"
    f.set_defaults(func=_fetch, command="data fetch")
