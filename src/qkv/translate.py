"""Translation with a trained model, by name or directory (the command line: :mod:`qkv.apps.translate`).

qkv ships two models trained on Multi30k with ``qkv train`` (``en-fr``, the default, and
``fr-en``); any ``qkv train`` run directory works too. Multi30k is 29,000 English image
captions (at most ~40 words, most under 20) with their French: the models translate short
descriptive sentences, not long or technical text. A :class:`Translator` knows its limits:

* it never writes a 4-gram of tokens twice (``no_repeat_ngram``), so a sentence it cannot
  handle ends instead of looping to the length limit (``2·source + 10`` tokens);
* it never writes a pattern of 1–4 tokens, or of 1–4 letters inside a word, three times in a
  row (``repeat_guard``, :class:`qkv.generate.RepeatGuard`): no "Oestestest", "Migigigiga";
* a number of two digits or more, a lone "7" or "0", and a name are translated as a one-digit
  placeholder, then put back (``number_placeholders``, ``name_placeholders``): the models copy
  "42", "camion 7" or "Olga" badly, a single digit well; where the placeholders do not come
  back one for one, a wider search picks the hypothesis that has them all, and the plain
  translation is kept if none has;
* a line in capitals (``A GROUP OF MUSICIANS``) is translated in sentence case, then put back
  into capitals: the captions it learned from have almost no words in capitals;
* it warns (:class:`UserWarning`; ``qkv translate`` prints a note, one line per input line)
  when a line is far from the training data: a sentence of more than 40 words, many words the
  vocabulary does not know (split into small pieces), and the notes of
  :mod:`qkv.translate_notes` (words it has not seen, numbers, another language, a question);
  :meth:`Translator.check` returns them without translating.

    qkv translate "The boy trains the puppy."
    echo "Un chien court." | qkv translate --model fr-en
    qkv evaluate --model en-fr --split test_2016_flickr --beam 5

>>> import qkv.translate
>>> tr = qkv.translate.load("en-fr")                          # doctest: +SKIP
>>> tr("The boy trains the puppy.")                          # doctest: +SKIP
'Le garçon entraîne le chiot.'
"""

from __future__ import annotations

import functools
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from qkv.data import Tokenizer
from qkv.generate import RepeatGuard, beam_search
from qkv.generate import translate as _decode
from qkv.generate._common import _evaluating
from qkv.limits import split_sentences, split_to_fit
from qkv.loading import read_json
from qkv.models import load_pretrained
from qkv.models.io import resolve_dir
from qkv.models.shipped import DEFAULT, shipped, shipped_dir
from qkv.translate_notes import find_names, note_text, source_notes

__all__ = [
    "NO_REPEAT_NGRAM",
    "Translator",
    "in_capitals",
    "load",
    "load_translator",
    "protect",
    "protect_numbers",
    "restore_numbers",
    "sentence_case",
    "unglue_digits",
    "source_warnings",
    "warning_text",
]

# {"src", "tgt", "beam", "length_penalty", optional "no_repeat_ngram", "repeat_guard",
# "number_placeholders", "name_placeholders"}: decoding defaults
GENERATION_FILE = "generation.json"

# Tokens, not words (a word is 1-3 tokens). 4: BLEU of the shipped models within -0.11..+0.49
# of no guard on val, test_2016 and test_2017 (greedy and beam 5; 9 of 12 up) and loops cut
# short; 3 cost 0.3 BLEU (legitimate repeats such as "un homme ... un homme" broken); 5 and 6
# keep BLEU but let a lost model wander to the length limit ("dans une guitare dans la ...").
NO_REPEAT_NGRAM = 4
# The training captions: at most 37 (en) / 43 (fr) words, 99.9% at most 32.
LONG_SENTENCE_WORDS = 40
# Tokens per word of a training sentence: 99.9% at most 2.3 (the vocabulary knows its words);
# an unknown word falls apart into byte-level pieces. Only from 6 tokens on (a name alone).
PIECES_PER_WORD = 2.5

