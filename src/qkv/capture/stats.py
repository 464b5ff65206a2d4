"""What each head does, in numbers: entropy, distance, previous/next/first-token scores, probes.

Every score is an average over the query rows that see at least one key (fully masked rows,
all zeros, are left out). For a row ``i`` of weights ``w`` over keys ``j``, with ``p = q_offset
+ i`` the query's position among the keys (self/causal attention):

=============  ==========================================================
entropy        ``-Σ_j w_j log w_j`` (nats; 0 = one key, ``log Tk`` = uniform)
distance       ``Σ_j w_j |p - j|`` (NaN for cross-attention)
prev / next    ``w_{p-1}`` / ``w_{p+1}`` (rows where that key exists)
self           ``w_p``
first (sink)   ``w_0``
punct          ``Σ_j w_j`` over punctuation and special tokens (``[CLS]``, ``</s>``…)
=============  ==========================================================

>>> w = torch.eye(4).roll(-1, dims=1).tril()  # each token attends to the previous one
>>> round(head_scores(w, ["a", "b", "c", "d"])["prev"], 3)
1.0
"""

from __future__ import annotations

import functools
import math
import unicodedata
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from qkv.capture.maps import AttentionMaps

__all__ = [
    "HeadStats",
    "ProbeRow",
    "head_scores",
    "head_stats",
    "is_special",
    "normalize_token",
    "pronoun_probe",
]

SPECIAL_TOKENS = {"[CLS]", "[SEP]", "[PAD]", "[MASK]", "<s>", "</s>", "<pad>", "<bos>", "<eos>",
                  "<unk>", "[UNK]", "<|endoftext|>"}  # fmt: skip
SCORES = ("entropy", "distance", "prev", "next", "self", "first", "punct")


def normalize_token(token: str) -> str:
    """Lower-case, without WordPiece ``##`` or SentencePiece/BPE word markers (``▁``, ``Ġ``)."""
    return token.removeprefix("##").lstrip("▁Ġ").lower()


@functools.lru_cache(maxsize=8192)  # asked once per key of every head: a 2,048-token map
def is_special(token: str) -> bool:
    """A special token, or punctuation only (every character a Unicode ``P*`` category)."""
    t = token.strip()
    return t in SPECIAL_TOKENS or (
        bool(t) and all(unicodedata.category(c).startswith("P") for c in t)
    )


def _mean(values: Tensor, rows: Tensor) -> float:
    return float(values[rows].mean()) if bool(rows.any()) else math.nan


def head_scores(
    weights: Tensor, k_tokens: Sequence[str] | None = None, *, q_offset: int = 0,
    cross: bool = False,
) -> dict[str, float]:  # fmt: skip
    """The scores of one head's map ``weights (Tq, Tk)`` (see the module docstring)."""
    if weights.dim() != 2:
        raise ValueError(f"weights must be (Tq, Tk), got shape {tuple(weights.shape)}")
    w = weights.double()
    Tq, Tk = w.shape
    total = w.sum(-1)  # (Tq,)
    live = total > 0  # (Tq,) rows that see something
    ent = -torch.special.xlogy(w, w).sum(-1)  # (Tq,)
    p = torch.arange(Tq, dtype=torch.long) + q_offset  # query positions among the keys
    j = torch.arange(Tk, dtype=torch.double)
    # Σ_j w_j |p - j| = Σ_j w_j (j - p) + 2 Σ_{j<p} w_j (p - j): two matrix-vector products
    # and one triangle, not a (Tq, Tk) table of distances (a 2,048-token map: 4× faster)
    pd = p.double()
    below = w.tril(q_offset - 1)  # (Tq, Tk) keys j < p
    dist = w @ j - pd * total + 2 * (pd * below.sum(-1) - below @ j)  # (Tq,)

    def at(pos: Tensor) -> tuple[Tensor, Tensor]:  # weight on key pos, and rows where it exists
        ok = (pos >= 0) & (pos < Tk) & live
        return w[torch.arange(Tq), pos.clamp(0, Tk - 1)], ok

    prev, prev_ok = at(p - 1)
    nxt, next_ok = at(p + 1)
    slf, self_ok = at(p)
    special = torch.tensor([is_special(t) for t in (k_tokens or [""] * Tk)], dtype=torch.bool)
    if special.numel() != Tk:
        raise ValueError(f"k_tokens must have Tk={Tk} entries, got {special.numel()}")
    nan = math.nan
    return {
        "entropy": _mean(ent, live),
        "distance": nan if cross else _mean(dist, live),
        "prev": nan if cross else _mean(prev, prev_ok),
        "next": nan if cross else _mean(nxt, next_ok),
        "self": nan if cross else _mean(slf, self_ok),
        "first": _mean(w[:, 0], live),
        "punct": _mean(w @ special.double(), live),  # (a product, not a copy of the columns)
    }


