"""What one request may ask for, checked once at the boundary, and the limits that bound it.

Every number here bounds the work or the size of one response:

==================  =======  ==============================================================
MAX_BODY_BYTES      256 KiB  request body; larger → 413
MAX_JSON_DEPTH      64       arrays/objects nested in the body (a request uses 3); deeper → 400
READ_TIMEOUT_S      10       seconds a client has to send one request (headers and body)
MAX_TEXT_CHARS      20,000   characters looked at (a longer text is cut first)
TOKEN_LIMIT         128      tokens whose every map goes as JSON (3 decimals), fewer for a model
                             with many heads (encoder_limit: MiniLM 66); ``qkv view`` cuts there
LONG_TOKEN_LIMIT    2,048    tokens in the maps of a longer text (not translating), fewer where
                             the model's positions stop (one short of them: MiniLM 511, the
                             translators' encoders 255); longer → cut, notice. Such an answer is
                             *long* (qkv.apps.serve.long): every map max-pooled to ≤ P × P
                             (P = encoder_limit, so ≤ MAX_CELLS numbers), the selected head's
                             weights and step-by-step matrices exact, packed as uint16 (2 bytes
                             a cell, base64), each query's TOP_K = 8 strongest keys per head of
                             the selected layer
MAX_LONG_BYTES      64 MiB   a long answer: ≤ 4 packed T × T matrices (weights, scores, and
                             scaled/masked unless they are exactly scores × scale and scaled
                             masked) + the mask's bits + ≤ 7 T × 64 feature matrices + the
                             pooled maps; 2,048 tokens with ``random``: 25.5 MB (11 MB gzipped),
                             1.7 s to compute on 2 CPU cores (3.3–4.7 s to the last byte at a
                             load average of 3)
MAX_TOP_K           10       tokens per cell of the Lens (compute_lens), which reads the maps'
                             positions (≤ LONG_TOKEN_LIMIT; a translator's decoder inputs): an
                             answer holds ≤ (layers + 1) × positions × MAX_TOP_K tokens and
                             probabilities, the attribution 2 × MAX_TOP_K per head at one
                             position; 2,048 tokens, the tests' 2-layer Llama, top_k 5: 440 kB,
                             0.15 s (top_k 10: 820 kB)
TRANSLATE_LIMIT     48       source tokens in the maps when translating; target ≤
                             target_limit(source). A longer text is split as ``qkv translate``
                             splits a line (sentences, then word runs: qkv.limits.split_to_fit),
                             each piece translated and the translations joined; the maps show
                             one piece (``piece``)
MAX_PIECES          8        pieces translated for one request; the text after them is cut
MAX_CELLS           320,000  attention weights as JSON in one response (all layers × heads ×
                             Tq × Tk; pooled maps count as their cells)
MAX_BEAM            8        beam size
STEP_DIMS           64       feature columns shown per step-by-step matrix (x, Q, K, V, …)
DECIMALS            3        decimals of every float in a response
==================  =======  ==============================================================

``TOKEN_LIMIT``, ``MAX_CELLS``, ``DECIMALS`` and :func:`encoder_limit` are the library's
(:mod:`qkv.limits`): the notebook view and ``qkv view``'s page (:mod:`qkv.capture.page`)
bound their maps the same way.

>>> parse_request({"text": "The boy trains the puppy.", "model": "random"}).translate
False
>>> parse_request({"text": "  "})
Traceback (most recent call last):
...
qkv.apps.serve.limits.BadRequest: text must contain at least one non-space character
>>> parse_json(b'{"beam": ' + b"9" * 5000 + b"}")["beam"]
a number with 5000 digits
>>> parse_json(b"[" * 100_000)
Traceback (most recent call last):
...
qkv.apps.serve.limits.BadRequest: JSON nested too deep: at most 64 levels of arrays and objects
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

# the maps' limits are the library's: the notebook view and qkv view's page share them
from qkv.limits import DECIMALS, LONG_TOKEN_LIMIT, MAX_CELLS, TOKEN_LIMIT, encoder_limit

__all__ = [
    "DECIMALS",
    "MAX_BEAM",
    "MAX_CELLS",
    "MAX_JSON_DEPTH",
    "LONG_TOKEN_LIMIT",
    "MAX_LONG_BYTES",
    "MAX_PIECES",
    "MAX_BODY_BYTES",
    "MAX_TEXT_CHARS",
    "READ_TIMEOUT_S",
    "STEP_DIMS",
    "TOKEN_LIMIT",
    "TARGET_LIMIT",
    "TRANSLATE_LIMIT",
    "AttentionRequest",
    "BadRequest",
    "LongNumber",
    "encoder_limit",
    "parse_json",
    "parse_request",
    "target_limit",
    "translate_limit",
]

MAX_BODY_BYTES = 256 * 1024
MAX_JSON_DEPTH = 64
READ_TIMEOUT_S = 10.0
MAX_TEXT_CHARS = 20_000
TRANSLATE_LIMIT = 48
TARGET_LIMIT = 80
MAX_BEAM = 8
STEP_DIMS = 64
MAX_ABLATE = 512
MAX_CANDIDATES = 8
MAX_PIECES = 8  # pieces of a long text translated for one request (qkv.apps.serve.answer)
MAX_LONG_BYTES = 64 * 2**20  # a long answer's JSON (see the table above)


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
    piece: int = 0  # translating a text split into pieces: the one whose maps are shown
    # answered long beyond the JSON maps' limit (qkv.apps.serve.long); not a body field:
    # qkv view's self-contained page keeps to TOKEN_LIMIT
    long: bool = True


# A field needs at most a few digits; Python refuses to convert more than 4,300 (ValueError).
_MAX_INT_DIGITS = 20
# bytes of the nesting scan (a UTF-8 sequence's bytes are all >= 0x80: never one of these)
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN, _CLOSE = (ord("["), ord("{")), (ord("]"), ord("}"))
_SURROGATE = re.compile(r"[\ud800-\udfff]")


class LongNumber:
    """An integer of more than 20 digits in a body, kept unconverted so that the field that
    holds it answers a 400 naming itself (no field takes such a number)."""

    __slots__ = ("digits",)

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"a number with {self.digits} digits"


def _parse_int(s: str) -> int | LongNumber:
    digits = len(s.lstrip("-"))
    return LongNumber(digits) if digits > _MAX_INT_DIGITS else int(s)


def _parse_constant(name: str) -> None:
    raise BadRequest(f"the body must be JSON: {name} is not a JSON number")


def _nesting_ok(raw: bytes) -> bool:
    """Whether arrays/objects in ``raw`` nest at most :data:`MAX_JSON_DEPTH` deep.

    One pass over the bytes, each looked at once (linear: 256 KiB in ~10 ms, whatever they
    are), tracking whether it is inside a string and after a backslash there: brackets inside
    strings are text. Up to the first error json.loads would stop at, this reads the body as it
    does; after a close with nothing open (already an error there) there is nothing to check.
    A loop, not recursion: json.loads itself recurses and a deep body would raise
    RecursionError. Plain Python, not a regex over the body: a regex that restarts at every
    quote is quadratic on ``"\\"\\"\\"...``, and holds the GIL (the server's event loop
    too) until it is done, even in a worker thread.
    """
    depth, in_string, escaped = 0, False, False
    for b in raw:
        if in_string:
            if escaped:
                escaped = False
            elif b == _BACKSLASH:
                escaped = True
            elif b == _QUOTE:
                in_string = False
        elif b == _QUOTE:
            in_string = True
        elif b in _OPEN:
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return False
        elif b in _CLOSE:
            depth -= 1
            if depth < 0:
                return True
    return True


def parse_json(raw: bytes) -> object:
    """Decode a request body; one :class:`BadRequest` (400) with a readable reason if it is
    not UTF-8 JSON, nests deeper than :data:`MAX_JSON_DEPTH`, or holds NaN/Infinity."""
    if not _nesting_ok(raw):
        raise BadRequest(f"JSON nested too deep: at most {MAX_JSON_DEPTH} levels of arrays "
                         "and objects")  # fmt: skip
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadRequest(f"the body must be UTF-8 text: byte {err.start} is not UTF-8") from None
    if not text.strip():
        raise BadRequest('the body is empty: send a JSON object such as {"text": "..."}')
    try:
        return json.loads(text, parse_int=_parse_int, parse_constant=_parse_constant)
    except json.JSONDecodeError as err:
        raise BadRequest(f"the body must be JSON: {err.msg.lower()} at line {err.lineno}, "
                         f"column {err.colno}") from None  # fmt: skip


def _kind(v: object) -> str:
    """A JSON value as an error message names it: its JSON type (or the number), not Python's."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float | LongNumber):
        return repr(v)
    names = {int: "a number", str: "a string", list: "an array", dict: "an object"}
    return names.get(type(v), type(v).__name__)


