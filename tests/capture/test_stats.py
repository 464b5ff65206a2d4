"""Head statistics on hand-built maps whose answers are known."""

import math

import pytest
import torch

from qkv.inspect import AttentionMaps, head_scores, head_stats, pronoun_probe

TOKS = ["[CLS]", "the", "cat", "sat", ",", "it", "slept", "[SEP]"]
T = len(TOKS)


def prev_head():
    w = torch.zeros(T, T)
    w[0, 0] = 1.0
    w[torch.arange(1, T), torch.arange(0, T - 1)] = 1.0
    return w


def test_pure_previous_token_head():
    s = head_scores(prev_head(), TOKS)
    assert s["prev"] == pytest.approx(1.0) and s["next"] == pytest.approx(0.0)
    assert s["entropy"] == pytest.approx(0.0, abs=1e-9)
    assert s["distance"] == pytest.approx((T - 1) / T)  # row 0 has distance 0
    assert s["first"] == pytest.approx(2 / T)  # rows 0 and 1 look at [CLS]


def test_next_and_self_heads():
    nxt = torch.zeros(T, T)
    nxt[torch.arange(T - 1), torch.arange(1, T)] = 1.0
    nxt[T - 1, T - 1] = 1.0
    assert head_scores(nxt, TOKS)["next"] == pytest.approx(1.0)
    assert head_scores(torch.eye(T), TOKS)["self"] == pytest.approx(1.0)


def test_uniform_head_has_maximal_entropy():
    s = head_scores(torch.full((T, T), 1 / T), TOKS)
    assert s["entropy"] == pytest.approx(math.log(T))
    assert s["prev"] == pytest.approx(1 / T)
    # mean |i - j| over a uniform T×T grid = (T² - 1) / (3T)
    assert s["distance"] == pytest.approx((T * T - 1) / (3 * T))
    assert s["punct"] == pytest.approx(3 / T)  # [CLS], ",", [SEP]


def test_causal_uniform_head_skips_masked_rows():
    w = torch.tril(torch.ones(T, T))
    w = w / w.sum(-1, keepdim=True)
    w[2] = 0.0  # a fully masked row: zeros, left out of every average
    s = head_scores(w, TOKS)
    want = sum(math.log(i + 1) for i in range(T) if i != 2) / (T - 1)
    assert s["entropy"] == pytest.approx(want)


def test_sink_and_punctuation_heads():
    sink = torch.zeros(T, T)
    sink[:, 0] = 1.0
    s = head_scores(sink, TOKS)
    assert s["first"] == pytest.approx(1.0) and s["punct"] == pytest.approx(1.0)
    comma = torch.zeros(T, T)
    comma[:, 4] = 1.0
    s = head_scores(comma, TOKS)
    assert s["first"] == 0.0 and s["punct"] == pytest.approx(1.0)


def test_cross_attention_has_no_positional_scores():
    s = head_scores(torch.full((3, 5), 0.2), ["a", "b", "c", "d", "e"], cross=True)
    assert math.isnan(s["distance"]) and math.isnan(s["prev"])
    assert s["entropy"] == pytest.approx(math.log(5))


def _maps():
    it = TOKS.index("it")
    a = prev_head()
    b = torch.eye(T)
    b[it] = 0.0
    b[it, TOKS.index("cat")] = 0.9
    b[it, TOKS.index("the")] = 0.1
    w = torch.stack([a, b])  # (H=2, T, T)
    return AttentionMaps([w], ["enc.0"], ["self"], [[0, 1]], [TOKS], [TOKS], [0])


def test_head_stats_table_and_pronoun_probe():
    maps = _maps()
    stats = head_stats(maps)
    assert [(s.layer, s.head) for s in stats] == [("enc.0", 0), ("enc.0", 1)]
    assert stats[0].prev == pytest.approx(1.0)
    assert stats[0].to_dict()["kind"] == "self"
    rows = pronoun_probe(maps, "it", ["cat", "sat"])
    assert (rows[0].head, rows[0].best) == (1, "cat")
    assert rows[0].scores == {"cat": pytest.approx(0.9), "sat": 0.0}
    assert rows[0].margin == pytest.approx(0.9)
    assert rows[1].head == 0 and rows[1].scores["sat"] == pytest.approx(0.0)
    assert rows[1].scores["cat"] == 0.0  # head 0 sends "it" to "," (previous token)
    with pytest.raises(ValueError, match="no captured layer"):
        pronoun_probe(maps, "dog", ["cat"])


def test_tokens_are_normalised_for_the_probe():
    toks = ["▁The", "▁Cat", "##s", "▁it"]
    w = torch.zeros(1, 4, 4)
    w[0, 3, 1] = 1.0
    maps = AttentionMaps([w], ["l"], ["self"], [[0]], [toks], [toks])
    assert pronoun_probe(maps, "it", ["cat"])[0].scores["cat"] == pytest.approx(1.0)
