"""Every subcommand × invalid values: exit 2, one line on stderr, no traceback, nothing written.

Runs ``qkv.apps.cli.main`` in-process (fast); a few real subprocesses check the exit code, stderr
and stdin handling end to end.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import deadline
from qkv.apps.cli import build_parser, main
from qkv.apps.cli_args import clean_text, max_threads, text
from qkv.data import Tokenizer
from qkv.models import Seq2SeqTransformer, TransformerConfig, save_pretrained

SRC = str(Path(__file__).resolve().parents[2] / "src")

# (argv, words the error line must contain); run in an empty directory holding only
# "adir.html/" (a directory), "adir.md/" and "afile"
BAD = [
    (["explain", "--d-model", "0"], "--d-model"),
    (["explain", "--d-model", "x"], "integer"),
    (["explain", "--heads", "0"], "--heads"),
    (["explain", "--heads", "nan"], "integer"),
    (["explain", "--seed", "-1"], "--seed"),
    (["explain", "--d-model", "6", "--heads", "4"], "divisible"),
    (["explain", "--out", "x.txt"], ".md"),
    (["explain", "--out", "missing/x.md"], "does not exist"),
    (["explain", "--out", "adir.md"], "directory"),
    (["explain", "--d-model", "-4"], "--d-model"),
    (["explain", "--heads", "1e9"], "integer"),
    (["explain", "--cross"], "--source"),
    (["tour", "--top", "0"], "--top"),
    (["tour", "--out-dir", "afile"], "not a directory"),
    (["train", "--label-smoothing", "2"], "--label-smoothing"),
    (["train", "--label-smoothing", "nan"], "finite"),
    (["train", "--dropout", "1"], "--dropout"),
    (["train", "--lr", "nan"], "--lr"),
    (["train", "--lr", "0"], "--lr"),
    (["train", "--train-limit", "0"], "--train-limit"),
    (["train", "--val-limit", "-1"], "--val-limit"),
    (["train", "--threads", "0"], "--threads"),
    (["train", "--threads", str(10 * max_threads())], "--threads"),
    (["train", "--max-tokens", "-5"], "--max-tokens"),
    (["train", "--vocab-size", "10"], "--vocab-size"),
    (["train", "--epochs", "0"], "--epochs"),
    (["train", "--max-minutes", "inf"], "--max-minutes"),
    (["train", "--checkpoint-minutes", "-1"], "--checkpoint-minutes"),
    (["train", "--out", "afile"], "not a directory"),
    (["train", "--bogus"], "unrecognized"),
    (["train", "--out", "r", "--src", "fr", "--tgt", "en", "--augment", "present"], "English"),
    (["train", "--augment", "past"], "--augment"),
    (["translate", "--model", "m", "--beam", "0"], "--beam"),
    (["translate", "--model", "m", "--lenpen", "nan"], "--lenpen"),
    (["translate", "--model", "m", "--lenpen", "inf"], "--lenpen"),
    (["translate", "--model", "m", "--threads", "-1"], "--threads"),
    (["translate", "--model", "no-such-dir", "a"], "no-such-dir"),
    (["evaluate", "--model", "m", "--limit", "0"], "--limit"),
    (["evaluate", "--model", "m", "--limit", "-1"], "--limit"),
    (["evaluate", "--model", "m", "--output", "adir.md"], "directory"),
    (["evaluate", "--model", "m", "--output", "missing/h.txt"], "does not exist"),
    (["embed", "--show", "-1", "a"], "--show"),
    (["embed", ""], "empty"),
    (["embed", *["a"] * 65], "at most 64"),
    (["explain", "--text", ""], "at least one word"),
    (["explain", "--text", "  "], "at least one word"),
    (["embed", "a", "  "], "sentence 2 is empty"),
    (["view", "a", "--out", "adir.html"], "directory"),
    (["view", "a", "--out", "x.txt"], ".html"),
    (["view", "a", "--png", "x.jpg"], ".png"),
    (["view", "a", "--beam", "0"], "--beam"),
    (["view", "--translate", "a b", "--beam", "2"], "greedily"),
    (["view", ""], "empty"),
    (["view"], "sentence"),
    (["view", "a", "--model", "no-such-model"], "no-such-model"),
    (["heads", "a", "--top", "-1"], "--top"),
    (["heads", "a", "--n", "0"], "--n"),
    (["heads", "a", "--beam", "0"], "--beam"),
    (["heads"], "sentence"),
    (["heads", " "], "sentence"),
    (["nosuch"], "invalid choice"),
    ([], "COMMAND"),
]
if not torch.cuda.is_available():
    BAD.append((["train", "--device", "cuda"], "CUDA is not available"))


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "adir.html").mkdir()
    (tmp_path / "adir.md").mkdir()
    (tmp_path / "afile").write_text("x")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


@pytest.mark.parametrize("argv,needle", BAD, ids=[" ".join(a) or "(none)" for a, _ in BAD])
def test_bad_value_is_one_line_exit_2_nothing_written(argv, needle, workdir, capsys):
    before = _listing(workdir)
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1, err
    prog = "qkv" if not argv or argv[0] == "nosuch" else f"qkv {argv[0]}"
    assert err.startswith(f"{prog}: error: "), err
    assert needle in err and "Traceback" not in err
    assert _listing(workdir) == before


def test_every_help_shows_every_default(capsys):
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, p in sub.choices.items():
        text = " ".join(p.format_help().split())
        for a in p._actions:
            if not a.option_strings or a.help == argparse.SUPPRESS:
                continue
            if a.default in (None, False, argparse.SUPPRESS):
                continue
            assert f"default: {a.default}" in text, f"qkv {name} {a.option_strings[0]}"
        assert main([name, "--help"]) == 0
    assert "(default: 0.1)" in capsys.readouterr().out  # train --label-smoothing, --dropout


def test_unexpected_error_is_one_line_exit_1(monkeypatch, capsys):
    import qkv.apps.explain

    def boom(*a, **k):
        raise RuntimeError("kaput\nsecond line")

    monkeypatch.setattr(qkv.apps.explain, "walk_steps", boom)
    monkeypatch.delenv("QKV_DEBUG", raising=False)
    assert main(["explain"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("qkv explain: internal error: RuntimeError: kaput")
    assert "QKV_DEBUG=1" in err
    monkeypatch.setenv("QKV_DEBUG", "1")
    with pytest.raises(RuntimeError, match="kaput"):
        main(["explain"])


def test_text_with_invalid_unicode_is_replaced_and_said(workdir, capsys):
    assert clean_text("ok") == "ok"
    assert clean_text("a\udcff b") == "a\ufffd b"  # undecodable byte from argv
    assert clean_text("a\ud800 b") == "a\ufffd b"  # lone surrogate
    capsys.readouterr()
    assert main(["view", "the \udcff boy \ud800 runs", "--out", "x.html"]) == 0
    assert main(["explain", "--text", "a \ud800 b", "--out", "w.md"]) == 0
    err = capsys.readouterr().err
    assert err.count("replaced by U+FFFD") == 2 and "Traceback" not in err
    assert "\ufffd" in (workdir / "w.md").read_text(encoding="utf-8")
    assert (workdir / "x.html").stat().st_size > 1000


def test_long_input_is_cut_with_a_notice(workdir, capsys):
    words = " ".join(["the cat sat on the mat ."] * 3000)  # 21,000 words
    assert main(["view", words, "--out", "big.html"]) == 0
    assert main(["explain", "--text", words, "--out", "big.md"]) == 0
    err = capsys.readouterr().err
    assert "qkv view: note:" in err and "128" in err and "cut to its first 32 tokens" in err
    assert (workdir / "big.html").stat().st_size < 5_000_000
    assert (workdir / "big.md").stat().st_size < 200_000
    assert sorted(os.listdir(workdir)) == ["adir.html", "adir.md", "afile", "big.html", "big.md"]


def test_title_with_data_marker(workdir):
    assert main(["view", "a __DATA__ b __TITLE__ c", "--out", "t.html"]) == 0
    page = (workdir / "t.html").read_text(encoding="utf-8")
    title = page[page.index("<title>") : page.index("</title>")]
    assert "__DATA__ b __TITLE__" in title and len(title) < 200
    assert page.count('"views"') == 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    sentences = ["a dog runs", "the cat sleeps", "un chien court", "le chat dort"]
    tok = Tokenizer.train(sentences, vocab_size=300, min_frequency=1)
    cfg = TransformerConfig(src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size,
                            d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1,
                            n_decoder_layers=1, max_len=32)  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("m") / "model"
    save_pretrained(Seq2SeqTransformer(cfg), path, tokenizer=tok)
    return path


def _qkv(args, tmp_path, **kw):
    env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1"}
    env.pop("QKV_DEBUG", None)
    return deadline.run([sys.executable, "-m", "qkv", *args], 300, f"qkv {args[0]}",
                        cwd=tmp_path, env=env, capture_output=True, **kw)  # fmt: skip


def test_subprocess_invalid_utf8_stdin_and_errors(model_dir, tmp_path):
    r = _qkv(["translate", "--model", str(model_dir)], tmp_path,
             input=b"a dog \xff\xfe runs\n\xc3the cat\n")  # fmt: skip
    assert r.returncode == 0, r.stderr.decode()
    assert len(r.stdout.decode().splitlines()) == 2
    said = r.stderr.decode().splitlines()  # then maybe a note on the pieces U+FFFD falls into
    assert said[0] == "qkv: note: invalid UTF-8 on stdin replaced by U+FFFD"
    assert all(x.startswith("qkv translate: note: line ") for x in said[1:])
    r = _qkv(["train", "--label-smoothing", "2"], tmp_path)
    assert (r.returncode, r.stdout) == (2, b"")
    assert r.stderr.decode().count("\n") == 1 and b"qkv train: error:" in r.stderr
    assert os.listdir(tmp_path) == []


def _typed_options():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [(f"{name} {a.option_strings[0] if a.option_strings else a.dest}", a.type)
            for name, p in sub.choices.items() for a in p._actions
            if a.type is not None and a.type is not str]  # fmt: skip


TYPED = _typed_options()
NASTY = ["nan", "-nan", "inf", "-inf", "1e309", "-0", "0x10", " 3 ", "", "1_000", "1.5", "٣",
         "9" * 400, "-1", "0", "\udcff", "\x00", "../x", "/", "a.html/", "x.png\n", "y" * 300 + ".html"]  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(TYPED), value=st.sampled_from(NASTY) | st.text(max_size=12))
def test_option_types_accept_or_refuse_cleanly(case, value):
    """Any string through any option's type: a value, or an ArgumentTypeError (a clean
    'argument --x: ...' line); never another exception, never NaN/inf, never a surrogate."""
    _, parse = case
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as d:
        os.chdir(d)
        try:
            out = parse(value)
        except argparse.ArgumentTypeError as e:
            assert str(e) and "\n" not in str(e)
            return
        finally:
            os.chdir(cwd)
    if isinstance(out, float):
        assert math.isfinite(out)
    if parse is text:
        out.encode("utf-8")  # no surrogate left (paths keep theirs: they name real bytes)
