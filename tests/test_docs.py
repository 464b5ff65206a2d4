"""The guide cannot rot: the docs site builds with warnings as errors, and the README's
five-minute commands run as written."""

import os
import re
import shlex
import sys
from pathlib import Path

import pytest

import deadline

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
FIVE = README[README.index("## Five minutes") : README.index("## The library at a glance")]


def test_docs_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs")
    r = deadline.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        300, "mkdocs build", cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "reference" / "index.html").is_file()


def python_blocks() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", FIVE, re.S)
    return [b for b in blocks if "path/to" not in b]  # the HF example names the user's model


@pytest.mark.parametrize("block", python_blocks(), ids=lambda b: b.splitlines()[0][:40])
def test_readme_python_runs(block):
    os.environ["HF_HUB_OFFLINE"] = "1"
    exec(compile(block, "README.md", "exec"), {})


def qkv_commands() -> list[tuple[list[str], str | None]]:
    """``(argv, expected stdout or None)`` for each ``qkv`` line; ``# → text`` gives stdout."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", FIVE, re.S):
        for line in block.splitlines():
            cmd, _, comment = line.partition("  #")
            cmd, comment = cmd.strip(), comment.strip()
            if cmd.startswith("qkv ") and not cmd.startswith("qkv serve"):
                said = comment[1:].strip() if comment.startswith("→") else None
                out.append((shlex.split(cmd)[1:], said))
    return out


@pytest.mark.parametrize("argv, said", qkv_commands(), ids=lambda a: str(a)[:50])
def test_readme_commands_run(argv, said, tmp_path, monkeypatch, capsys):
    from qkv.apps.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(argv) == 0
    if said is not None:
        assert capsys.readouterr().out.strip() == said
