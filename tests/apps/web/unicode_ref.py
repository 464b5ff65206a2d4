"""The reference Unicode classes tokenize.js must reproduce, read off the reference code.

HF tokenizers (Rust) and Python 3.11 carry their own Unicode tables, older than a browser's;
``classes(cps)`` asks the installed ``tokenizers`` and Python, one code point at a time,
what each class the JS port uses says, so the port's corrections (``UNICODE_FIXES`` in
``tokenize.js``) are checked against the references and can be regenerated from them
(``python tests/apps/web/unicode_ref.py`` prints the table).
"""

from __future__ import annotations

import json
import re
import subprocess
import unicodedata
from collections.abc import Iterable
from pathlib import Path

from tokenizers import normalizers, pre_tokenizers

# the class names of tokenize.js's UNICODE_FIXES: predicates (sets) and maps (dicts)
PREDICATES = ("rust.whitespace", "rust.other", "rust.punctuation", "rust.nonspacing",
              "onig.letter", "onig.number", "onig.space", "py.word", "py.punctOrSymbol",
              "py.space")  # fmt: skip
MAPS = ("rust.lower", "rust.nfd", "py.lower")
IGNORED = "ignored"  # {name: code points whose class the port never asks}
HARNESS = Path(__file__).with_name("tokenize_harness.js")
SCRIPT = Path(__file__).parents[3] / "src/qkv/apps/web/static/tokenize.js"
_ASCII_PUNCT = {c for c in range(0x21, 0x7F) if not chr(c).isalnum()}


def code_points(step: int = 1) -> list[int]:
    """Every code point but the surrogates; with ``step`` > 1, planes 0-1 whole and every
    ``step``-th code point above (planes 2-16 are CJK ranges, unassigned and private use)."""
    out = [c for c in range(0x20000) if not 0xD800 <= c <= 0xDFFF]
    return out + list(range(0x20000, 0x110000, step))


def classes(cps: Iterable[int]) -> dict:
    """``{name: [code points in the class]}`` for PREDICATES, ``{name: {cp: image}}``
    (only where the image differs from the character) for MAPS, and under IGNORED the code
    points whose class does not matter."""
    clean = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=False,
                                       strip_accents=False, lowercase=False)  # fmt: skip
    strip = normalizers.BertNormalizer(clean_text=False, handle_chinese_chars=False,
                                       strip_accents=True, lowercase=False)  # fmt: skip
    lower = normalizers.BertNormalizer(clean_text=False, handle_chinese_chars=False,
                                       strip_accents=False, lowercase=True)  # fmt: skip
    nfd = normalizers.NFD()
    bert = pre_tokenizers.BertPreTokenizer()
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    word = re.compile(r"\w")
    out: dict = {name: [] for name in PREDICATES} | {name: {} for name in MAPS}
    out[IGNORED] = {"rust.nonspacing": []}
    for cp in cps:
        c = chr(cp)
        n = len(bert.pre_tokenize_str("a" + c + "a"))
        if n == 2:
            out["rust.whitespace"].append(cp)
        if n == 3 and cp not in _ASCII_PUNCT:
            out["rust.punctuation"].append(cp)
        if cp not in (0, 0xFFFD) and clean.normalize_str(c) == "":
            out["rust.other"].append(cp)
        d = nfd.normalize_str(c)
        if d != c:  # its own class never counts: the accents are stripped after NFD
            out["rust.nfd"][cp] = d
            out[IGNORED]["rust.nonspacing"].append(cp)
        elif strip.normalize_str(c) == "":
            out["rust.nonspacing"].append(cp)
        low = lower.normalize_str(c)
        if low != c:
            out["rust.lower"][cp] = low
        if len(byte_level.pre_tokenize_str("a" + c)) == 1:
            out["onig.letter"].append(cp)
        elif len(byte_level.pre_tokenize_str("1" + c)) == 1:
            out["onig.number"].append(cp)
        elif len(byte_level.pre_tokenize_str("!" + c)) == 2:  # not [^\s\pL\pN]: a space
            out["onig.space"].append(cp)
        if word.match(c):
            out["py.word"].append(cp)
        if unicodedata.category(c)[0] in "PS":
            out["py.punctOrSymbol"].append(cp)
        if c.isspace():
            out["py.space"].append(cp)
        if c.lower() != c:
            out["py.lower"][cp] = c.lower()
    return out


