"""Long inputs: more tokens than every map of every head holds as JSON (up to 2,048).

An answer holds all layers × heads × Tq × Tk weights as JSON with 3 decimals while that is at
most :data:`~qkv.limits.MAX_CELLS` (T ≤ :func:`~qkv.limits.encoder_limit`). A longer input,
up to :func:`map_limit` tokens (2,048, or one short of the model's own positions: MiniLM
511), is answered *long*, so that the response stays bounded (MAX_LONG_BYTES) and the page
stays fast:

- ``layers[i].weights``: each head **max-pooled** to at most P × P cells (P = encoder_limit,
  so all maps still hold ≤ MAX_CELLS numbers), cell (a, b) the largest weight of the k × k
  block of rows a·k…, columns b·k…; ``layers[i].pooled = {"k", "rows", "cols", "how": "max"}``
  (rows, cols: the full Tq, Tk). The model view's thumbnails.
- ``exact``: ``{"layer", "head", "shape", **packed}``: every weight of the selected layer and
  head (the step-by-step call's), packed (below).
- ``top``: ``{"layer", "k", "index": [h][Tq][k], "weights": [h][Tq][k]}``: each query's
  :data:`TOP_K` largest weights for every head of the selected layer: the head view's lines.
- step-by-step matrices of more than :data:`~qkv.limits.TOKEN_LIMIT` rows: packed.

Packed matrices (``shape`` [R, C], row-major) replace ``values``:

==========================================  ==================================================
``{"enc": "u16", "lo", "step", "data"}``    base64 of little-endian uint16 q: ``lo + q·step``,
                                            q = 65535 is −∞ (``null``); error ≤ step / 2
                                            (weights: ≤ 7.7e-6, below the 3 decimals shown)
``{"enc": "bits", "data"}``                 a 0/1 matrix (the mask), a bit per cell, LSB first
``{"enc": "scaled", "of": "scores", "by"}`` ``scores × by`` (sent when exactly that)
``{"enc": "masked", "of": "scaled"}``       ``scaled`` where the mask is 1, −∞ elsewhere (idem)
``{"enc": "ref", "of": "exact"}``           the answer's ``exact`` map (the same call's weights)
==========================================  ==================================================

>>> p = pack(torch.tensor([[0.0, 0.5], [1.0, float("-inf")]]))
>>> p["enc"], p["lo"], round(p["step"] * 65534, 6)
('u16', 0.0, 1.0)
>>> unpack(p, (2, 2)).tolist()
[[0.0, 0.5], [1.0, -inf]]
"""

from __future__ import annotations

import base64
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.apps.serve.limits import STEP_DIMS
from qkv.capture.maps import AttentionMaps
from qkv.capture.page import rounded
from qkv.limits import DECIMALS, LONG_TOKEN_LIMIT, MAX_CELLS, encoder_limit

__all__ = [
    "TOP_K",
    "is_long",
    "long_fields",
    "map_limit",
    "pack",
    "packed_steps",
    "position_limit",
    "unpack",
]

TOP_K = 8  # lines per query and head in the head view of a long answer
_NULL = 65535  # the uint16 code of −∞ / non-finite


def pack(t: Tensor, *, bits: bool = False) -> dict:
    """A 2-D tensor as ``{"enc": "u16", ...}``, or ``"bits"`` for a 0/1 matrix (see the
    module docstring)."""
    a = t.detach().double().numpy()
    if bits:
        packed = np.packbits(a.astype(bool).ravel(), bitorder="little")
        return {"enc": "bits", "data": base64.b64encode(packed.tobytes()).decode("ascii")}
    finite = np.isfinite(a)
    whole = bool(finite.all())
    vals = a if whole else a[finite]
    lo, hi = (float(vals.min()), float(vals.max())) if vals.size else (0.0, 0.0)
    step = (hi - lo) / (_NULL - 1) if hi > lo else 1.0
    q = np.rint(((a if whole else np.where(finite, a, lo)) - lo) / step).clip(0, _NULL - 1)
    q = q.astype("<u2")
    if not whole:
        q[~finite] = _NULL
    return {"enc": "u16", "lo": lo, "step": step, "data": base64.b64encode(q.tobytes()).decode("ascii")}


def unpack(p: dict, shape: tuple[int, int]) -> Tensor:
    """The float64 matrix of a ``"u16"`` or ``"bits"`` packing (the page's decoding, for tests)."""
    raw = base64.b64decode(p["data"])
    n = shape[0] * shape[1]
    if p["enc"] == "bits":
        bits = np.unpackbits(np.frombuffer(raw, np.uint8), bitorder="little")[:n]
        return torch.from_numpy(bits.astype(np.float64)).view(shape)
    q = torch.from_numpy(np.frombuffer(raw, "<u2").astype(np.int64)).view(shape)
    out = p["lo"] + q.double() * p["step"]
    return out.masked_fill(q == _NULL, -math.inf)


