"""The parts of a ``POST /api/attention`` answer that every model kind shares.

:mod:`qkv.apps.serve.compute` (qkv's own models) and :mod:`qkv.apps.serve.compute_hf`
(transformers models) both build their answers from these: the text cut to the token limit,
the layer and head a request picks and the heads it switches off (checked against the
model's head counts), the maps' fields (``layers``, ``stats``, ``probe``) and the
step-by-step matrices. Neither module imports the other's helpers. The maps' JSON shapes
and rounding are the library's (:mod:`qkv.capture.page`), shared with the notebook page.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from torch import Tensor

from qkv.apps.serve.limits import (
    MAX_PIECES,
    STEP_DIMS,
    TOKEN_LIMIT,
    AttentionRequest,
    BadRequest,
)
from qkv.apps.serve.long import is_long, long_fields, packed_steps
from qkv.capture.maps import AttentionMaps
from qkv.capture.page import maps_json, number, rounded, stats_json
from qkv.capture.stats import pronoun_probe
from qkv.limits import CHARS_PER_TOKEN, split_to_fit

__all__ = [
    "STEPS",
    "ablation_heads",
    "ablation_spec",
    "choose_layer",
    "cut_to_limit",
    "maps_fields",
    "matrix",
    "pick_layer",
    "probe_json",
    "pieces_fields",
    "split_notice",
    "split_source",
    "step_matrices",
]


def cut_to_limit(
    encode: Callable[[str], tuple[list[str], tuple]], text: str, limit: int
) -> tuple[str, list[str], tuple, bool]:
    """The longest prefix of ``text`` (whole words, else characters) that ``encode``s to at
    most ``limit`` tokens: ``(text, tokens, inputs, cut)``. About log₂(words) encodes."""
    tokens, inputs = encode(text)
    if len(tokens) <= limit:
        return text, tokens, inputs, False
    units = re.findall(r"\S+\s*", text)
    if len(units) < 2:
        units = list(text)
    lo, hi = 1, len(units) - 1  # find the largest n with encode(units[:n]) within the limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(encode("".join(units[:mid]))[0]) <= limit:
            lo = mid
        else:
            hi = mid - 1
    if len(units) > 1 and re.match(r"\S+\s*$", units[0]) and len(encode(units[0])[0]) > limit:
        return cut_to_limit(encode, units[0][: max(1, len(units[0]) // 2)], limit)
    short = "".join(units[:lo]).rstrip()
    tokens, inputs = encode(short)
    return short, tokens, inputs, True


def split_source(
    encode: Callable[[str], tuple[list[str], tuple]], text: str, limit: int
) -> tuple[list[str], bool]:
    """A source text for translation as ``qkv translate`` takes a line: ``[text]`` when it
    ``encode``s to at most ``limit`` tokens, else its sentences, and word runs of a sentence
    too long alone, each within ``limit`` (:func:`qkv.limits.split_to_fit`, the function
    :meth:`qkv.translate.Translator.pieces` uses). Returns ``(pieces, cut)``: at most
    :data:`MAX_PIECES` pieces, ``cut`` when more text was left out.

    Only the first ``MAX_PIECES × limit × CHARS_PER_TOKEN`` characters are split (no piece is
    longer than ``limit × CHARS_PER_TOKEN`` characters), so the work is bounded by the limits,
    not by the text."""
    count = lambda s: len(encode(s)[0])  # noqa: E731
    if count(text) <= limit:
        return [text], False
    bound = MAX_PIECES * limit * CHARS_PER_TOKEN
    pieces = split_to_fit(text[:bound], limit, count)
    cut = len(pieces) > MAX_PIECES or bool(text[bound:].strip())
    return pieces[:MAX_PIECES] or [text], cut


def pieces_fields(pieces: list[str], outputs: list[str], shown: int) -> dict:
    """A translation's ``pieces`` (``[{"source", "text"}]``: each piece and its translation;
    ``[]`` when the text was not split) and ``piece`` (the one the maps show)."""
    if len(pieces) < 2:
        return {"pieces": [], "piece": 0}
    return {"pieces": [{"source": p, "text": o} for p, o in zip(pieces, outputs)],
            "piece": shown}  # fmt: skip


def split_notice(translation: dict, limit: int, cut: bool) -> str:
    """The answer's ``notice`` (English, for API clients; the page has it in every language)
    for a text translated in pieces."""
    n, shown = len(translation["pieces"]), translation["piece"] + 1
    out = (f"The text is longer than the {limit} source tokens the maps can show: it was "
           f"translated in {n} pieces (at sentence ends, then between words, as qkv translate "
           f"splits a long line) and the translations joined; the maps show piece {shown}.")  # fmt: skip
    return out + (f" The text after piece {n} was left out." if cut else "")


def pick_layer(names: list[str], req: AttentionRequest) -> str:
    """The request's layer for the step-by-step view, one of ``names`` (model order); by
    default the last cross-attention layer when translating, else the first layer."""
    if req.layer is None:
        cross = [n for n in names if "cross" in n]
        return cross[-1] if req.translate and cross else names[0]
    if req.layer not in names:
        raise BadRequest(f"layer must be one of {names}, got {req.layer!r}")
    return req.layer


def choose_layer(req: AttentionRequest, counts: dict[str, int]) -> str:
    """:func:`pick_layer` over ``counts`` (``{layer name: heads}``, model order), with the
    request's head checked against that layer's heads."""
    layer = pick_layer(list(counts), req)
    if not 0 <= req.head < counts[layer]:
        raise BadRequest(f"head must be in [0, {counts[layer] - 1}], got {req.head}")
    return layer


def ablation_spec(req: AttentionRequest, counts: dict[str, int]) -> dict[str, list[int]]:
    """The heads the request switches off, ``{layer: [heads]}``, checked against ``counts``."""
    spec: dict[str, list[int]] = {}
    for layer, head in req.ablate:
        if layer not in counts:
            raise BadRequest(f"ablate: no layer named {layer!r}; have {list(counts)}")
        if not 0 <= head < counts[layer]:
            raise BadRequest(f"ablate: head {head} out of range for {layer!r} "
                             f"({counts[layer]} heads)")  # fmt: skip
        spec.setdefault(layer, []).append(head)
    return spec


def ablation_heads(spec: dict[str, list[int]]) -> list[list]:
    """The ``ablation.heads`` field: ``[[layer, head], ...]``."""
    return [[k, h] for k, hs in spec.items() for h in hs]


def probe_json(maps: AttentionMaps, req: AttentionRequest) -> dict | None:
    """Top heads of the pronoun probe and a verdict that says so when no head decides."""
    if req.probe_token is None:
        return None
    try:
        rows = pronoun_probe(maps, req.probe_token, req.probe_candidates)
    except ValueError as err:
        return {"error": str(err), "rows": []}
    deciding = [r for r in rows if r.margin >= 0.1 and r.scores[r.best] >= 0.2]
    votes: dict[str, int] = {}
    for r in deciding:
        votes[r.best] = votes.get(r.best, 0) + 1
    return {
        "token": req.probe_token, "candidates": req.probe_candidates,
        "rows": [{"layer": r.layer, "head": r.head, "best": r.best, "margin": number(r.margin),
                  "scores": {c: number(v) for c, v in r.scores.items()}} for r in rows[:12]],
        "deciding": len(deciding), "votes": votes, "n_heads": len(rows),
    }  # fmt: skip


def maps_fields(maps: AttentionMaps, req: AttentionRequest) -> dict:
    """The answer's ``layers`` (the maps), ``stats`` (every head's scores) and ``probe``; maps
    too large for JSON: pooled, with the selected head ``exact`` and ``top`` (qkv.apps.serve.long)."""
    stats = {"stats": stats_json(maps), "probe": probe_json(maps, req)}
    if is_long(maps):
        return {**long_fields(maps, pick_layer(maps.layers, req), req.head), **stats}
    return {"layers": maps_json(maps), **stats}


def matrix(key: str, t: Tensor, rows: list[str], cols: list[str] | None = None) -> dict:
    """A 2-D tensor as ``{"key", "shape", "rows", "cols", "values"}``; at most STEP_DIMS
    columns of a feature matrix are sent (``shape`` keeps the full size)."""
    full = list(t.shape)
    if cols is None:  # feature dimensions
        t = t[:, :STEP_DIMS]
        cols = [str(i) for i in range(t.shape[1])]
    return {"key": key, "shape": full, "rows": rows, "cols": cols, "values": rounded(t)}


# the step-by-step view's matrices in order, with what labels their rows (and columns):
# "q"/"k" rows are the query/key tokens; a square one has key columns, the rest features
STEPS = (("x", "q", False), ("context", "k", False), ("q", "q", False), ("k", "k", False),
         ("v", "k", False), ("scores", "q", True), ("scaled", "q", True), ("mask", "q", True),
         ("masked", "q", True), ("weights", "q", True), ("output", "q", False),
         ("concat", "q", False), ("wo", "q", False))  # fmt: skip


def step_matrices(t: dict[str, Tensor | None], q_tokens: list[str],
                  k_tokens: list[str], scale: float | None = None) -> list[dict]:  # fmt: skip
    """The ``matrices`` of a step answer from 2-D tensors by key (see :data:`STEPS`); a key
    that is missing or None is left out (no cross context, no output projection). More than
    TOKEN_LIMIT queries: packed (:func:`qkv.apps.serve.long.packed_steps`; ``scale``: the
    call's, to send ``scaled`` as ``scores × scale``)."""
    if len(q_tokens) > TOKEN_LIMIT:
        return packed_steps(t, STEPS, q_tokens, k_tokens, scale)
    tokens = {"q": q_tokens, "k": k_tokens}
    return [matrix(key, t[key].double() if key == "mask" else t[key], tokens[rows],
                   k_tokens if square else None)
            for key, rows, square in STEPS if t.get(key) is not None]  # fmt: skip