# The English of each warning (the explorer has them in every language: static/i18n, "warn.*")
WARNINGS = {
    "long": "This sentence has {words} words; the model learned from image captions of up to "
            "about 40 words, so the translation may be poor.",
    "pieces": "Words here are unknown to the model's vocabulary (split into many small pieces), "
              "so the translation may be poor.",
    "caps": "The text is all in capitals: it was translated in sentence case (a capital first "
            "letter, the rest small) and the translation put back into capitals.",
}  # fmt: skip


def source_warnings(tokenizer: Tokenizer, text: str) -> list[dict]:
    """Why ``text`` is far from the captions the translators learned from: ``[{"code": "long",
    "words": n}]`` for a sentence of more than 40 words, ``{"code": "pieces", "per_word": x}``
    for many tokens per word (unknown words); ``[]`` for an ordinary caption.

    >>> from qkv.data import Tokenizer
    >>> tok = Tokenizer.train(["a dog runs on the grass"] * 20, vocab_size=300)
    >>> source_warnings(tok, "a dog runs on the grass")
    []
    >>> [w["code"] for w in source_warnings(tok, " ".join(["dog"] * 41))]
    ['long']
    """
    out: list[dict] = []
    words = max((len(s.split()) for s in split_sentences(text)), default=0)
    if words > LONG_SENTENCE_WORDS:
        out.append({"code": "long", "words": words})
    n_words, n_tokens = len(text.split()), len(tokenizer.encode(text))
    if n_words and n_tokens >= 6 and n_tokens > PIECES_PER_WORD * n_words:
        out.append({"code": "pieces", "per_word": round(n_tokens / n_words, 1)})
    return out


def warning_text(w: dict) -> str:
    """The English sentence of one of :func:`source_warnings`' warnings, or of
    :func:`qkv.translate_notes.source_notes`' notes."""
    if w["code"] in WARNINGS:
        return WARNINGS[w["code"]].format(**w)
    return note_text(w)


# A number: digits not glued to a letter before them ("dog0", "MP3" are words), with their
# separators ("10:45", "1,000"). Those of two digits or more are translated as a placeholder:
# the models write "42" or "1965" as "122" or "195" (a digit is a token, few captions have
# any) but copy a single digit. Beam 5, on Multi30k val's sentences with digits and 24
# hand-written ones: numbers right 23 -> 23 of 26 (en-fr), 5 -> 9 of 16 (fr-en); on 150 train
# sentences with digits, BLEU 71.67 -> 71.83 (en-fr), 39.93 -> 40.68 (fr-en). Placeholders for
# single digits too cost BLEU (en-fr 67.92: "4 personnes" where captions say "Quatre"), but not
# for "7" and "0": the vocabulary has no " 7" token, so the model must write a bare space and
# then "7", and it drops the space ("un camion7"); they go through placeholders too (the 9
# train and val sentences with a lone 7 or 0, copied: en-fr 1 -> 5 of 6, the space put back
# alone 2; fr-en 1 -> 2 of 3).
NUMBER = re.compile(r"(?<![^\W\d_])\d+(?:[.,:]\d+)*")
PLACEHOLDERS = ("5", "3", "4", "6", "9", "8", "2")  # one token each; "1" would be singular
# By the target language, best first: how often the shipped model wrote the digit back, put
# in place of one name in 28 (en-fr) / 31 (fr-en) sentences (hand-written ones and Multi30k
# val's from sentence 300 on with a name, greedy; bench/placeholder_digits.py): into French
# 5: 19, 9: 17, 8: 10, 2, 3, 4: 1-2, 6: 0 ("trois", "deux"); into English 2: 18, 5: 15, 3: 13,
# 4: 10, 6: 3, 8, 9: 0.
PLACEHOLDERS_INTO = {"fr": ("5", "9", "8", "2", "4", "3", "6"),
                     "en": ("2", "5", "3", "4", "6", "9", "8")}  # fmt: skip
