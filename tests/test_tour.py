"""``qkv tour`` (``make demo``): explain, the MiniLM pronoun probe, attention.html + .png."""

from __future__ import annotations

import io
import json
import os
import re

import pytest
from rich.console import Console

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing downloads

pytest.importorskip("transformers")

from qkv.cli import main  # noqa: E402
from qkv.tour import PRONOUN, tour  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_tour_with_minilm_writes_the_page_and_picture(tmp_path):
    buf = io.StringIO()
    paths = tour(tmp_path / "out", console=Console(file=buf, width=200, color_system=None))
    text = buf.getvalue()
    # 1. explain, with the walk checked against the module's own forward pass
    assert "1/3  qkv explain" in text and "7. softmax → attention weights" in text
    assert "Step by step equals MultiHeadAttention.forward: True" in text
    # 2. the probe over all 72 heads of MiniLM, and the "too wide" comparison
    assert "where does 'it' look? (top 5 of 72 heads)" in text
    votes = re.search(r"heads preferring each candidate: animal: (\d+), street: (\d+)", text)
    assert votes and int(votes[1]) + int(votes[2]) == 72
    assert "[CLS] the animal didn ' t cross the street because it was tired . [SEP]" in text
    assert len(re.findall(r"encoder\.layers\.\d\.attn head +\d+: animal \d\.\d{3} → ", text)) == 5
    # 3. the files, and a last line saying where they are
    assert paths["html"] == (tmp_path / "out" / "attention.html").resolve()
    assert paths["png"].read_bytes()[:8] == PNG_MAGIC
    page = paths["html"].read_text(encoding="utf-8")
    assert "encoder.layers.5.attn" in page and json.dumps(PRONOUN)[1:-1] in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)  # self-contained
    last = text.strip().splitlines()[-1]
    assert str(paths["html"]) in text and str(paths["png"]) in last


def test_cli_tour_runs(tmp_path, capsys):
    assert main(["tour", "--out-dir", str(tmp_path), "--model", "random", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "3/3" in out and "Done." in out and "top 3 of" in out
    assert (tmp_path / "attention.html").is_file() and (tmp_path / "attention.png").is_file()
