"""The command line's boundary: option types, text input, and one way to fail.

Every ``qkv`` subcommand is built with :class:`Parser` and checks its values with the
``type=`` callables below, so a bad value is rejected while parsing, before any model is
loaded or any file written. Every failure is one line on stderr::

    qkv <command>: error: <what is wrong>          exit 2  (bad input, bad model file)
    qkv <command>: internal error: <...>           exit 1  (a bug; QKV_DEBUG=1 shows the traceback)

>>> p = Parser(prog="qkv explain")
>>> _ = p.add_argument("--beam", type=positive_int, default=1)
>>> p.parse_args(["--beam", "4"]).beam
4
"""

from __future__ import annotations

import argparse
import errno
import io
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from qkv.atomic import check_output_path
from qkv.kernels._settings import SettingError
from qkv.kernels._settings import value as setting

__all__ = [
    "EXIT_PIPE",
    "CliError",
    "StdoutError",
    "Parser",
    "clean_text",
    "device",
    "float_range",
    "guard_stdout",
    "int_range",
    "nonneg_int",
    "note",
    "output_dir",
    "output_file",
    "positive_int",
    "probability",
    "read_stdin_lines",
    "run_command",
    "text",
    "threads",
]

MAX_STDIN_BYTES = 16 * 2**20
_LONE_SURROGATE = re.compile("[\ud800-\udc7f\udd00-\udfff]")


class CliError(Exception):
    """A user error found by a command while it runs: one line, exit 2."""


