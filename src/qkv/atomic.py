"""Write a file all at once or not at all: a temporary file beside the target, renamed on success.

>>> with atomic_path("attention.html") as tmp:        # doctest: +SKIP
...     tmp.write_text(page)
>>> atomic_write_text("walk.md", text)               # doctest: +SKIP

The temporary file lives in the target's directory (same filesystem, so the rename is atomic)
under a unique hidden name, and is removed when the block raises: no ``NAME.tmp`` is ever
left behind, and an existing target is untouched until the new one is complete.

Errors name the target, never the temporary file (which the user never asked for): an
``OSError`` about the temporary file (it cannot be created, written or renamed) is raised
again as the same kind of error, with the same ``errno``, as ``cannot write 'TARGET': ...``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_path", "atomic_write_bytes", "atomic_write_text", "check_output_path"]


def check_output_path(path: str | os.PathLike, suffixes: tuple[str, ...] = ()) -> Path:
    """``path`` as a :class:`Path` if a file can be written there: not a directory, its parent an
    existing directory, and (when ``suffixes`` are given) one of those extensions. Raises
    ``ValueError`` naming the path otherwise. Checks only; writes nothing."""
    path = Path(path)
    if not str(path) or path.name in ("", ".", ".."):
        raise ValueError(f"output path must name a file, got {str(path)!r}")
    if suffixes and path.suffix.lower() not in suffixes:
        raise ValueError(f"output file must end in {' or '.join(suffixes)}, got {str(path)!r}")
    if path.is_dir():
        raise ValueError(f"output path {str(path)!r} is a directory; give a file name")
    parent = path.parent
    if not parent.is_dir():
        raise ValueError(f"cannot write {str(path)!r}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"cannot write {str(path)!r}: directory {str(parent)!r} is not writable")
    return path


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path in ``path``'s directory; rename it onto ``path`` when the block
    ends normally, delete it when the block raises. An ``OSError`` about the temporary file
    names ``path`` instead (see the module's docstring)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"output path {str(path)!r} is a directory; give a file name")
    # the name's start only: a name near the 255-byte limit must not overflow as a temporary
    prefix = f".{path.name[:_PREFIX_CHARS]}."
    try:
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=path.parent)
    except OSError as e:  # e.g. a directory that takes no new files (/proc), read-only
        raise _naming(e, None, path) from None
    os.close(fd)
    tmp = Path(name)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600: an ordinary file's mode
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and _names(e, tmp):
            raise _naming(e, tmp, path) from None
        raise


_PREFIX_CHARS = 100


def _names(e: OSError, tmp: Path) -> bool:
    """Whether ``e`` is about the temporary file ``tmp`` (not, say, an input the block read)."""
    return str(tmp) in (e.filename, e.filename2) or str(tmp) in str(e)


def _naming(e: OSError, tmp: Path | None, path: Path) -> OSError:
    """``e`` as the same kind of error (class, errno) about the user's ``path``."""
    what = e.strerror or str(e)
    if tmp is not None:
        what = what.replace(str(tmp), str(path))
    message = f"cannot write {str(path)!r}: {what}"
    return type(e)(e.errno, message) if e.errno is not None else type(e)(message)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)
