"""A joint BPE tokenizer (HuggingFace ``tokenizers``), byte-level so any Unicode round-trips.

NFC normalisation, a space in front (so a sentence's first word is tokenised like any
other), then byte-level pre-tokenisation: every string (Myanmar, Bengali,
Vietnamese, Chinese, emoji) maps to known tokens, never ``<unk>``, and decodes back exactly
(up to NFC). Special ids: ``<pad>=0, <s>=1, </s>=2, <unk>=3``.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from qkv.atomic import atomic_path
from qkv.loading import ModelLoadError, read_tokenizer

__all__ = ["Tokenizer", "SPECIALS"]

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
PAD, BOS, EOS, UNK = range(4)


class Tokenizer:
    """Text ↔ ids. ``encode`` adds no specials; the model adds ``<s>``/``</s>`` itself.

    >>> tok = Tokenizer.train(["le chat", "the cat"], vocab_size=300)
    >>> tok.decode(tok.encode("the chat"))
    'the chat'
    """

    pad_id, bos_id, eos_id, unk_id = PAD, BOS, EOS, UNK

    def __init__(self, hf: HFTokenizer) -> None:
        for i, name in enumerate(SPECIALS):
            if hf.token_to_id(name) != i:
                raise ValueError(f"tokenizer must map {name} to id {i}, got {hf.token_to_id(name)}")
        self.hf = hf

    @classmethod
    def train(cls, texts: Iterable[str], *, vocab_size: int = 8000, min_frequency: int = 2):
        """Learn a BPE vocabulary of at most ``vocab_size`` tokens from ``texts``."""
        if vocab_size < len(SPECIALS) + 256:
            raise ValueError(f"vocab_size must be >= {len(SPECIALS) + 256} (specials + bytes)")
        hf = HFTokenizer(models.BPE(unk_token="<unk>"))
        hf.normalizer = normalizers.NFC()
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator((" " + t for t in texts), trainer=trainer)
        return cls(hf)

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Read ``tokenizer.json`` (or ``DIR/tokenizer.json``); a bad file is a
        :class:`~qkv.loading.ModelLoadError`."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer here: {path} is missing")
        hf = read_tokenizer(path)
        try:
            return cls(hf)
        except ValueError as e:
            raise ModelLoadError(path, str(e)) from None

    def save(self, path: str | Path) -> None:
        """Write ``tokenizer.json`` atomically (temp file, then rename)."""
        with atomic_path(path) as tmp:
            self.hf.save(str(tmp))

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        return self.hf.encode(" " + text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        texts = [" " + t for t in texts]  # every word, the first too, starts with a space
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Ids → text; stops at the first ``</s>``, drops ``<pad>``/``<s>``."""
        out = []
        for i in ids:
            i = int(i)
            if i == EOS:
                break
            if i not in (PAD, BOS):
                out.append(i)
        text = self.hf.decode(out, skip_special_tokens=True)
        return text[1:] if text.startswith(" ") else text  # the space encode() put in front

    def decode_batch(self, batch: Iterable[Iterable[int]]) -> list[str]:
        return [self.decode(ids) for ids in batch]


def normalize(text: str) -> str:
    """What :meth:`Tokenizer.decode` gives back for ``text``: its NFC form."""
    return unicodedata.normalize("NFC", text)