def _one_line(msg: object, limit: int = 600) -> str:
    s = " ".join(str(msg).split())
    return s if len(s) <= limit else s[: limit - 1] + "…"


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` for every option that has a default, with or without help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:  # "(default: None)" says nothing
            return action.help or ""
        return super()._get_help_string(action)

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and action.default not in (None, False, argparse.SUPPRESS):
            if action.option_strings and not isinstance(action, argparse._VersionAction):
                action.help = "(default: %(default)s)"
        return super()._format_action(action)


class Parser(argparse.ArgumentParser):
    """``ArgumentParser`` whose usage errors are one line (``qkv view: error: ...``, exit 2) and
    whose ``--help`` shows every default. Subcommand parsers made from it are Parsers too."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {_one_line(message)}", file=sys.stderr)
        raise SystemExit(2)

    def _print_message(self, message: str, file=None) -> None:
        # argparse drops write errors: a --help written nowhere would exit 0
        if not message:
            return
        file = file or sys.stderr
        try:
            file.write(message)
        except (BrokenPipeError, StdoutError):
            raise
        except OSError as e:
            if file is not sys.stdout:
                raise
            raise StdoutError(e.errno, f"cannot write to stdout: {e.strerror or e}") from None


# ---- option types: each raises ArgumentTypeError, which argparse reports as
#      "argument --x: <message>"


def _int(s: str) -> int:
    try:
        return int(str(s).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {s!r}") from None


def int_range(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An integer in ``[lo, hi]`` (either end open when ``None``)."""

    def parse(s: str) -> int:
        v = _int(s)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            want = (f"in [{lo}, {hi}]" if lo is not None and hi is not None
                    else f">= {lo}" if lo is not None else f"<= {hi}")  # fmt: skip
            raise argparse.ArgumentTypeError(f"must be an integer {want}, got {s!r}")
        return v

    parse.__name__ = "int"
    return parse


positive_int = int_range(1)
positive_int.__doc__ = "An integer >= 1."
nonneg_int = int_range(0)
nonneg_int.__doc__ = "An integer >= 0."


def float_range(
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> Callable[[str], float]:
    """A finite float in ``[lo, hi]``; ``lo_open``/``hi_open`` exclude an end. NaN and inf are
    always refused."""

    def parse(s: str) -> float:
        try:
            v = float(str(s).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {s!r}") from None
        bad_lo = lo is not None and (v <= lo if lo_open else v < lo)
        bad_hi = hi is not None and (v >= hi if hi_open else v > hi)
        if not math.isfinite(v) or bad_lo or bad_hi:
            left = "" if lo is None else ("(" if lo_open else "[") + f"{lo:g}"
            right = "" if hi is None else f"{hi:g}" + (")" if hi_open else "]")
            want = (f"in {left}, {right}" if lo is not None and hi is not None
                    else f"{'>' if lo_open else '>='} {lo:g}" if lo is not None
                    else f"{'<' if hi_open else '<='} {hi:g}" if hi is not None
                    else "finite")  # fmt: skip
            raise argparse.ArgumentTypeError(f"must be a finite number {want}, got {s!r}")
        return v

    parse.__name__ = "float"
    return parse


probability = float_range(0.0, 1.0, hi_open=True)
probability.__doc__ = "A float in [0, 1) (dropout, label smoothing)."


def max_threads() -> int:
    """The most threads ``--threads`` accepts: 4 × the CPUs this process may use."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        n = os.cpu_count() or 1
    return 4 * max(n, 1)


def threads(s: str) -> int:
    """A thread count in ``[1, 4 × CPUs]``."""
    return int_range(1, max_threads())(s)


def device(s: str) -> str:
    """``cpu``, or ``cuda``/``cuda:N`` when CUDA is available here."""
    import torch

    name = str(s).strip().lower()
    try:
        d = torch.device(name)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"must be cpu or cuda[:N], got {s!r}") from None
    if d.type == "cpu":
        return name
    if d.type != "cuda":
        raise argparse.ArgumentTypeError(f"must be cpu or cuda[:N], got {s!r}")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(
            f"{s!r} asked for, but CUDA is not available here (torch {torch.__version__}); "
            "use --device cpu"
        )
    if d.index is not None and d.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(
            f"{s!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return name


def output_file(*suffixes: str) -> Callable[[str], Path]:
    """A file that can be written: parent exists, not a directory, extension in ``suffixes``
    (any when none are given). Checked while parsing, before any work."""
    suffixes = tuple(s.lower() for s in suffixes)

    def parse(s: str) -> Path:
        try:
            return check_output_path(s, suffixes)
        except (OSError, ValueError) as e:  # also "file name too long", a NUL byte
            raise argparse.ArgumentTypeError(_one_line(e)) from None

    parse.__name__ = "output file"
    return parse


def output_dir(s: str) -> str:
    """A directory to write into: either an existing directory or a path whose nearest existing
    ancestor is a writable directory (it is created later, when work starts). Returned as the
    string given (it may be stored in checkpoints read with ``weights_only=True``)."""
    try:
        return _output_dir(s)
    except (OSError, ValueError) as e:  # "file name too long", a NUL byte
        raise argparse.ArgumentTypeError(_one_line(e)) from None


def _output_dir(s: str) -> str:
    path = Path(s)
    if not s:
        raise argparse.ArgumentTypeError("must name a directory, got ''")
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{s!r} exists and is not a directory")
    anc = path
    while not anc.exists():
        anc = anc.parent
    if not anc.is_dir() or not os.access(anc, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot create {s!r}: {str(anc)!r} is not writable")
    return s


# ---- text from argv and stdin


def note(message: str, command: str | None = None) -> None:
    """One line on stderr: ``qkv <command>: note: ...``."""
    prog = "qkv" if command is None else f"qkv {command}"
    print(f"{prog}: note: {_one_line(message)}", file=sys.stderr)


def clean_text(s: str, *, where: str = "the text") -> str:
    """``s`` with undecodable bytes (surrogates from argv) replaced by U+FFFD, saying so."""
    lone = _LONE_SURROGATE.sub("\ufffd", s)  # surrogates that are no escaped byte
    out = lone.encode("utf-8", "surrogateescape").decode("utf-8", "replace")  # argv's bytes
    if out != s:
        note(f"invalid UTF-8 in {where} replaced by U+FFFD")
    return out


def text(s: str) -> str:
    """argparse type for free text from argv: invalid UTF-8 replaced (and said so)."""
    return clean_text(s)


def read_stdin_lines(max_bytes: int = MAX_STDIN_BYTES) -> list[str]:
    """Lines of stdin, decoded as UTF-8 with errors replaced (and said so); at most
    ``max_bytes`` are read, with a note when more were given."""
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:  # a text stream (tests): go through its bytes
        data = sys.stdin.read(max_bytes + 1).encode("utf-8", "surrogateescape")
    else:
        data = stream.read(max_bytes + 1)
    if len(data) > max_bytes:
        data = data[:max_bytes]
        note(f"stdin cut to its first {max_bytes} bytes")
    out = data.decode("utf-8", "replace")
    try:
        same = out.encode("utf-8") == data
    except UnicodeEncodeError:
        same = False
    if not same:
        note("invalid UTF-8 on stdin replaced by U+FFFD")
    return out.splitlines()


# ---- running a command

EXIT_PIPE = 141  # stdout's reader left (``qkv ... | head -1``): 128 + SIGPIPE, as a shell tool


class StdoutError(OSError):
    """Standard output cannot be written (closed, a full disk, an I/O error): exit 2."""


class _ClosedStdout(io.TextIOBase):
    """``sys.stdout`` of a process started with file descriptor 1 closed (``qkv ... >&-``):
    writing to it is an error (Python's own ``None`` there drops every ``print`` silently),
    and the next flush says so again, for writers that swallow errors (argparse's help)."""

    lost = False

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.lost = True
        raise StdoutError(errno.EBADF, "cannot write to stdout: it is closed")

    def flush(self) -> None:
        if self.lost:  # once: the interpreter's own flush at exit must not fail again
            self.lost = False
            raise StdoutError(errno.EBADF, "cannot write to stdout: it is closed")


def guard_stdout() -> None:
    """Make a closed stdout an error to write to, not a silent loss of the output, and keep
    its file descriptor taken (by ``/dev/null``), so that no file opened later becomes the
    process's stdout."""
    if sys.stdout is not None:
        return
    try:
        os.fstat(1)
    except OSError:  # closed: the next file opened would get descriptor 1
        fd = os.open(os.devnull, os.O_WRONLY)
        if fd != 1:  # taken meanwhile: leave it
            os.close(fd)
    sys.stdout = _ClosedStdout()


def _flush_stdout() -> None:
    """Flush stdout, so that a write error surfaces while the command can report it (a
    :class:`StdoutError`, or ``BrokenPipeError`` when its reader left)."""
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
    except (BrokenPipeError, StdoutError):
        raise
    except OSError as e:
        raise StdoutError(e.errno, f"cannot write to stdout: {e.strerror or e}") from None


def _drop_stdout() -> None:
    """After a failure: flush what stdout holds, and if that fails point its descriptor at
    ``/dev/null``, so that the interpreter's own flush at exit cannot fail again."""
    try:
        _flush_stdout()
    except OSError:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # no descriptor (a test's capture)
            pass


def run_command(command: str, fn: Callable[[], int | None]) -> int:
    """Run ``fn()`` and turn every failure into one stderr line and an exit code.

    Exit 0 on success, 2 for bad input (``CliError``, a missing file, a bad model file, any
    ``ValueError``, a bad ``QKV_*`` setting, output that cannot be written, stdout
    included), 130 on Ctrl-C (also when ``fn`` returns 130: a run that stopped on a signal),
    141 quietly when stdout's reader left (a closed pipe), 1 for anything unexpected.
    ``QKV_DEBUG=1`` re-raises instead, so the traceback shows.
    """
    prog = f"qkv {command}" if command else "qkv"
    try:
        debug = setting("QKV_DEBUG") == "1"
    except SettingError as e:
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    try:
        code = int(fn() or 0)
        _flush_stdout()
    except SystemExit as e:  # raise SystemExit("message") from older code paths
        if isinstance(e.code, str):
            if debug:
                raise
            print(f"{prog}: error: {_one_line(e.code)}", file=sys.stderr)
            return 2
        raise
    except KeyboardInterrupt:
        if debug:
            raise
        code = 130
    except BrokenPipeError:  # stdout's reader left: nothing to say, and nobody to say it to
        _drop_stdout()
        return EXIT_PIPE
    except (CliError, OSError, ValueError, UnicodeError) as e:
        if debug:
            raise
        _drop_stdout()
        if isinstance(e, OSError) and not isinstance(e, (FileNotFoundError, NotADirectoryError,
                                                         IsADirectoryError, PermissionError,
                                                         FileExistsError)):  # fmt: skip
            msg = f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
        else:
            msg = str(e)
        print(f"{prog}: error: {_one_line(msg)}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug: still one line, the traceback on request
        if debug:
            raise
        _drop_stdout()
        print(f"{prog}: internal error: {type(e).__name__}: {_one_line(e, 300)} "
              "(set QKV_DEBUG=1 to see the traceback)", file=sys.stderr)  # fmt: skip
        return 1
    if code == 130:  # Ctrl-C, or a run that stopped on it (qkv train, after its checkpoint)
        _drop_stdout()
        print(f"{prog}: interrupted", file=sys.stderr)
    return code
