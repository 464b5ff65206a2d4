"""What one request may ask for, checked once at the boundary, and the limits that bound it.

Every number here bounds the work or the size of one response:

==================  =======  ==============================================================
MAX_BODY_BYTES      256 KiB  request body; larger → 413
MAX_TEXT_CHARS      20,000   characters looked at (a longer text is cut first)
TOKEN_LIMIT         128      tokens in the maps (incl. special tokens); longer → cut, notice
TRANSLATE_LIMIT     48       source tokens when translating; target ≤ target_limit(source)
MAX_CELLS           320,000  attention weights in one response (all layers × heads × Tq × Tk):
                             a model with many heads gets a lower token limit (MiniLM: 66)
MAX_BEAM            8        beam size
STEP_DIMS           64       feature columns shown per step-by-step matrix (x, Q, K, V, …)
DECIMALS            3        decimals of every float in a response
==================  =======  ==============================================================

>>> parse_request({"text": "The boy trains the puppy.", "model": "random"}).translate
False
>>> parse_request({"text": "  "})
Traceback (most recent call last):
...
qkv.apps.serve.limits.BadRequest: text must contain at least one non-space character
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = [
    "DECIMALS",
    "MAX_BEAM",
    "MAX_CELLS",
    "MAX_BODY_BYTES",
    "MAX_TEXT_CHARS",
    "STEP_DIMS",
    "TOKEN_LIMIT",
    "TARGET_LIMIT",
    "TRANSLATE_LIMIT",
    "AttentionRequest",
    "BadRequest",
    "encoder_limit",
    "parse_request",
    "target_limit",
    "translate_limit",
]

MAX_BODY_BYTES = 256 * 1024
MAX_TEXT_CHARS = 20_000
TOKEN_LIMIT = 128
TRANSLATE_LIMIT = 48
TARGET_LIMIT = 80
MAX_CELLS = 320_000
MAX_BEAM = 8
STEP_DIMS = 64
DECIMALS = 3
MAX_ABLATE = 512
MAX_CANDIDATES = 8


def encoder_limit(n_heads_total: int) -> int:
    """Token limit of a self-attention model with ``n_heads_total`` heads (all layers)."""
    return max(8, min(TOKEN_LIMIT, math.isqrt(MAX_CELLS // max(1, n_heads_total))))


def target_limit(n_source: int) -> int:
    """Most tokens decoded for a source of ``n_source`` tokens (``</s>`` included)."""
    return min(TARGET_LIMIT, n_source * 3 // 2 + 8)


def translate_limit(enc_heads: int, dec_heads: int, cross_heads: int) -> int:
    """Source-token limit of a translator: its maps (target ≤ target_limit(S)) fit MAX_CELLS."""
    for S in range(TRANSLATE_LIMIT, 8, -1):
        T = target_limit(S)
        if enc_heads * S * S + dec_heads * T * T + cross_heads * T * S <= MAX_CELLS:
            return S
    return 8


class BadRequest(ValueError):
    """A request the server answers with ``{"error": message}`` and a 4xx status."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class AttentionRequest:
    """A checked ``POST /api/attention`` body (see ``docs/serve.md`` for every field)."""

    text: str
    model: str = "minilm"
    translate: bool = False
    beam: int = 1
    layer: str | None = None  # step-by-step detail: layer name (default: the first layer)
    head: int = 0
    ablate: list[tuple[str, int]] = field(default_factory=list)
    probe_token: str | None = None
    probe_candidates: list[str] = field(default_factory=list)


def _str(body: dict, key: str, default: str | None = None, *, limit: int = 200) -> str | None:
    v = body.get(key, default)
    if v is None:
        return None
    if not isinstance(v, str):
        raise BadRequest(f"{key} must be a string, got {type(v).__name__}")
    if len(v) > limit:
        raise BadRequest(f"{key} must be at most {limit} characters, got {len(v)}")
    return v


def _int(body: dict, key: str, default: int, lo: int, hi: int) -> int:
    v = body.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{key} must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise BadRequest(f"{key} must be in [{lo}, {hi}], got {v}")
    return v


def parse_request(body: object) -> AttentionRequest:
    """Check a decoded JSON body; one :class:`BadRequest` naming the field on any problem."""
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    text = body.get("text")
    if not isinstance(text, str):
        raise BadRequest(f"text must be a string, got {type(text).__name__}")
    if not text.strip():
        raise BadRequest("text must contain at least one non-space character")
    translate = body.get("translate", False)
    if not isinstance(translate, bool):
        raise BadRequest(f"translate must be true or false, got {translate!r}")
    ablate = body.get("ablate") or []
    if not isinstance(ablate, list) or len(ablate) > MAX_ABLATE:
        raise BadRequest(f"ablate must be a list of at most {MAX_ABLATE} [layer, head] pairs")
    pairs = []
    for item in ablate:
        ok = (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
              and isinstance(item[1], int) and not isinstance(item[1], bool))  # fmt: skip
        if not ok:
            raise BadRequest(f"ablate items must be [layer name, head index], got {item!r}")
        pairs.append((item[0], item[1]))
    probe = body.get("probe")
    token, candidates = None, []
    if probe is not None:
        if not isinstance(probe, dict):
            raise BadRequest("probe must be an object {token, candidates}")
        token = _str(probe, "token", limit=100)
        candidates = probe.get("candidates", [])
        if (not token or not isinstance(candidates, list) or not 1 <= len(candidates) <= MAX_CANDIDATES
                or not all(isinstance(c, str) and 0 < len(c) <= 100 for c in candidates)):  # fmt: skip
            raise BadRequest(f"probe needs a token and 1 to {MAX_CANDIDATES} candidate words")
    return AttentionRequest(
        text=text,
        model=_str(body, "model", "minilm"),
        translate=translate,
        beam=_int(body, "beam", 1, 1, MAX_BEAM),
        layer=_str(body, "layer"),
        head=_int(body, "head", 0, 0, 1024),
        ablate=pairs,
        probe_token=token,
        probe_candidates=candidates,
    )
