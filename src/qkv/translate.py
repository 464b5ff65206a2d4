"""Translation with a trained model, by name or directory (the command line: :mod:`qkv.apps.translate`).

qkv ships two models trained on Multi30k with ``qkv train`` (``en-fr``, the default, and
``fr-en``); any ``qkv train`` run directory works too. Multi30k is 29,000 English image
captions (at most ~40 words, most under 20) with their French: the models translate short
descriptive sentences, not long or technical text. A :class:`Translator` knows its limits:

* it never writes a 4-gram of tokens twice (``no_repeat_ngram``), so a sentence it cannot
  handle ends instead of looping to the length limit (``2·source + 10`` tokens);
* it never writes a pattern of 1–4 tokens, or of 1–4 letters inside a word, three times in a
  row (``repeat_guard``, :class:`qkv.generate.RepeatGuard`): no "Oestestest", "Migigigiga";
* a number of two digits or more is translated as a one-digit placeholder, then put back
  (``number_placeholders``): the models copy "42" or "1965" badly, a single digit well;
  where the placeholders do not come back one for one, the plain translation is kept;
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

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from qkv.data import Tokenizer
from qkv.generate import translate as _decode
from qkv.limits import split_sentences, split_to_fit
from qkv.loading import read_json
from qkv.models import load_pretrained
from qkv.models.io import resolve_dir
from qkv.models.shipped import DEFAULT, shipped, shipped_dir
from qkv.translate_notes import note_text, source_notes

__all__ = [
    "NO_REPEAT_NGRAM",
    "Translator",
    "in_capitals",
    "load",
    "load_translator",
    "protect_numbers",
    "restore_numbers",
    "sentence_case",
    "source_warnings",
    "warning_text",
]

# {"src", "tgt", "beam", "length_penalty", optional "no_repeat_ngram", "repeat_guard",
# "number_placeholders"}: decoding defaults
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
# single digits too cost BLEU (en-fr 67.92: "4 personnes" where captions say "Quatre").
NUMBER = re.compile(r"(?<![^\W\d_])\d+(?:[.,:]\d+)*")
PLACEHOLDERS = ("5", "3", "4", "6", "9", "8", "2")  # one token each; "1" would be singular


def protect_numbers(text: str) -> tuple[str, dict[str, str]]:
    """``text`` with each number of two digits or more replaced by a one-digit placeholder
    that is not a number of ``text`` already, and ``{placeholder: number}`` (empty: nothing
    replaced; numbers beyond the 7 placeholders stay as they are).

    >>> protect_numbers("A runner with number 42 passes 3 people.")
    ('A runner with number 5 passes 3 people.', {'5': '42'})
    """
    numbers = {m[0] for m in NUMBER.finditer(text)}
    free = [p for p in PLACEHOLDERS if p not in numbers]
    given: dict[str, str] = {}  # number -> placeholder

    def replace(m: re.Match) -> str:
        if sum(c.isdigit() for c in m[0]) < 2:
            return m[0]
        if m[0] not in given and len(given) < len(free):
            given[m[0]] = free[len(given)]
        return given.get(m[0], m[0])

    return NUMBER.sub(replace, text), {p: n for n, p in given.items()}


def restore_numbers(text: str, back: dict[str, str]) -> str | None:
    """``text`` with each placeholder of :func:`protect_numbers` put back, or ``None`` when
    the placeholders are not all there exactly once (the translation lost or doubled one).

    >>> restore_numbers("Un coureur portant le numéro 5 dépasse 3 personnes.", {"5": "42"})
    'Un coureur portant le numéro 42 dépasse 3 personnes.'
    """
    found = [m[0] for m in NUMBER.finditer(text) if m[0] in back]
    if sorted(found) != sorted(back):
        return None
    return NUMBER.sub(lambda m: back.get(m[0], m[0]), text)


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
    number_placeholders: bool = True  # numbers of 2+ digits through placeholders (below)

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

    def _translate(self, pieces: list[str], beam: int, lenpen: float, progress: bool) -> list[str]:
        """The pieces' translations; with :attr:`number_placeholders`, a piece with numbers of
        two digits or more is translated with placeholders, and again as it is where they do
        not all come back."""

        def run(texts: list[str]) -> list[str]:
            return _decode(self.model, self.tokenizer, texts, beam_size=beam,
                           length_penalty=lenpen, progress=progress,
                           cache_dtype=self.cache_dtype, no_repeat_ngram=self.no_repeat_ngram,
                           repeat_guard=self.repeat_guard) if texts else []  # fmt: skip

        if not self.number_placeholders:
            return run(pieces)
        protected = [protect_numbers(p) for p in pieces]
        out = run([p for p, _ in protected])
        again = []  # pieces whose placeholders did not come back one for one
        for j, (hyp, (_, back)) in enumerate(zip(out, protected)):
            if back:
                restored = restore_numbers(hyp, back)
                if restored is None:
                    again.append(j)
                else:
                    out[j] = restored
        for j, hyp in zip(again, run([pieces[j] for j in again])):
            out[j] = hyp
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
                      number_placeholders=bool(gen.get("number_placeholders", True)))  # fmt: skip
