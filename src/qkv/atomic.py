"""Write a file all at once or not at all: a temporary file beside the target, renamed on success.

>>> with atomic_path("attention.html") as tmp:        # doctest: +SKIP
...     tmp.write_text(page)
>>> atomic_write_text("walk.md", text)               # doctest: +SKIP

The temporary file lives in the target's directory (same filesystem, so the rename is atomic)
under a unique hidden name, and is removed when the block raises: no ``NAME.tmp`` is ever
left behind, and an existing target is untouched until the new one is complete.
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
    ends normally, delete it when the block raises."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"output path {str(path)!r} is a directory; give a file name")
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600; give it an ordinary file's mode
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