def compare(cps: list[int], ref: dict) -> dict:
    """Run the node harness over ``cps``: ``{name: {"fixed": [...], "base": [...]}}``, the
    code points where tokenize.js's corrected (``fixed``) and uncorrected (``base``) class
    or map disagrees with ``ref`` (from :func:`classes`)."""
    sent = {k: (v if isinstance(v, list) else {str(a): b for a, b in v.items()})
            for k, v in ref.items() if k != IGNORED}  # fmt: skip
    req = json.dumps({"unicode": {"cps": cps, "ref": sent, "ignore": ref[IGNORED]}})
    out = subprocess.run(["node", str(HARNESS)], input=req, capture_output=True, text=True,
                         check=True, timeout=300)  # fmt: skip
    return json.loads(out.stdout)["unicode"]


def _ranges(cps: Iterable[int]) -> str:
    out: list[list[int]] = []
    for c in sorted(cps):
        if out and out[-1][1] == c - 1:
            out[-1][1] = c
        else:
            out.append([c, c])
    return ",".join(f"{a:x}" if a == b else f"{a:x}-{b:x}" for a, b in out)


def fixes(ref: dict, diff: dict) -> dict:
    """UNICODE_FIXES for tokenize.js: where the JS base classes differ from ``ref``, and every
    member (or mapped character) of a reference class that Python's Unicode 14 does not know:
    a browser with an older Unicode than node's may not know it either."""
    out: dict = {}
    for name, r in diff.items():
        later = {c for c in ref[name] if _unassigned(c)}
        base = set(r["base"]) | later
        if not base:
            continue
        if name in MAPS:
            out[name] = {"=": {f"{c:x}": ref[name].get(c, chr(c)) for c in sorted(base)}}
        else:
            inside = set(ref[name])
            plus = _ranges(c for c in base if c in inside)
            minus = _ranges(c for c in base if c not in inside)
            out[name] = {k: v for k, v in (("+", plus), ("-", minus)) if v}
    return out


def _wrap(items: list[str], sep: str, width: int) -> list[str]:
    """``items`` joined by ``sep`` into lines of at most ``width`` characters (a range string
    keeps its trailing comma on each line but the last)."""
    lines, cur = [], ""
    for item in items:
        if cur and len(cur) + len(sep) + len(item) > width:
            lines.append(cur + (sep.strip() if sep == "," else ""))
            cur = item
        else:
            cur = f"{cur}{sep}{item}" if cur else item
    return [*lines, cur] if cur else lines


def _unassigned(cp: int) -> bool:
    return unicodedata.category(chr(cp)) == "Cn"


def write_fixes() -> None:
    """Regenerate tokenize.js's UNICODE_FIXES from the installed references (all code points)."""
    cps = code_points()
    ref = classes(cps)
    table = fixes(ref, compare(cps, ref))
    lines = ["    return {"]
    for name, fix in table.items():
        lines.append(f"      {json.dumps(name)}: {{")
        for key, value in fix.items():
            if isinstance(value, str):  # ranges: strings of ≤ 90 characters joined with +
                parts = _wrap(value.split(","), ",", 86)
                body = " +\n          ".join(json.dumps(p) for p in parts)
            else:
                items = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in value.items()]
                body = "{\n          " + ",\n          ".join(_wrap(items, ", ", 86))
                body += ",\n        }"
            lines.append(f"        {json.dumps(key)}: {body},")
        lines.append("      },")
    lines.append("    };")
    text = SCRIPT.read_text(encoding="utf-8")
    begin = text.index("\n", text.index("// BEGIN UNICODE_FIXES")) + 1
    end = text.index("    // END UNICODE_FIXES")
    tmp = SCRIPT.with_suffix(".js.tmp")
    tmp.write_text(text[:begin] + "\n".join(lines) + "\n" + text[end:], encoding="utf-8")
    tmp.replace(SCRIPT)


if __name__ == "__main__":
    write_fixes()
