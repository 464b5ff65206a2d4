"""Input limits (qkv.limits) and atomic writes (qkv.atomic)."""

import errno
import os
import sys

import pytest

from qkv import atomic
from qkv.atomic import atomic_path, atomic_write_text, check_output_path
from qkv.data import Tokenizer
from qkv.limits import fit_text, split_sentences, split_to_fit


def test_fit_text_keeps_whole_words_within_the_limit():
    assert fit_text("a b c", 5) == ("a b c", None)
    assert fit_text("one two three four", 2) == ("one two", 4)
    text = "word " * 20_000
    cut, n = fit_text(text, 100)
    assert n == 20_000 and cut.split() == ["word"] * 100


def test_fit_text_with_a_tokenizer_count_and_no_spaces():
    tok = Tokenizer.train(["the cat sat", "男孩训练小狗"], vocab_size=300, min_frequency=1)
    count = lambda t: len(tok.encode(t))  # noqa: E731
    text = "男孩训练小狗。" * 5000  # one "word" of 35,000 characters
    cut, n = fit_text(text, 50, count)
    assert n == 1 and 0 < count(cut) <= 50 and text.startswith(cut)
    with pytest.raises(ValueError, match="limit"):
        fit_text("a", 0)


def test_split_to_fit_loses_nothing_and_every_piece_fits():
    tok = Tokenizer.train(["a dog runs in the park", "le chat dort"], vocab_size=300,
                          min_frequency=1)  # fmt: skip
    count = lambda t: len(tok.encode(t))  # noqa: E731
    text = "A dog runs. " + "the cat sleeps on the mat " * 40 + "! Le chat dort? 男孩训练小狗。好"
    pieces = split_to_fit(text, 16, count)
    assert all(0 < count(p) <= 16 for p in pieces)
    assert "".join("".join(pieces).split()) == "".join(text.split())
    assert pieces[0] == "A dog runs."
    assert split_sentences("Un. Deux! 三。四") == ["Un.", "Deux!", "三。", "四"]


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out.html"
    atomic_write_text(target, "old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("disk on fire")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == [
        "out.html"
    ]
    (tmp_path / "d.html").mkdir()
    with pytest.raises(IsADirectoryError):
        atomic_write_text(tmp_path / "d.html", "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.html", "out.html"]


def test_check_output_path(tmp_path):
    assert check_output_path(tmp_path / "a.md", (".md",)) == tmp_path / "a.md"
    for bad, msg in [(tmp_path / "a.txt", ".md"), (tmp_path / "no" / "a.md", "does not exist"),
                     (tmp_path, "directory")]:  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            check_output_path(bad, (".md",) if msg != "directory" else ())


def test_atomic_errors_name_the_target_never_the_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "out.html"
    # the block's write fails (a full disk): the target is named, with the same errno
    with pytest.raises(OSError) as info, atomic_path(target) as tmp:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp))
    assert info.value.errno == errno.ENOSPC
    assert str(info.value) == f"[Errno 28] cannot write {str(target)!r}: No space left on device"
    assert ".tmp" not in str(info.value) and list(tmp_path.iterdir()) == []
    # an error about something else (an input the block read) is left as it is
    with pytest.raises(FileNotFoundError) as info, atomic_path(target):
        open(tmp_path / "input.txt")
    assert "input.txt" in str(info.value) and list(tmp_path.iterdir()) == []

    # the rename fails (another user's file in a sticky directory)
    def refuse(src, dst):
        raise PermissionError(errno.EPERM, "Operation not permitted", str(src), str(dst))

    monkeypatch.setattr(atomic.os, "replace", refuse)
    with pytest.raises(PermissionError, match=f"cannot write {str(target)!r}: Operation not "
                                              "permitted$"):  # fmt: skip
        atomic_write_text(target, "x")
    assert list(tmp_path.iterdir()) == []


def test_atomic_temporary_file_that_cannot_be_made_names_the_target(tmp_path, monkeypatch):
    def refuse(prefix, suffix, dir):
        raise PermissionError(errno.EACCES, "Permission denied", f"{dir}/{prefix}k5ay_4d7{suffix}")

    monkeypatch.setattr(atomic.tempfile, "mkstemp", refuse)
    with pytest.raises(PermissionError) as info:
        atomic_write_text(tmp_path / "x.html", "x")
    want = f"[Errno 13] cannot write {str(tmp_path / 'x.html')!r}: Permission denied"
    assert str(info.value) == want


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's /proc takes no files")
def test_atomic_write_into_proc_names_the_target():
    with pytest.raises(OSError, match="cannot write '/proc/qkv-test.html'") as info:
        atomic_write_text("/proc/qkv-test.html", "x")
    assert ".tmp" not in str(info.value)


def test_atomic_write_of_a_name_near_the_limit(tmp_path):
    name = "a" * 250 + ".html"  # 255 bytes: fits, its temporary name must too
    atomic_write_text(tmp_path / name, "x")
    assert [p.name for p in tmp_path.iterdir()] == [name]


def test_view_to_an_unwritable_destination_exits_2_naming_it(tmp_path, monkeypatch, capsys):
    from qkv.apps.cli import main

    out = tmp_path / "x.html"

    def refuse(prefix, suffix, dir):  # what a directory without write permission does
        raise PermissionError(errno.EACCES, "Permission denied", os.path.join(dir, prefix + suffix))

    monkeypatch.setattr(atomic.tempfile, "mkstemp", refuse)
    assert main(["view", "The boy.", "--model", "random", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"qkv view: error: [Errno 13] cannot write {str(out)!r}: Permission denied" in err
    assert ".tmp" not in err and not out.exists()
