"""``qkv tour`` (``make demo``): one head step by step, the shipped translator on the notes'
sentence, the MiniLM pronoun probe with its conclusion, the pages and pictures."""

from __future__ import annotations

import io
import json
import os
import re

import pytest
from rich.console import Console

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing downloads

pytest.importorskip("transformers")

from qkv.apps.cli import main  # noqa: E402
from qkv.apps.tour import PRONOUN, tour  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_tour_with_minilm_writes_the_page_and_picture(tmp_path):
    buf = io.StringIO()
    paths = tour(tmp_path / "out", console=Console(file=buf, width=200, color_system=None))
    text = buf.getvalue()
    # 1. one head, with the walk checked against the module's own forward pass
    assert "1/4  Attention, step by step" in text and "softmax(Q Kᵀ / √d_k), head 0" in text
    assert "MultiHeadAttention.forward: True" in text
    # 2. the shipped en-fr model on the notes' sentence, its alignment and pictures
    assert "2/4  A real translator (en-fr)" in text
    from qkv.translate import load

    assert f"→ greedy: {load('en-fr')('The boy trains the puppy.', beam=1)}" in text
    assert re.search(r"each French token looks most at .*garçon→boy", text)
    for key in ("translation", "alignment", "encoder"):
        assert paths[key].is_file() and paths[key].stat().st_size > 1000
    assert "decoder.layers.2.cross_attn" in paths["translation"].read_text(encoding="utf-8")
    # 2. the probe over all 72 heads of MiniLM, and the "too wide" comparison
    assert "where does 'it' look? (top 5 of 72 heads)" in text
    votes = re.search(r"heads preferring each candidate: animal: (\d+), street: (\d+)", text)
    assert votes and int(votes[1]) + int(votes[2]) == 72
    assert "[CLS] the animal didn ' t cross the street because it was tired . [SEP]" in text
    assert len(re.findall(r"encoder\.layers\.\d\.self_attn head +\d+: animal \d\.\d{3} → ", text)) == 5
    assert "What this shows:" in text  # the probe's conclusion, computed from its numbers
    # 3. the files, and a last line saying where they are
    assert paths["html"] == (tmp_path / "out" / "attention.html").resolve()
    assert paths["png"].read_bytes()[:8] == PNG_MAGIC
    page = paths["html"].read_text(encoding="utf-8")
    assert "encoder.layers.5.self_attn" in page and json.dumps(PRONOUN)[1:-1] in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)  # self-contained
    last = text.strip().splitlines()[-1]
    assert str(paths["html"]) in text and str(paths["png"]) in last


def test_cli_tour_runs(tmp_path, capsys):
    args = ["tour", "--out-dir", str(tmp_path), "--model", "random", "--top", "3",
            "--translator", "none"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "4/4" in out and "Done." in out and "top 3 of" in out and "random weights" in out
    assert (tmp_path / "attention.html").is_file() and (tmp_path / "attention.png").is_file()