def position_limit(model: nn.Module | None, hf: object = None) -> int | None:
    """The most tokens ``model`` takes (its learned positions or configured length), or
    ``None`` when nothing bounds it (sinusoidal or rotary positions)."""
    caps: list[int] = []
    cfg = getattr(getattr(hf, "model", None), "config", None)
    for key in ("max_position_embeddings", "n_positions", "max_source_positions"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 0:
            caps.append(v)
    tok_max = getattr(getattr(hf, "tokenizer", None), "model_max_length", None)
    if isinstance(tok_max, int) and 0 < tok_max < 1_000_000:
        caps.append(tok_max)
    for m in model.modules() if model is not None else ():
        max_len = getattr(getattr(m, "cfg", None), "max_len", None) or (
            getattr(m, "max_len", None) if type(m).__name__ == "LearnedPositionalEmbedding" else None
        )
        if isinstance(max_len, int) and max_len > 0:
            caps.append(max_len)
    return min(caps) if caps else None


def map_limit(positions: int | None) -> int:
    """Tokens in the maps of a self-attention request: LONG_TOKEN_LIMIT (answered long beyond
    :func:`~qkv.limits.encoder_limit`), or fewer than the model's ``positions``: one short of
    them, because its tokenizer cuts there itself, silently, and a text that long must show
    as cut (MiniLM's 512 positions: 511 tokens)."""
    return LONG_TOKEN_LIMIT if positions is None else max(1, min(LONG_TOKEN_LIMIT, positions - 1))


def is_long(maps: AttentionMaps) -> bool:
    """Whether ``maps`` hold more weights than an answer sends as JSON."""
    return sum(w.numel() for w in maps.weights) > MAX_CELLS


def _pooled(w: Tensor, size: int) -> tuple[Tensor, int]:
    """``w (h, Tq, Tk)`` max-pooled in k × k blocks to at most ``size`` a side, and k."""
    k = max(1, math.ceil(max(w.shape[-2:]) / size))
    if k == 1:
        return w, 1
    return F.max_pool2d(w.float().unsqueeze(0), k, ceil_mode=True)[0], k


def long_fields(maps: AttentionMaps, layer: str, head: int) -> dict:
    """``layers`` (pooled), ``exact`` and ``top`` of a long answer (see the module docstring);
    ``layer``, ``head``: the selection (the step-by-step call's)."""
    size = encoder_limit(sum(len(h) for h in maps.heads))
    layers = []
    for i in range(len(maps)):
        w = maps.weights[i]  # (h, Tq, Tk)
        pooled, k = _pooled(w, size)
        layers.append({"name": maps.layers[i], "kind": maps.kinds[i], "heads": maps.heads[i],
                       "q_tokens": maps.q_tokens[i], "k_tokens": maps.k_tokens[i],
                       "weights": rounded(pooled),
                       "pooled": {"k": k, "rows": w.shape[1], "cols": w.shape[2], "how": "max"}})  # fmt: skip
    li = maps.layers.index(layer)
    w = maps.weights[li]  # (h, Tq, Tk)
    hi = maps.heads[li].index(head) if head in maps.heads[li] else 0
    k = min(TOP_K, w.shape[-1])
    top = w.float().topk(k, dim=-1)  # (h, Tq, k)
    return {
        "layers": layers,
        "exact": {"layer": layer, "head": maps.heads[li][hi], "shape": list(w.shape[1:]),
                  **pack(w[hi])},
        "top": {"layer": layer, "k": k, "index": top.indices.tolist(),
                "weights": top.values.double().round(decimals=DECIMALS).tolist()},
    }  # fmt: skip


def packed_steps(t: dict[str, Tensor | None], steps: tuple, q_tokens: list[str],
                 k_tokens: list[str], scale: float | None) -> list[dict]:
    """The step-by-step ``matrices`` of a call of more than TOKEN_LIMIT queries, packed
    (``steps``: :data:`qkv.apps.serve.answer.STEPS`); ``scaled``/``masked`` as a rule when
    they are exactly that, ``weights`` as a reference to the answer's ``exact`` map (the same
    call: such an answer is long)."""
    mask = t.get("mask")
    mask = None if mask is None else mask.double()
    if mask is not None and not bool(((mask == 0) | (mask == 1)).all()):
        mask = None  # not a 0/1 mask: ``masked`` is packed as it is
    tokens = {"q": q_tokens, "k": k_tokens}
    out = []
    for key, rows, square in steps:
        src = t.get(key)
        if src is None:
            continue
        full = list(src.shape)
        if not square:  # feature dimensions: the first STEP_DIMS
            src = src[:, :STEP_DIMS]
        m = {"key": key, "shape": full, "rows": tokens[rows],
             "cols": k_tokens if square else [str(i) for i in range(src.shape[1])]}  # fmt: skip
        if key == "weights":
            m.update(enc="ref", of="exact")
        elif key == "scaled" and scale is not None and torch.equal(src, t["scores"] * scale):
            m.update(enc="scaled", of="scores", by=scale)
        elif (key == "masked" and mask is not None and t.get("scaled") is not None
              and torch.equal(src, t["scaled"].masked_fill(mask == 0, -math.inf))):  # fmt: skip
            m.update(enc="masked", of="scaled")
        else:
            m.update(pack(src, bits=key == "mask" and mask is not None))
        out.append(m)
    return out
