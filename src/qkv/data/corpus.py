"""Parallel text: Multi30k task-1 files, or any two aligned plain-text files.

Multi30k layout (``--data DIR``): ``{split}.{lang}.gz`` (or uncompressed) for splits such as
``train``, ``val``, ``test_2016_flickr``, ``test_2017_flickr``, ``test_2018_flickr``,
``test_2017_mscoco`` and languages ``en, fr, de, cs``: any split whose files are present.

Without ``--data`` (``data_dir=None``) the data is looked for in ``$QKV_DATA`` when it is set,
else in ``../shared/data/multi30k`` beside the project, else in :func:`user_data_dir`
(``~/.cache/qkv/multi30k``), where ``qkv data fetch`` puts it (:mod:`qkv.data.fetch`).
"""

from __future__ import annotations

import gzip
import os
import re
import shlex
from pathlib import Path

__all__ = [
    "read_lines", "read_parallel", "multi30k", "default_data_dir", "user_data_dir", "splits",
    "SPLITS",
]  # fmt: skip

SPLITS = ("train", "val", "test_2016_flickr", "test_2017_flickr")  # the ones qkv reports on
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]*")  # a split or language: a name, never a path
PROJECT_ROOT = Path(__file__).resolve().parents[3]


def user_data_dir() -> Path:
    """Where ``qkv data fetch`` puts Multi30k by default: ``$QKV_DATA`` when set, else
    ``$XDG_CACHE_HOME/qkv/multi30k`` (``~/.cache/qkv/multi30k``)."""
    if os.environ.get("QKV_DATA"):
        return Path(os.environ["QKV_DATA"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "qkv" / "multi30k"


def default_data_dir() -> Path | None:
    """The Multi30k directory used without ``--data``: ``$QKV_DATA`` when set (existing or
    not: a wrong setting is an error, not a silent fallback), else the first that exists of
    ``../shared/data/multi30k`` relative to the project root (or to the working directory's
    parent) and :func:`user_data_dir`; ``None`` when none does."""
    if os.environ.get("QKV_DATA"):
        return user_data_dir()
    candidates = [PROJECT_ROOT.parent / "shared" / "data" / "multi30k"]
    candidates += [Path.cwd().parent / "shared" / "data" / "multi30k", user_data_dir()]
    return next((p for p in candidates if p.is_dir()), None)


def _no_data(why: str, where: Path, given: bool) -> FileNotFoundError:
    """``why`` and how to get the data: ``qkv data fetch`` writes where it will be found."""
    fetch = "qkv data fetch"
    fetch += "" if where == user_data_dir() else f" --dir {shlex.quote(str(where))}"
    return FileNotFoundError(f"{why}: run `{fetch}`" + ("" if given else " (or pass --data DIR)"))


def read_lines(path: str | Path) -> list[str]:
    """Lines of a UTF-8 text file (``.gz`` read transparently), newline stripped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"missing data file: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n").rstrip("\r") for line in f]


def read_parallel(src_path: str | Path, tgt_path: str | Path) -> list[tuple[str, str]]:
    """Aligned ``(source, target)`` pairs; both files must have the same number of lines."""
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise ValueError(
            f"parallel files differ in length: {src_path} has {len(src)} lines, "
            f"{tgt_path} has {len(tgt)}"
        )
    return list(zip(src, tgt))


def _find(data_dir: Path, split: str, lang: str) -> Path:
    for name in (f"{split}.{lang}.gz", f"{split}.{lang}"):
        if (data_dir / name).is_file():
            return data_dir / name
    raise FileNotFoundError(f"missing data file: {data_dir / f'{split}.{lang}.gz'}")


def splits(data_dir: str | Path, src: str, tgt: str) -> list[str]:
    """The splits of ``data_dir`` that have both ``src`` and ``tgt`` files."""
    names = {p.name.split(".")[0] for p in Path(data_dir).glob(f"*.{src}*")}
    return sorted(n for n in names if _has(Path(data_dir), n, src) and _has(Path(data_dir), n, tgt))


def _has(data_dir: Path, split: str, lang: str) -> bool:
    return any((data_dir / f"{split}.{lang}{ext}").is_file() for ext in (".gz", ""))


def multi30k(
    split: str, src: str = "en", tgt: str = "fr", data_dir: str | Path | None = None
) -> list[tuple[str, str]]:
    """Pairs of Multi30k ``split`` for ``src → tgt`` (any of en, fr, de).

    >>> pairs = multi30k("val")  # doctest: +SKIP
    >>> pairs[0]  # doctest: +SKIP
    ('A group of men are loading cotton onto a truck', 'Un groupe d'hommes ...')
    """
    for name, value in (("split", split), ("src", src), ("tgt", tgt)):
        if not isinstance(value, str) or not _NAME.fullmatch(value):
            raise ValueError(f"{name} must be a plain name such as 'val' or 'en', got {value!r}")
    if src == tgt:
        raise ValueError(f"source and target languages must differ, got {src!r} twice")
    given = data_dir is not None
    if data_dir is None:
        data_dir = default_data_dir()
        if data_dir is None:
            raise _no_data(f"no Multi30k data in {user_data_dir()}", user_data_dir(), given)
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise _no_data(f"missing data directory: {data_dir}", data_dir, given)
    if not (_has(data_dir, split, src) and _has(data_dir, split, tgt)):
        have = ", ".join(splits(data_dir, src, tgt))
        why = f"no split {split!r} for {src}->{tgt} in {data_dir} (present: {have or 'none'})"
        raise FileNotFoundError(why) if have else _no_data(why, data_dir, given)
    return read_parallel(_find(data_dir, split, src), _find(data_dir, split, tgt))
