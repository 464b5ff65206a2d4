"""Translation as a user meets it: names, pieces for long text, empty lines, any script, splits."""

import gzip
import io
import warnings

import pytest
import torch

from qkv.apps.cli import main
from qkv.data import Tokenizer
from qkv.limits import split_to_fit
from qkv.models import Seq2SeqTransformer, TransformerConfig, save_pretrained
from qkv.translate import Translator, load

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random model with few positions (max_len 24: 11 source tokens per piece)."""
    d = tmp_path_factory.mktemp("tiny") / "m"
    tok = Tokenizer.train(["a dog runs in the park", "le chien court dans le parc"] * 10,
                          vocab_size=290)  # fmt: skip
    torch.manual_seed(0)
    cfg = TransformerConfig(src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size,
                            d_model=32, n_heads=4, d_ff=64, dropout=0.0, max_len=24)  # fmt: skip
    save_pretrained(Seq2SeqTransformer(cfg).eval(), d, tokenizer=tok)
    return d


def words(n: int) -> str:
    return " ".join(f"dog{i % 7}" for i in range(n))


@pytest.mark.parametrize(
    "text",
    ["A dog runs. A cat sleeps! Does it? " * 9, words(200), "犬が公園を走っています。" * 30,
     "x" * 500],
)  # fmt: skip
def test_pieces_fit_and_keep_every_word(text):
    tok = Tokenizer.train([text, "a b c"], vocab_size=290)
    n = lambda s: len(tok.encode(s))  # noqa: E731
    for limit in (5, 11, 40):
        pieces = split_to_fit(text, limit, n)
        assert all(n(p) <= limit for p in pieces), [n(p) for p in pieces]
        assert "".join("".join(pieces).split()) == "".join(text.split())


def test_empty_lines_stay_and_long_lines_are_translated_in_pieces(tiny_dir):
    tr = load(tiny_dir)
    assert tr.max_source_tokens == 11
    lines = ["a dog runs", "", "   ", words(60), "a dog"]
    with pytest.warns(UserWarning, match=r"line 4 .* 11 source tokens: translated in \d+ pieces"):
        out = tr(lines)
    assert len(out) == 5 and out[1] == out[2] == ""
    assert out[0] == tr("a dog runs")  # a line alone or among others: the same translation
    # the long line is the pieces' translations joined: nothing cut, nothing lost
    pieces = tr.pieces(words(60))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pieces fit: no further warning
        assert out[3] == " ".join(tr(pieces))


@pytest.mark.parametrize(
    "text", ["ကျွန်တော် ခွေးကို ချစ်တယ်။", "男孩训练小狗。", "🐶🐕 → 🐩", "Le garçon\u0301 ", "\x00\x07"]
)
def test_any_script_gives_output_and_no_error(tiny_dir, text):
    out = load(tiny_dir)(text)
    assert isinstance(out, str)


def test_cli_keeps_line_count_and_reports_pieces(tiny_dir, tmp_path, capsys, monkeypatch):
    f = tmp_path / "in.txt"
    f.write_text(f"a dog\n\n{words(40)}\nruns\n", encoding="utf-8")
    assert main(["translate", "--model", str(tiny_dir), "--file", str(f)]) == 0
    cap = capsys.readouterr()
    assert len(cap.out.splitlines()) == 4 and cap.out.splitlines()[1] == ""
    assert "note: line 3" in cap.err
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"a dog\n\xff runs\n\n")))
    assert main(["translate", "--model", str(tiny_dir)]) == 0
    cap = capsys.readouterr()
    assert len(cap.out.splitlines()) == 3 and "invalid UTF-8 on stdin" in cap.err


def test_missing_or_corrupt_model_is_one_line_exit_2(tmp_path, capsys):
    assert main(["translate", "--model", str(tmp_path / "nope"), "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such directory" in err and "shipped model" in err
    assert main(["translate", "--model", "xx-yy", "hi"]) == 2
    assert "xx-yy" in capsys.readouterr().err


def test_evaluate_takes_any_split_present(tiny_dir, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    for lang, text in (("en", "a dog\nruns\n"), ("fr", "le chien\ncourt\n")):
        (data / f"test_2018_flickr.{lang}.gz").write_bytes(gzip.compress(text.encode()))
    args = ["evaluate", "--model", str(tiny_dir), "--data", str(data), "--src", "en",
            "--tgt", "fr", "--json"]  # fmt: skip
    assert main([*args, "--split", "test_2018_flickr"]) == 0
    assert '"split": "test_2018_flickr"' in capsys.readouterr().out
    assert main([*args, "--split", "test_2017_mscoco"]) == 2
    assert "present: test_2018_flickr" in capsys.readouterr().err


def test_a_translator_is_a_plain_callable(tiny_dir):
    tr = load(str(tiny_dir))
    assert isinstance(tr, Translator) and tr.name == str(tiny_dir)
    assert isinstance(tr("a dog"), str) and tr(["a dog", ""])[1] == ""
    with pytest.raises(ValueError, match="beam must be >= 1"):
        tr("a dog", beam=0)
    with pytest.raises(TypeError):
        tr([1, 2])


def test_no_text_on_a_terminal_says_how_instead_of_waiting(tiny_dir, capsys, monkeypatch):
    """``qkv translate`` with nothing to translate and a terminal as stdin: exit 2 at once,
    one line saying how to give text (a pseudo-terminal: isatty is the real one)."""
    import os
    import pty

    master, slave = pty.openpty()
    with os.fdopen(slave, "r") as tty:
        monkeypatch.setattr("sys.stdin", tty)
        assert main(["translate", "--model", str(tiny_dir)]) == 2
    os.close(master)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qkv translate: error: no text to translate")
    assert "--file" in err[0] and "| qkv translate" in err[0]


def test_capitals_are_translated_as_a_caption_and_put_back(tiny_dir):
    from qkv.translate import in_capitals, sentence_case

    assert in_capitals("A DOG RUNS IN THE PARK.") and not in_capitals("A dog runs in NYC.")
    assert not in_capitals("I") and not in_capitals("USA") and not in_capitals("42 !")
    assert sentence_case("A DOG RUNS. I SEE IT! “WHO?” he asks", "en") == \
        "A dog runs. I see it! “Who?” he asks"  # fmt: skip
    tr = load(tiny_dir)
    with pytest.warns(UserWarning, match="all in capitals"):
        out = tr("A DOG RUNS IN THE PARK")
    assert out == tr("A dog runs in the park").upper()


def test_far_from_the_training_data_warns_once_per_line_a_few_lines_at_most(tiny_dir):
    tr = load(tiny_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an ordinary caption: no warning
        tr("a dog runs in the park")
    long = " ".join(["a dog runs in the park"] * 9)  # 54 words in one sentence
    with pytest.warns(UserWarning, match="This sentence has 54 words"):
        tr(long)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr([long] * 9)
    said = [str(w.message) for w in caught if "source tokens" not in str(w.message)]
    assert said[0].startswith("line 1: This sentence has 54 words") and len(said) == 6
    assert said[-1] == "4 more such notes on 4 more line(s)"
