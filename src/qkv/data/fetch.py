"""Multi30k task 1, downloaded from its public repository and checked: ``qkv data fetch``.

The twelve files qkv trains and reports on, ``{train,val,test_2016_flickr,test_2017_flickr}``
× ``{en,fr,de}`` as gzipped text (about 2 MB in all), come from the Multi30k repository
(``github.com/multi30k/dataset``, ``data/task1/raw/``) at a pinned commit; each must have the
size and sha256 recorded in :data:`FILES` before it takes its name. They land in the layout
:func:`qkv.data.multi30k` reads (``DIR/train.en.gz``, ...).

>>> fetch(user_data_dir())  # doctest: +SKIP
[Fetched(name='train.en.gz', path=..., size=568929, status='downloaded'), ...]

Resumable, and never half-written: a file already there with the recorded digest is kept; a
download goes to ``NAME.part`` beside its target and is renamed onto ``NAME`` only once it is
complete and checked. An interrupted download leaves its ``.part``, which the next call
continues (HTTP ``Range``; a server that ignores it sends the whole file again); bytes that
turn out wrong are deleted, never renamed. Network access is :mod:`urllib` with a timeout,
and only inside :func:`fetch`: importing this module reads nothing.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from qkv.data.corpus import user_data_dir

__all__ = ["BASE_URL", "COMMIT", "FILES", "FetchError", "Fetched", "base_url", "fetch"]

# The Multi30k repository at the commit that added data/task1/raw (17 January 2018); the files
# below have not changed in it since. ``--url`` / ``base_url=`` name a mirror instead: any
# base URL (file:// too) under which the same file names are found.
COMMIT = "c9be912dc05a3ebf9ae5bb5f7f58c1791cda43ab"
BASE_URL = f"https://raw.githubusercontent.com/multi30k/dataset/{COMMIT}/data/task1/raw"

# name -> (bytes, sha256): the files the project trained and tested on (the shipped models'
# data and their model cards' scores, ../shared/data/multi30k), byte for byte the
# repository's files at COMMIT (compared blob by blob).
FILES: dict[str, tuple[int, str]] = {
    "train.en.gz": (568929, "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f"),
    "train.fr.gz": (604242, "622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c"),
    "train.de.gz": (637044, "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6"),
    "val.en.gz": (21650, "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28"),
    "val.fr.gz": (23001, "ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9"),
    "val.de.gz": (24681, "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a"),
    "test_2016_flickr.en.gz": (21077, "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9"),
    "test_2016_flickr.fr.gz": (22310, "6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90"),
    "test_2016_flickr.de.gz": (22890, "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8"),
    "test_2017_flickr.en.gz": (19138, "76a444ee25172e72695cddb13ae4a3bda59430617be88e0bb46b60504f054074"),
    "test_2017_flickr.fr.gz": (20434, "3ba671ceb2299f3304ffafefea7a833d08632fbaf0ba18546f8a2ec2391af496"),
    "test_2017_flickr.de.gz": (21471, "a2c89666db00c495cd8513b9d708d5a3acc205d7de312ef2bf5fb7ebc1540aee"),
}  # fmt: skip
TIMEOUT_S = 60.0  # per connection attempt and per read
SCHEMES = ("https", "http", "file")
_CHUNK = 1 << 16


class FetchError(OSError):
    """A file could not be fetched: the server is unreachable or refuses, the download was cut
    short, or the bytes are not the recorded ones. Nothing is written under the file's name."""


@dataclass(frozen=True)
class Fetched:
    """One file of :func:`fetch`: ``status`` is ``downloaded``, ``resumed`` (a ``.part``
    continued) or ``present`` (already there with the recorded digest)."""

    name: str
    path: Path
    size: int
    status: str


def base_url(s: str) -> str:
    """``s`` as a base URL to fetch from: an ``https://``, ``http://`` or ``file://`` URL, or a
    local directory (turned into its ``file://`` URL). Raises ``ValueError`` otherwise."""
    s = str(s).strip()
    if "://" not in s:
        try:
            local = Path(s).expanduser()
            if s and local.is_dir():
                return local.resolve().as_uri()
        except (OSError, ValueError, RuntimeError):  # a NUL byte, a name too long, no home
            pass
        raise ValueError(f"must be an https://, http:// or file:// URL or a directory, got {s!r}")
    if urlsplit(s).scheme.lower() not in SCHEMES:
        raise ValueError(f"must be an https://, http:// or file:// URL, got {s!r}")
    return s.rstrip("/")


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # not on every platform
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


Progress = Callable[[str, int, int], None]  # (name, bytes so far, bytes in all)