AND = {"en": "and", "fr": "et", "de": "und"}  # "John and Maria" is one placeholder
# A line whose placeholders did not come back one for one is searched again this wide, and
# the best hypothesis that has each of them once is kept (greedy too: greedy comes first).
RETRY_BEAM = 5


def protect(
    text: str, *, names: list[tuple[int, int]] = (), digits: str = "", numbers: bool = True,
    placeholders: tuple[str, ...] = PLACEHOLDERS,
) -> tuple[str, dict[str, str]]:  # fmt: skip
    """``text`` with each number of two digits or more (``numbers``), each single digit of
    ``digits``, and each span of ``names`` (``(start, end)``, from
    :func:`qkv.translate_notes.find_names`) replaced by a one-digit placeholder (the next of
    ``placeholders`` that is not a number of ``text`` already), and ``{placeholder: what it
    stands for}`` (empty: nothing replaced; what comes after the 7 placeholders stays as it
    is). The same number or name twice gets the same placeholder.

    >>> protect("John gives 3 of his 12 boxes to Maria at 7.", names=[(0, 4), (32, 37)],
    ...         digits="07")
    ('5 gives 3 of his 4 boxes to 6 at 9.', {'5': 'John', '4': '12', '6': 'Maria', '9': '7'})
    """
    spans = sorted(list(names) + [m.span() for m in NUMBER.finditer(text) if numbers and (
        sum(c.isdigit() for c in m[0]) >= 2 or m[0] in digits)])  # fmt: skip
    free = [p for p in placeholders if p not in {m[0] for m in NUMBER.finditer(text)}]
    given: dict[str, str] = {}  # number or name -> placeholder
    out, at = [], 0
    for a, b in spans:
        item = text[a:b]
        if item not in given and len(given) < len(free):
            given[item] = free[len(given)]
        out += [text[at:a], given.get(item, item)]
        at = b
    return "".join(out) + text[at:], {p: n for n, p in given.items()}


def protect_numbers(text: str) -> tuple[str, dict[str, str]]:
    """:func:`protect` for the numbers of two digits or more alone.

    >>> protect_numbers("A runner with number 42 passes 3 people.")
    ('A runner with number 5 passes 3 people.', {'5': '42'})
    """
    return protect(text)


def restore_numbers(text: str, back: dict[str, str]) -> str | None:
    """``text`` with each placeholder of :func:`protect` put back, or ``None`` when the
    placeholders are not all there exactly once (the translation lost or doubled one).

    >>> restore_numbers("Un coureur portant le numéro 5 dépasse 3 personnes.", {"5": "42"})
    'Un coureur portant le numéro 42 dépasse 3 personnes.'
    """
    found = [m[0] for m in NUMBER.finditer(text) if m[0] in back]
    if sorted(found) != sorted(back):
        return None
    return NUMBER.sub(lambda m: back.get(m[0], m[0]), text)


def unglue_digits(text: str, source: str) -> str:
    """``text`` with a space put back between a word and a number glued to it ("camion7"),
    where ``source`` has that number standing alone and no word glued to digits ("MP3"): with
    no " 7" token the model must write a bare space before "7", and sometimes does not.

    >>> unglue_digits("un camion7 rouge", "a red truck at 7")
    'un camion 7 rouge'
    """
    alone = {m[0] for m in NUMBER.finditer(source)}
    if not alone or re.search(r"[^\W\d_]\d", source):
        return text
    return re.sub(r"(?<=[^\W\d_])(\d+(?:[.,:]\d+)*)",
                  lambda m: " " + m[1] if m[1] in alone else m[1], text)  # fmt: skip


def _is_name(item: str) -> bool:
    return NUMBER.fullmatch(item) is None


