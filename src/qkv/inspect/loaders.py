"""Models the inspection commands can open: ``--model random | minilm | DIR``.

A loader returns a :class:`Loaded`: the model, a function from text to (tokens, inputs),
and optionally a translator that records attention at every decoding step. Trained models
(MiniLM in ``qkv.pretrained``, the translation transformer in ``qkv.models``) plug in with
:func:`register` (a name such as ``"minilm"``) or :func:`register_dir` (a saved directory).
``minilm``, HuggingFace BERT directories (:mod:`qkv.inspect.minilm`), saved
:mod:`qkv.models` directories (:mod:`qkv.inspect.translation`) and any other local
transformers model directory (:mod:`qkv.inspect.hf_models`, tried last) are built in,
imported on first use.

>>> loaded = load("random")
>>> tokens, inputs = loaded.encode("The boy trains the puppy.")
>>> loaded.model(*inputs).shape
torch.Size([1, 8, 32])
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from qkv.capture.maps import AttentionMaps
from qkv.capture.record import recording
from qkv.inspect.loaded import Loaded
from qkv.inspect.tiny import TinyEncoder, TinySeq2Seq, simple_tokenize, token_id

__all__ = ["LOADERS", "Loaded", "load", "register", "register_dir"]


def _random() -> Loaded:
    enc = TinyEncoder()
    s2s = TinySeq2Seq()

    def translate(text: str) -> list[AttentionMaps]:
        src_tokens = ["<s>", *simple_tokenize(text), "</s>"]
        src = torch.tensor([[token_id(t, s2s.vocab_size) for t in src_tokens]])  # (1, T_src)
        with torch.no_grad(), recording(s2s) as rec:
            out = s2s.greedy(src, max_len=min(2 * len(src_tokens), 24))  # (1, T_tgt)
        tgt_tokens = ["<s>"] + [f"#{i}" for i in out[0, 1:].tolist()]  # random ids, no vocab
        return rec.steps(tokens=tgt_tokens, source_tokens=src_tokens)

    def encode(text: str) -> tuple[list[str], tuple]:
        tokens, ids = enc.tokenize(text)
        return tokens, (ids,)

    return Loaded(enc, encode, translate=translate, name="random")


def _minilm() -> Loaded:
    from qkv.inspect.minilm import load_minilm  # lazy: reads weights and the tokenizer

    return load_minilm()


def _bert_dir(path: Path) -> Loaded | None:
    from qkv.inspect.minilm import load_bert_dir

    return load_bert_dir(path)


def _qkv_dir(path: Path) -> Loaded | None:
    from qkv.inspect.translation import load_model_dir

    return load_model_dir(path)


def _hf_dir(path: Path) -> Loaded | None:
    from qkv.inspect.hf_models import load_hf_dir

    return load_hf_dir(path)


LOADERS: dict[str, Callable[[], Loaded]] = {"random": _random, "minilm": _minilm}
DIR_LOADERS: list[Callable[[Path], Loaded | None]] = [_bert_dir, _qkv_dir, _hf_dir]


def register(name: str, loader: Callable[[], Loaded]) -> None:
    """Make ``--model NAME`` open ``loader()``."""
    LOADERS[name] = loader


def register_dir(loader: Callable[[Path], Loaded | None]) -> None:
    """Try ``loader(path)`` for ``--model DIR``; it returns ``None`` for a directory not its own."""
    DIR_LOADERS.append(loader)


def load(spec: str) -> Loaded:
    """Open ``spec``: a registered name (``random``, ``minilm``), a shipped translator
    (``en-fr``, ``fr-en``) or a saved model directory."""
    from qkv.models.shipped import shipped

    if spec in LOADERS:
        return LOADERS[spec]()
    path = shipped().get(spec, Path(spec))
    if path.is_dir():
        for loader in DIR_LOADERS:
            loaded = loader(path)
            if loaded is not None:
                return loaded
        raise ValueError(f"no loader recognises the directory {spec!r} (registered: "
                         f"{len(DIR_LOADERS)} directory loaders)")  # fmt: skip
    names = sorted(LOADERS) + sorted(shipped())
    raise ValueError(f"--model must be one of {names} or a directory, got {spec!r}")