def _unicode(key: str, v: str) -> str:
    """``v``, refused if it holds a lone surrogate (JSON's "\\ud800" decodes to one; no text
    encoder takes it)."""
    m = _SURROGATE.search(v)
    if m:
        raise BadRequest(f"{key} must be valid Unicode text: character {m.start()} is a lone "
                         f"surrogate (U+{ord(m[0]):04X})")  # fmt: skip
    return v


def _show(v: object, width: int = 60) -> str:
    """``repr(v)`` cut to ``width`` characters: an error message never echoes a whole body."""
    r = repr(v)
    return r if len(r) <= width else r[: width - 3] + "..."


def _str(body: dict, key: str, default: str | None = None, *, limit: int = 200,
         name: str | None = None) -> str | None:  # fmt: skip
    name = name or key
    v = body.get(key, default)
    if v is None:
        return None
    if not isinstance(v, str):
        raise BadRequest(f"{name} must be a string, got {_kind(v)}")
    if len(v) > limit:
        raise BadRequest(f"{name} must be at most {limit} characters, got {len(v)}")
    return _unicode(name, v)


def _int(body: dict, key: str, default: int, lo: int, hi: int) -> int:
    v = body.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{key} must be an integer in [{lo}, {hi}], got {_kind(v)}")
    if not lo <= v <= hi:
        raise BadRequest(f"{key} must be in [{lo}, {hi}], got {v}")
    return v