def _without_count_words(hyp: str, back: dict[str, str]) -> list[str]:
    """``hyp``, then ``hyp`` without the one or two words after a name's placeholder: the
    models read a digit in a name's place as a count and add a noun ("5 personnes promènent
    leur chien" for "John and Maria walk their dog"); :meth:`Translator._scores` chooses.

    >>> _without_count_words("5 personnes promènent leur chien.", {"5": "Ana"})
    ['5 personnes promènent leur chien.', '5 promènent leur chien.', '5 leur chien.']
    """
    out = [hyp]
    for p in (p for p, item in back.items() if _is_name(item)):
        for k in (1, 2):
            v = re.sub(rf"(?<!\w){p}(?: [^\W\d_]+){{{k}}}(?= )", p, hyp, count=1)
            if v != hyp:
                out.append(v)
    return out


def in_capitals(text: str) -> bool:
    """Whether ``text`` is written in capitals: no lower-case letter and at least two words of
    two or more capitals ("I", "A" or one acronym alone are not).

    >>> in_capitals("A GROUP OF MUSICIANS IS PLAYING."), in_capitals("A dog in NYC.")
    (True, False)
    """
    if any(c.islower() for c in text):
        return False
    return sum(sum(c.isupper() for c in w) >= 2 for w in text.split()) >= 2


def sentence_case(text: str, lang: str | None = None) -> str:
    """``text`` in lower case with each sentence's first letter in capitals (and English
    "I"): how the training captions are written.

    >>> sentence_case("A MAN RUNS. I SEE HIM!", "en")
    'A man runs. I see him!'
    """
    out = re.sub(r"(^|[.!?…]\s+)(\W*)(\w)", lambda m: m[1] + m[2] + m[3].upper(), text.lower())
    if lang == "en":
        out = re.sub(r"\bi\b", "I", out)
    return out


def _model_dir(spec: str | Path) -> Path:
    """A shipped model's name, a model directory, or a run directory holding ``best/``."""
    if isinstance(spec, str) and spec in shipped():
        return shipped_dir(spec)
    path = Path(spec)
    if not path.exists():
        names = ", ".join(shipped()) or "none in this install"
        raise FileNotFoundError(f"--model {spec}: no such directory, and not a shipped model "
                                f"name ({names})")  # fmt: skip
    if not (resolve_dir(path) / "config.json").exists() and (path / "best").exists():
        path = path / "best"
    return resolve_dir(path)


def load_translator(path: str | Path) -> tuple[nn.Module, Tokenizer]:
    """``(model, tokenizer)`` from a shipped model's name or a (run) directory."""
    path = _model_dir(path)
    return load_pretrained(path).float(), Tokenizer.load(path / "tokenizer.json")