@dataclass
class HeadStats:
    """Scores of one (layer, head); see the module docstring."""

    layer: str
    head: int
    kind: str
    entropy: float
    distance: float
    prev: float
    next: float
    self: float
    first: float
    punct: float

    def to_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v)
                for k, v in asdict(self).items()}  # fmt: skip


def head_stats(maps: AttentionMaps) -> list[HeadStats]:
    """:class:`HeadStats` for every captured (layer, head), layer by layer."""
    out = []
    for i, w in enumerate(maps.weights):
        for hi, h in enumerate(maps.heads[i]):
            s = head_scores(w[hi], maps.k_tokens[i], q_offset=maps.q_offsets[i],
                            cross=maps.kinds[i] == "cross")  # fmt: skip
            out.append(HeadStats(maps.layers[i], h, maps.kinds[i], **s))
    return out


@dataclass
class ProbeRow:
    """How much one head's query ``token`` attends to each candidate (summed over its pieces)."""

    layer: str
    head: int
    scores: dict[str, float]
    best: str
    margin: float  # best score minus the runner-up's


def _positions(tokens: Sequence[str], word: str | int) -> list[int]:
    if isinstance(word, int):
        return [word]
    want = normalize_token(word)
    return [i for i, t in enumerate(tokens) if normalize_token(t) == want]


def pronoun_probe(
    maps: AttentionMaps,
    token: str | int,
    candidates: Sequence[str | int],
    *,
    occurrence: int = 0,
) -> list[ProbeRow]:
    """Which heads send ``token`` (e.g. ``"it"``) to which candidate (``"animal"``, ``"street"``).

    For every captured (layer, head) whose keys contain the candidates, the weight from the
    ``occurrence``-th query position of ``token`` to each candidate (summed over every
    position where the candidate occurs). Ranked by the best candidate's weight, highest first.

    >>> rows = pronoun_probe(maps, "it", ["animal", "street"])  # doctest: +SKIP
    >>> rows[0].layer, rows[0].head, rows[0].best  # doctest: +SKIP
    """
    if len(candidates) < 1:
        raise ValueError("candidates must name at least one token")
    rows = []
    for i, w in enumerate(maps.weights):
        q_pos = _positions(maps.q_tokens[i], token)
        k_pos = {str(c): _positions(maps.k_tokens[i], c) for c in candidates}
        if len(q_pos) <= occurrence or not all(k_pos.values()):
            continue
        q = q_pos[occurrence]
        for hi, h in enumerate(maps.heads[i]):
            scores = {c: float(w[hi, q, pos].sum()) for c, pos in k_pos.items()}
            ranked = sorted(scores.items(), key=lambda kv: -kv[1])
            margin = ranked[0][1] - (ranked[1][1] if len(ranked) > 1 else 0.0)
            rows.append(ProbeRow(maps.layers[i], h, scores, ranked[0][0], margin))
    if not rows:
        raise ValueError(
            f"no captured layer has query {token!r} and keys {list(candidates)}; "
            f"tokens were {maps.q_tokens[0] if len(maps) else []}"
        )
    return sorted(rows, key=lambda r: -r.scores[r.best])