def parse_request(body: object) -> AttentionRequest:
    """Check a decoded JSON body; one :class:`BadRequest` naming the field on any problem."""
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {_kind(body)}")
    text = body.get("text")
    if not isinstance(text, str):
        raise BadRequest(f"text must be a string, got {_kind(text)}")
    _unicode("text", text)
    if not text.strip():
        raise BadRequest("text must contain at least one non-space character")
    translate = body.get("translate", False)
    if not isinstance(translate, bool):
        raise BadRequest(f"translate must be true or false, got {_kind(translate)}")
    ablate = body.get("ablate") or []
    if not isinstance(ablate, list) or len(ablate) > MAX_ABLATE:
        raise BadRequest(f"ablate must be a list of at most {MAX_ABLATE} [layer, head] pairs")
    pairs = []
    for item in ablate:
        ok = (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
              and isinstance(item[1], int) and not isinstance(item[1], bool))  # fmt: skip
        if not ok:
            raise BadRequest(f"ablate items must be [layer name, head index], got {_show(item)}")
        pairs.append((_unicode("ablate layer name", item[0]), item[1]))
    probe = body.get("probe")
    token, candidates = None, []
    if probe is not None:
        if not isinstance(probe, dict):
            raise BadRequest("probe must be an object {token, candidates}")
        token = _str(probe, "token", limit=100, name="probe.token")
        candidates = probe.get("candidates", [])
        if (not token or not isinstance(candidates, list) or not 1 <= len(candidates) <= MAX_CANDIDATES
                or not all(isinstance(c, str) and 0 < len(c) <= 100 for c in candidates)):  # fmt: skip
            raise BadRequest(f"probe needs a token and 1 to {MAX_CANDIDATES} candidate words")
        for c in candidates:
            _unicode("probe.candidates", c)
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
        piece=_int(body, "piece", 0, 0, MAX_PIECES - 1),
    )