@dataclass
class Translator:
    """A translation model with its tokenizer and decoding defaults; call it on text.

    ``tr(text)`` → str, ``tr([texts])`` → list of str (empty lines stay empty). A text longer
    than the model's positions is translated sentence by sentence (or in pieces) and joined,
    with a :class:`UserWarning` saying so: never cut silently.
    """

    model: nn.Module
    tokenizer: Tokenizer
    name: str = ""
    path: Path | None = None
    src: str | None = None
    tgt: str | None = None
    beam: int = 1
    length_penalty: float = 1.0
    cache_dtype: torch.dtype | None = None  # the decoder's self-attention caches (qkv.cache)
    no_repeat_ngram: int = NO_REPEAT_NGRAM  # 0: off (qkv.generate)
    repeat_guard: bool = True  # no pattern 3 times in a row (qkv.generate.RepeatGuard)
    number_placeholders: bool = True  # numbers of 2+ digits, "7", "0" through placeholders
    name_placeholders: bool = True  # names too (qkv.translate_notes.find_names; en, fr)

    @functools.cached_property
    def _split_digits(self) -> str:
        """The digits that take two tokens after a space (" 7": a bare space, then "7")."""
        return "".join(d for d in "0123456789" if len(self.tokenizer.encode(d)) > 1)

    @property
    def max_source_tokens(self) -> int:
        """Source tokens one piece may have (``</s>`` excluded): half the positions, so the
        output (up to ``2·source + 10`` tokens) fits the decoder's positions too."""
        return self.model.cfg.max_len // 2 - 1

    @property
    def card(self) -> str:
        """The model card (``README.md`` of the model directory), or ``""``."""
        p = self.path / "README.md" if self.path else None
        return p.read_text(encoding="utf-8") if p is not None and p.is_file() else ""

    def pieces(self, line: str) -> list[str]:
        """``line`` itself if it fits the model, else its sentences (and word runs of a
        sentence too long alone), each within :attr:`max_source_tokens`."""
        n_tokens = lambda s: len(self.tokenizer.encode(s))  # noqa: E731
        if n_tokens(line) <= self.max_source_tokens:
            return [line]
        return split_to_fit(line, self.max_source_tokens, n_tokens)

    def check(self, text: str) -> list[dict]:
        """Why ``text`` (one line) may be translated badly, without translating it: the notes
        a call gives as warnings, ``[{"code": ...}, ...]`` (``caps``, ``long``, ``pieces``
        from :func:`source_warnings`; ``unseen``, ``numbers``, ``language``, ``question`` from
        :func:`qkv.translate_notes.source_notes`); :func:`warning_text` says each in English.

        >>> [n["code"] for n in load("en-fr").check("Where are the 12 dogs?")]  # doctest: +SKIP
        ['numbers', 'question']
        """
        return self._check(text.strip())[1]

    def _check(self, text: str) -> tuple[str, list[dict]]:
        """``(what is translated, notes)`` for a stripped non-empty line."""
        notes: list[dict] = []
        if in_capitals(text):  # unknown to the model in capitals: translated as a caption
            text = sentence_case(text, self.src)
            notes.append({"code": "caps"})
        notes += source_warnings(self.tokenizer, text)
        pieces = any(n["code"] == "pieces" for n in notes)  # says what "unseen" would say
        notes += [n for n in source_notes(self.tokenizer, text, self.src)
                  if not (pieces and n["code"] == "unseen")]  # fmt: skip
        return text, notes

    def __call__(
        self, text: str | list[str], *, beam: int | None = None,
        length_penalty: float | None = None, progress: bool = False,
    ) -> str | list[str]:  # fmt: skip
        single = isinstance(text, str)
        lines = [text] if single else list(text)
        if not all(isinstance(t, str) for t in lines):
            raise TypeError("text must be a str or a list of str")
        beam = self.beam if beam is None else beam
        lenpen = self.length_penalty if length_penalty is None else length_penalty
        if beam < 1:
            raise ValueError(f"beam must be >= 1, got {beam}")
        limit = self.max_source_tokens
        pieces, owner = [], []  # every non-empty piece, and the line it belongs to
        caps, notes = set(), []  # lines in capitals; (line, note) far from the training data
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            text, found = self._check(line.strip())
            if found and found[0]["code"] == "caps":
                caps.add(i)
            notes += [(i, n) for n in found]
            parts = self.pieces(text)
            if len(parts) > 1:
                warnings.warn(f"line {i + 1} is longer than the model's {limit} source "
                              f"tokens: translated in {len(parts)} pieces", stacklevel=2)  # fmt: skip
            pieces += parts
            owner += [i] * len(parts)
        self._warn(notes, len(lines))
        out = self._translate(pieces, beam, lenpen, progress)
        result = [""] * len(lines)
        for i, hyp in zip(owner, out):
            result[i] = f"{result[i]} {hyp}" if result[i] else hyp
        for i in caps:
            result[i] = result[i].upper()
        return result[0] if single else result

    def protect(self, piece: str) -> tuple[str, dict[str, str]]:
        """``piece`` as it is translated, with placeholders (:func:`protect`: numbers with
        :attr:`number_placeholders`, names with :attr:`name_placeholders`), and what each
        placeholder stands for."""
        names = (find_names(self.tokenizer, piece, self.src, join=True)
                 if self.name_placeholders else [])  # fmt: skip
        text, back = protect(piece, names=names, digits=self._split_digits,
                             numbers=self.number_placeholders,
                             placeholders=PLACEHOLDERS_INTO.get(self.tgt or "", PLACEHOLDERS))  # fmt: skip
        if self.tgt in AND:  # "John and Maria" -> "John et Maria"
            back = {p: re.sub(r"(?<=\s)(?:and|et|und|&)(?=\s)", AND[self.tgt], v, flags=re.I)
                    for p, v in back.items()}  # fmt: skip
        return text, back

    def _translate(self, pieces: list[str], beam: int, lenpen: float, progress: bool) -> list[str]:
        """The pieces' translations; a piece with placeholders (:meth:`protect`) whose
        translation lost or doubled one is searched again (:data:`RETRY_BEAM` wide; the best
        hypothesis that has each placeholder once), and translated as it is if none has."""

        def run(texts: list[str]) -> list[str]:
            return _decode(self.model, self.tokenizer, texts, beam_size=beam,
                           length_penalty=lenpen, progress=progress,
                           cache_dtype=self.cache_dtype, no_repeat_ngram=self.no_repeat_ngram,
                           repeat_guard=self.repeat_guard) if texts else []  # fmt: skip

        if not (self.number_placeholders or self.name_placeholders):
            return run(pieces)
        protected = [self.protect(p) for p in pieces]
        # beam search: lines with placeholders go straight to the n-best search below
        first = [j for j, (_, back) in enumerate(protected) if beam == 1 or not back]
        out = [""] * len(pieces)
        for j, hyp in zip(first, run([protected[j][0] for j in first])):
            out[j] = hyp
        again = []  # searched again: placeholders lost, or names (beam search: any placeholder)
        for j, (hyp, (_, back)) in enumerate(zip(out, protected)):
            if back:
                restored = restore_numbers(hyp, back)
                if restored is None or beam > 1 or any(map(_is_name, back.values())):
                    again.append(j)
                else:
                    out[j] = restored
        wide = self._n_best([protected[j][0] for j in again], max(beam, RETRY_BEAM), lenpen)
        plain = []  # no hypothesis has them all
        for j, hyps in zip(again, wide):
            back = protected[j][1]
            hyps = [out[j]] * (beam == 1) + hyps  # greedy's own hypothesis first
            restored = [r for h in hyps for v in _without_count_words(h, back)
                        if (r := restore_numbers(v, back))]  # fmt: skip
            restored = list(dict.fromkeys(restored))
            if not restored:
                plain.append(j)
            else:  # the one the model likes best as a translation of the line as it is
                scores = self._scores(pieces[j], restored, lenpen) if len(restored) > 1 else [0]
                out[j] = restored[max(range(len(restored)), key=scores.__getitem__)]
        for j, hyp in zip(plain, run([pieces[j] for j in plain])):
            out[j] = hyp
        if self.number_placeholders:
            out = [unglue_digits(hyp, p) for hyp, p in zip(out, pieces)]
        return out

    @torch.inference_mode()
    def _scores(self, source: str, hyps: list[str], lenpen: float) -> list[float]:
        """``log p(hyp | source) / len ** lenpen`` of each hypothesis (teacher forcing): with
        the placeholders put back, "John et Maria promènent leur chien" scores above "John et
        Maria personnes promènent leur chien" (a digit read as a count)."""
        tok, dev = self.tokenizer, next(self.model.parameters()).device
        ids = [[tok.bos_id] + tok.encode(h) + [tok.eos_id] for h in hyps]
        T = max(map(len, ids))
        tgt = torch.full((len(ids), T), self.model.cfg.pad_id, dtype=torch.long, device=dev)
        for i, row in enumerate(ids):
            tgt[i, : len(row)] = torch.tensor(row)
        src = torch.tensor([tok.encode(source) + [tok.eos_id]], device=dev)  # (1, S)
        with _evaluating(self.model):
            mask = self.model.src_mask(src)  # (1, 1, 1, S)
            memory = self.model.encode(src, mask)  # (1, S, d_model): once for every hypothesis
            N = len(ids)
            logits = self.model.decode(tgt[:, :-1], memory.expand(N, -1, -1),
                                       mask.expand(N, -1, -1, -1))  # (N, T-1, V)  # fmt: skip
        logp = logits.float().log_softmax(-1)
        picked = logp.gather(-1, tgt[:, 1:, None])[..., 0]  # (N, T-1)
        real = tgt[:, 1:] != self.model.cfg.pad_id
        sums = (picked * real).sum(1)
        return (sums / real.sum(1).float() ** lenpen).tolist()

    @torch.inference_mode()
    def _n_best(
        self, texts: list[str], beam: int, lenpen: float, batch: int = 16
    ) -> list[list[str]]:
        """Each text's ``beam`` best translations (beam search), best first, in batches of
        ``batch`` (only lines with names, or whose placeholders got lost, come here)."""
        tok, dev = self.tokenizer, next(self.model.parameters()).device
        guard = RepeatGuard.for_tokenizer(tok) if texts and self.repeat_guard else None
        out = []
        with _evaluating(self.model):
            for at in range(0, len(texts), batch):
                ids = [tok.encode(t) + [tok.eos_id] for t in texts[at : at + batch]]
                src = torch.full((len(ids), max(map(len, ids))), self.model.cfg.pad_id,
                                 dtype=torch.long, device=dev)  # (B, S)  # fmt: skip
                for i, row in enumerate(ids):
                    src[i, : len(row)] = torch.tensor(row)
                res = beam_search(self.model, src, beam_size=beam, n_best=beam,
                                  length_penalty=lenpen, cache_dtype=self.cache_dtype,
                                  no_repeat_ngram=self.no_repeat_ngram,
                                  repeat_guard=guard)  # fmt: skip
                hyps = res[0] if isinstance(res, tuple) else res[:, None]  # (B, beam, T)
                out += [[tok.decode(row.tolist()) for row in rows] for rows in hyps]
        return out

    @staticmethod
    def _warn(notes: list[tuple[int, dict]], n_lines: int, most: int = 5) -> None:
        """One UserWarning per line with notes, its notes' sentences joined ("line 3: ..."
        when there are several lines), for ``most`` lines at most, then how many more: a long
        file gets a few lines on stderr, not thousands."""
        by_line: dict[int, list[str]] = {}
        for i, w in notes:
            by_line.setdefault(i, []).append(warning_text(w))
        for i, texts in list(by_line.items())[:most]:
            text = " ".join(texts)
            warnings.warn(f"line {i + 1}: {text}" if n_lines > 1 else text, stacklevel=3)
        if len(by_line) > most:
            rest = list(by_line.values())[most:]
            warnings.warn(f"{sum(map(len, rest))} more such notes on {len(rest)} more line(s)",
                          stacklevel=3)  # fmt: skip


