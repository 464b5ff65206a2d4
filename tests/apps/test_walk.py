import pytest
import torch

from qkv.apps.cli import main
from qkv.apps.walk import walk_steps, word_vectors


def test_walk_has_every_step_and_matches_module():
    w = walk_steps("The boy trains the puppy .", causal=True)
    titles = "\n".join(s.title for s in w.steps)
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
        assert step in titles
    assert w.same  # the pieces put together by hand equal MultiHeadAttention.forward
    assert w.tensors["weights"].shape == (1, 2, 6, 6)


def test_cli_explain_runs(capsys):
    assert main(["explain", "--text", "a b", "--d-model", "4", "--heads", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 tokens" in out and "softmax" in out


def test_python_m_qkv():
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "qkv", "explain", "--causal"],
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


def _embedding(walk_, word):
    first = walk_.steps[0]  # token embeddings × √d_model, one row per token
    return first.tensor[first.rows.index(word)]


def test_one_embedding_per_word_across_sentences():
    en, fr = walk_steps("The boy sleeps ."), walk_steps("Le garçon dort .")
    assert not torch.equal(_embedding(en, "The"), _embedding(fr, "Le"))  # same position 0
    torch.testing.assert_close(_embedding(en, "."), _embedding(fr, "."), rtol=0, atol=0)
    other = walk_steps("A boy runs", d_model=8)
    torch.testing.assert_close(_embedding(en, "boy"), _embedding(other, "boy"), rtol=0, atol=0)
    # cross-attention: the source's "boy" (before positions) is the target's "boy"
    cross = walk_steps("boy", source="The boy", d_model=8)
    torch.testing.assert_close(_embedding(cross, "boy"), _embedding(en, "boy"), rtol=0, atol=0)
    assert cross.same
    # the embedding is TokenEmbedding's: the word's vector × √d_model
    want = word_vectors(["boy"], 8)[0] * 8**0.5
    torch.testing.assert_close(_embedding(en, "boy"), want)
    assert not torch.equal(word_vectors(["boy"], 8, seed=1), word_vectors(["boy"], 8, seed=0))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("source", [None, "The boy"])
def test_steps_are_numbered_without_gaps(causal, source):
    w = walk_steps("Le garçon dort", causal=causal, source=source)
    numbered = [s.title for s in w.steps if not s.title.startswith(" ")]
    assert [t.split(".", 1)[0] for t in numbered] == [str(i) for i in range(1, len(numbered) + 1)]
    assert any("mask" in t for t in numbered) == causal
    assert all("((" not in f"({s.note})" for s in w.steps)
    assert sum(s.name == "softmax" for s in w.steps) == 1


def test_unspaced_scripts_walk_token_by_token():
    w = walk_steps("男孩训练小狗。")
    assert w.words == ["男", "孩", "训", "练", "小", "狗", "。"] and w.same
    assert w.tensors["weights"].shape == (1, 2, 7, 7)
    w = walk_steps("ကောင်လေးက ခွေးကလေးကို လေ့ကျင့်ပေးတယ်။")
    assert w.words[:3] == ["ကောင်", "လေး", "က"] and w.same
