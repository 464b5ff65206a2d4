from qkv.cli import main
from qkv.demo import walk


def test_demo_walks_every_step_and_matches_module(capsys):
    lines = []
    t = walk("The boy trains the puppy .", causal=True, out=lines.append)
    text = "\n".join(lines)
    for step in (
        "token embeddings",
        "positional",
        "Q = x W_Q",
        "scores",
        "scaled",
        "mask",
        "softmax",
        "concatenated",
        "W_O",
    ):
        assert step in text
    assert "Step by step equals MultiHeadAttention.forward: True" in text
    assert t["weights"].shape == (1, 2, 6, 6)


def test_cli_demo_runs(capsys):
    assert main(["demo", "--text", "a b", "--d-model", "4", "--heads", "2"]) == 0
    assert "2×2 = 4 scores" in capsys.readouterr().out


def test_python_m_qkv():
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "qkv", "demo", "--causal"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "causal mask (True = may attend)" in r.stdout


def test_cli_bad_input_is_one_clear_line(capsys):
    assert main(["translate", "--model", "/nonexistent-model-dir", "hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv translate: error:") and "/nonexistent-model-dir" in err
    assert "Traceback" not in err
