"""Input limits (qkv.limits) and atomic writes (qkv.atomic)."""

import pytest

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