def load(spec: str | Path = DEFAULT, *, int8: bool = False) -> Translator:
    """A :class:`Translator` for a shipped model's name (``"en-fr"``, ``"fr-en"``) or a model
    (or ``qkv train`` run) directory. Nothing is downloaded: shipped models are in the package.

    ``int8=True``: every linear layer in int8 (:func:`qkv.kernels.int8.quantize_linears`:
    weights per output channel, inputs per row, exact int32 sums) — faster on CPUs, BLEU of
    the shipped models within 0.1 of float.
    """
    path = _model_dir(spec)
    model, tok = load_translator(path)
    if int8:
        from qkv.kernels.int8 import quantize_linears

        model = quantize_linears(model)
    gen = read_json(path / GENERATION_FILE) if (path / GENERATION_FILE).is_file() else {}
    name = spec if isinstance(spec, str) and spec in shipped() else str(path)
    return Translator(model, tok, name=name, path=path, src=gen.get("src"), tgt=gen.get("tgt"),
                      beam=int(gen.get("beam", 1)),
                      length_penalty=float(gen.get("length_penalty", 1.0)),
                      no_repeat_ngram=int(gen.get("no_repeat_ngram", NO_REPEAT_NGRAM)),
                      repeat_guard=bool(gen.get("repeat_guard", True)),
                      number_placeholders=bool(gen.get("number_placeholders", True)),
                      name_placeholders=bool(gen.get("name_placeholders", True)))  # fmt: skip
