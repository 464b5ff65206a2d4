"""The ``repeat_guard`` of greedy and beam search: no short pattern written three times in a row.

A small model out of its depth stutters inside a word before it loops over words: the fr-en
model turns the unknown "Où" into "Oestestest", a name into "Migigigiga", a formal word into
"Briririasasase". ``no_repeat_ngram=4`` (:mod:`qkv.generate._ngram`) lets a single token come
back any number of times ("est est est") and cannot see characters at all (sub-words cut a
run of letters anywhere). The guard bans a token when writing it would complete

* a unit of 1–4 tokens written 3 times in a row (``est est est``, ``a dog a dog a dog``),
  except digits inside a number ("00 00 00" of "1000000"; but "4 4 4" is banned);
* inside a word (from its token with a leading space on), a unit of 1–8 bytes (1–4 letters,
  accented ones being 2 bytes) of letters written 3 times in a row (``gigigi``, ``ssss``): the
  end of the word so far is continued by the unit, and every token that starts with that
  continuation is banned (a prefix table of the vocabulary, built once per tokenizer).

The training captions of Multi30k hold 3 such words in 29,000 lines ("dooorway", "AAA",
"eXXXotica"), so the guard changes nothing a model learned to write. It works like the n-gram
guard, in Python on what each step returns: ``(rows, tokens)`` pairs that greedy sets to
``-inf`` before the compiled pick and beam search drops from the compiled top-k.

Shapes: ``hist (N, L)``, the tokens each hypothesis wrote so far.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import Tensor

from qkv.generate._ngram import _repeats

__all__ = ["RepeatGuard", "banned_tokens"]

TIMES = 3  # a pattern may be written twice in a row, never three times
MAX_UNIT_TOKENS = 4
MAX_UNIT_BYTES = 8  # 4 letters of 2 bytes (é, ç, ü ...)
WINDOW = 16  # tokens looked at: a word of more pieces is cut to its last 16
_SPECIALS = 4  # <pad> <s> </s> <unk>: never banned, never part of a pattern


def _byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's ``bytes_to_unicode``) back to bytes: printable
    bytes are themselves, the others are shifted to 256 and up (a space is ``Ġ``)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def _letter(b: int) -> bool:
    """A byte that may repeat in a stutter: an ASCII letter or any byte of a non-ASCII
    character (accented letters); never a digit, a space or punctuation."""
    return 65 <= b <= 90 or 97 <= b <= 122 or b >= 128


def _ends_in_loop(word: bytes) -> bool:
    """Whether ``word`` ends with a unit of letters written :data:`TIMES` times in a row."""
    n = len(word)
    for p in range(1, MAX_UNIT_BYTES + 1):
        if n >= TIMES * p and all(map(_letter, word[n - p :])):
            if word[n - TIMES * p :] == word[n - p :] * TIMES:
                return True
    return False


class RepeatGuard:
    """Bans the tokens that would write a pattern three times in a row (module docstring).

    ``vocab``: each token's byte-level string (``Ġ`` for a leading space), as
    ``tokenizers``' byte-level BPE spells it; without it only the token rule runs.

    >>> g = RepeatGuard()
    >>> g.banned(torch.tensor([[7, 9, 9]]))   # a third 9 would be "9 9 9"
    (tensor([0]), tensor([9]))
    """

    def __init__(self, vocab: Sequence[str] | None = None) -> None:
        self.starts_word: list[bool] = []
        self.body: list[bytes] = []  # each token's bytes, its leading space dropped
        self.inner_digits: set[int] = set()  # digits inside a number ("0" of "1000")
        self._by_prefix: dict[bytes, list[int]] = {}  # word-inner tokens by each prefix
        self._cache: dict[tuple[int, ...], list[int]] = {}  # a word's tokens → banned
        self._stutters: list[int] = []  # tokens whose own bytes hold a stutter
        if vocab is None:
            return
        dec = _byte_decoder()
        for i, s in enumerate(vocab):
            raw = bytes(dec[c] for c in s) if i >= _SPECIALS and all(c in dec for c in s) else b""
            start = raw.startswith(b" ") or i < _SPECIALS
            body = raw[1:] if raw.startswith(b" ") else raw
            self.starts_word.append(start)
            self.body.append(body)
            if body.isdigit() and not start:
                self.inner_digits.add(i)
            if not start and body:
                for k in range(1, len(body) + 1):
                    self._by_prefix.setdefault(body[:k], []).append(i)
        self._stutters = [i for i, b in enumerate(self.body) if _has_loop(b)]

    @classmethod
    def for_tokenizer(cls, tokenizer) -> RepeatGuard:
        """The guard of a :class:`qkv.data.Tokenizer` (built once per tokenizer: ~50 ms)."""
        guard = _GUARDS.get(tokenizer)
        if guard is None:
            hf = tokenizer.hf
            guard = cls([hf.id_to_token(i) or "" for i in range(hf.get_vocab_size())])
            _GUARDS[tokenizer] = guard
        return guard

    def banned(self, hist: Tensor) -> tuple[Tensor, Tensor] | None:
        """The tokens each row of ``hist (N, L)`` may not write next: ``(rows, tokens)``
        pairs, or ``None`` when nothing is banned (most steps)."""
        if hist.shape[1] == 0:
            return None
        rows_out: list[int] = []
        toks_out: list[int] = []
        for r, row in enumerate(hist[:, -WINDOW:].tolist()):
            bad = self._token_loops(row)
            if self.body:
                bad += self._word_loops(row)
            if bad:
                rows_out += [r] * len(bad)
                toks_out += bad
        if not rows_out:
            return None
        dev = hist.device
        return (torch.tensor(rows_out, dtype=torch.long, device=dev),
                torch.tensor(toks_out, dtype=torch.long, device=dev))  # fmt: skip

    def _token_loops(self, row: list[int]) -> list[int]:
        """Tokens that would end a unit of 1–4 tokens written 3 times: the last
        ``3k - 1`` tokens have period ``k``, so token ``row[-k]`` would complete it."""
        out = []
        L = len(row)
        for k in range(1, MAX_UNIT_TOKENS + 1):
            if L < TIMES * k - 1:
                break
            tail = row[L - TIMES * k + 1 :]
            if tail[k:] != tail[:-k]:
                continue
            unit = row[L - k :]
            if min(unit) < _SPECIALS or all(u in self.inner_digits for u in unit):
                continue  # "1 0 0 0" is "1000"; "4 4 4" (spaced) is not exempt
            out.append(row[L - k])
        return out

    def _word_loops(self, row: list[int]) -> list[int]:
        """Word-inner tokens that would make the current word end in a stutter."""
        start = len(row) - 1
        while start > 0 and not self._starts(row[start]):
            start -= 1
        key = tuple(row[start:])
        bad = self._cache.get(key)
        if bad is None:
            if len(self._cache) > 200_000:
                self._cache.clear()
            bad = self._cache[key] = self._continuations(b"".join(self.body[i] for i in key))
        return list(bad)

    def _starts(self, token: int) -> bool:
        return token >= len(self.starts_word) or self.starts_word[token]

    def _continuations(self, word: bytes) -> list[int]:
        """For each unit length ``p``: if ``word`` ends with a unit of letters, the
        ``3p - run`` bytes that continue its run to 3 units; every token starting with them."""
        out = set(self._stutters)
        n = len(word)
        for p in range(1, min(MAX_UNIT_BYTES, n) + 1):
            unit = word[n - p :]
            if not all(map(_letter, unit)):
                continue
            run = p  # the longest end of the word with period p
            while run < n and word[n - 1 - run] == word[n - 1 - run + p]:
                run += 1
            need = max(1, TIMES * p - run)
            cont = (unit * (need // p + 1))[:need]
            out.update(self._by_prefix.get(cont, ()))
        return sorted(out)


def _has_loop(body: bytes) -> bool:
    """Whether some prefix of ``body`` ends in a stutter (the token alone holds one)."""
    return any(_ends_in_loop(body[:k]) for k in range(TIMES, len(body) + 1))


_GUARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def banned_tokens(hist: Tensor, no_repeat_ngram: int,
                  repeat_guard: RepeatGuard | None) -> tuple[Tensor, Tensor] | None:  # fmt: skip
    """What both guards ban after ``hist (N, L)``: ``(rows, tokens)`` pairs (a pair may come
    twice), or ``None``."""
    ngram = _repeats(hist, no_repeat_ngram) if no_repeat_ngram else None
    loops = repeat_guard.banned(hist) if repeat_guard is not None else None
    if ngram is None or loops is None:
        return ngram if loops is None else loops
    return torch.cat([ngram[0], loops[0]]), torch.cat([ngram[1], loops[1]])