def fetch(
    directory: str | os.PathLike | None = None,
    url: str = BASE_URL,
    *,
    files: Mapping[str, tuple[int, str]] | None = None,
    timeout: float = TIMEOUT_S,
    said: Callable[[Fetched], None] | None = None,
    progress: Progress | None = None,
) -> list[Fetched]:
    """Download ``files`` (name → (bytes, sha256); default :data:`FILES`) from ``url``
    (``url/NAME``) into ``directory`` (default :func:`~qkv.data.corpus.user_data_dir`),
    checking each; returns what was done, file by file, and calls ``said`` after each.

    Raises :class:`FetchError` (an ``OSError``) when a file cannot be had or is not the
    recorded one, and ``FileExistsError`` when ``NAME`` is there with other bytes (it is left
    alone); files fetched before stay, and the next call resumes.
    """
    files = FILES if files is None else files
    url = base_url(url)
    directory = Path(user_data_dir() if directory is None else directory).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    done = []
    for name, (size, digest) in files.items():
        target = directory / name
        if target.exists() or target.is_symlink():
            if not target.is_file():
                raise FileExistsError(f"{target} is in the way: not a file")
            got = _sha256(target)
            if got != digest:
                raise FileExistsError(
                    f"{target} is there but is not the recorded {name} (sha256 {got[:16]}…, "
                    f"expected {digest[:16]}…); move it away, or fetch into another --dir"
                )
            status = "present"
            target.with_name(name + ".part").unlink(missing_ok=True)  # a leftover: not needed
        else:
            status = _download(f"{url}/{name}", target, size, digest, timeout, progress)
        done.append(Fetched(name, target, target.stat().st_size, status))
        if said is not None:
            said(done[-1])
    return done


def _download(url: str, target: Path, size: int, digest: str, timeout: float,
              progress: Progress | None) -> str:  # fmt: skip
    """``url`` into ``target`` through ``target.part``: ``downloaded`` or ``resumed``."""
    part = target.with_name(target.name + ".part")
    for _ in range(2):  # a continued .part whose bytes are wrong: once more from the start
        have = part.stat().st_size if part.is_file() else 0
        if have > size:  # not a prefix of this file
            part.unlink()
            have = 0
        continued = have > 0
        if have < size:
            continued = _get(url, part, have, size, timeout, progress)
        got = _sha256(part)
        if got == digest:
            os.replace(part, target)  # same directory: atomic
            _fsync_dir(target.parent)
            return "resumed" if continued else "downloaded"
        part.unlink()
        if not continued:
            raise FetchError(
                f"{url} is not the recorded {target.name} (sha256 {got[:16]}…, expected "
                f"{digest[:16]}…): deleted, nothing written; a wrong --url, or a damaged download"
            )
    raise AssertionError("unreachable: the second try starts from byte 0")


def _get(url: str, part: Path, offset: int, size: int, timeout: float,
         progress: Progress | None) -> bool:  # fmt: skip
    """Write ``url`` into ``part`` from byte ``offset`` (asking for the rest with ``Range``;
    from 0 when the server sends the whole file); True when ``part`` was continued. At most
    ``size`` bytes are taken."""
    request = urllib.request.Request(url, headers={"User-Agent": "qkv-data-fetch"})
    if offset:
        request.add_header("Range", f"bytes={offset}-")
    written = offset
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status = getattr(response, "status", None)
            ranged = response.headers.get("Content-Range", "") if response.headers else ""
            if offset and not (status == 206 and ranged.startswith(f"bytes {offset}-")):
                offset = written = 0  # the whole file came (file://, or no Range support)
            length = response.headers.get("Content-Length", "") if response.headers else ""
            expected = offset + int(length) if length.strip().isdigit() else None
            with open(part, "r+b" if offset else "wb") as f:
                f.seek(offset)
                f.truncate()
                while chunk := response.read(_CHUNK):
                    if written + len(chunk) > size:
                        raise FetchError(
                            f"{url} is longer than the recorded {size} bytes: not the "
                            "Multi30k file (a wrong --url?); nothing written"
                        )
                    f.write(chunk)
                    written += len(chunk)
                    if progress is not None:
                        progress(part.name.removesuffix(".part"), written, size)
                f.flush()
                os.fsync(f.fileno())
    except FetchError:
        part.unlink(missing_ok=True)
        raise
    except urllib.error.HTTPError as e:
        e.close()
        if e.code == 416 and offset:  # nothing after offset: the digest decides
            return True
        raise FetchError(f"cannot download {url}: HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        raise FetchError(f"cannot download {url}: {e.reason}{_kept(part)}") from None
    except (TimeoutError, ConnectionError, http.client.HTTPException) as e:
        why = (f"no data for {timeout:g} s" if isinstance(e, TimeoutError)
               else getattr(e, "strerror", None) or repr(e))  # fmt: skip
        raise FetchError(f"download of {url} failed: {why}{_kept(part)}") from None
    if written < size and expected is not None and written < expected:  # the connection ended
        raise FetchError(f"download of {url} cut short at {written} of {size} bytes{_kept(part)}")
    if written < size:  # all the server has
        part.unlink(missing_ok=True)
        raise FetchError(f"{url} is not the recorded file: it has {written} bytes, not {size} "
                         "(a wrong --url?); nothing written")  # fmt: skip
    return offset > 0


def _kept(part: Path) -> str:
    n = part.stat().st_size if part.is_file() else 0
    return f" ({n} bytes kept in {part}: run it again to resume)" if n else ""
