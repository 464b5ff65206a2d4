"""The models ``qkv serve`` offers: named once, loaded lazily on first use, shared by requests.

A :class:`Registry` maps a short name (``"minilm"``, ``"random"``, ``"en-fr"``…) to a
loader returning a :class:`~qkv.inspect.loaders.Loaded`. Loading happens once, under a lock;
every forward pass of a model runs under that model's own lock, because switching heads off
(``head_mask``) and recording (``recorder``) set attributes on shared modules.

Adding a shipped translator is one line in :data:`SHIPPED_TRANSLATORS`; a directory saved by
:func:`qkv.models.save_pretrained` (or a local transformers model directory) is added with
``qkv serve --model NAME=DIR``.

>>> reg = default_registry()
>>> [m["name"] for m in reg.info()][:2]
['minilm', 'random']
>>> entry = reg.get("random")       # loads it (tiny, random weights)
>>> entry.loaded.model.__class__.__name__
'TinyEncoder'
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from qkv.inspect.loaders import Loaded

__all__ = [
    "SHIPPED_TRANSLATORS",
    "Entry",
    "Registry",
    "UnknownModel",
    "default_registry",
    "entry_for",
]

# Where a directory's tokenizer may be: a qkv model has tokenizer.json; BERT (qkv.pretrained)
# tokenizer.json or vocab.txt; a transformers model any file AutoTokenizer reads
# (qkv.hf.load_model looks for these).
_TOKENIZER_FILES = {
    "qkv": ("tokenizer.json",),
    "bert": ("tokenizer.json", "vocab.txt"),
    "transformers": ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "spiece.model",
                     "source.spm"),
}  # fmt: skip

# name -> the argument of ``qkv.translate.load`` (offered only when that function exists and
# finds the model). One line per shipped translator.
SHIPPED_TRANSLATORS: dict[str, str] = {"en-fr": "en-fr", "fr-en": "fr-en"}


class UnknownModel(KeyError):
    """A model name the registry does not know."""


@dataclass
class Entry:
    """One model the server offers. ``loaded`` and ``lock`` are set on first :meth:`get`."""

    name: str
    label: str
    loader: Callable[[], Loaded]
    translator: bool = False  # decodes (seq2seq): the Translation view applies
    random: bool = False  # random weights: the maps show mechanics, not language
    label_key: str = ""  # the label's key in static/i18n/strings.json ({name}: the name)
    loaded: Loaded | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # around every forward

    def info(self) -> dict:
        return {"name": self.name, "label": self.label, "label_key": self.label_key,
                "translator": self.translator, "random": self.random,
                "loaded": self.loaded is not None}  # fmt: skip


class Registry:
    """Named models, loaded once and shared (thread-safe)."""

    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}
        self._load_lock = threading.Lock()

    def add(self, name: str, loader: Callable[[], Loaded], label: str = "", *,
            translator: bool = False, random: bool = False, label_key: str = "") -> None:  # fmt: skip
        """Offer ``loader()`` under ``name`` (replacing an earlier entry of that name)."""
        if not name or not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise ValueError(f"model name must be letters, digits, '-', '_' or '.', got {name!r}")
        self._entries[name] = Entry(name, label or name, loader, translator, random, label_key)

    def add_dir(self, name: str, path: str | Path) -> None:
        """Offer a saved model directory (a qkv translation model, BERT, or any transformers
        model directory) under ``name``.

        The model loads on first use, but what every request needs is checked now (a
        ``ValueError``, which ``qkv serve`` reports as one line, exit 2): a ``config.json`` and
        a tokenizer. Without them the server would start and answer every request with an
        error.
        """
        from qkv.inspect.loaders import load

        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"--model {name}=DIR: no such directory: {path}")
        from qkv.models.io import resolve_dir

        config = resolve_dir(path) / "config.json"
        if not config.is_file() and (path / "best" / "config.json").is_file():
            config = path / "best" / "config.json"
        try:
            meta = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"--model {name}=DIR: cannot read {config}: {err}") from None
        _check_tokenizer(name, path, config, meta)
        translator = isinstance(meta, dict) and (meta.get("kind") == "seq2seq"
                                                 or meta.get("is_encoder_decoder") is True)  # fmt: skip
        if isinstance(meta, dict) and meta.get("kind") == "seq2seq":  # decoded as qkv translate does
            loader = lambda: _translator(path, str(path))  # noqa: E731
        else:
            loader = lambda: load(str(path))  # noqa: E731
        self.add(name, loader, f"{name} ({path.name})", translator=translator)

    def names(self) -> list[str]:
        return list(self._entries)

    def info(self) -> list[dict]:
        return [e.info() for e in self._entries.values()]

    def get(self, name: str) -> Entry:
        """The entry for ``name``, loading its model on first use."""
        entry = self._entries.get(name)
        if entry is None:
            raise UnknownModel(f"model must be one of {self.names()}, got {name!r}")
        if entry.loaded is None:
            with self._load_lock:
                if entry.loaded is None:
                    loaded = entry.loader()
                    for m in {id(x): x for x in (loaded.model, loaded.full_model) if x}.values():
                        m.eval()
                    entry.loaded = loaded
        return entry


def _check_tokenizer(name: str, path: Path, config: Path, meta: object) -> None:
    """Refuse a model directory that no loader can read text with (no config, no tokenizer)."""
    if not config.is_file():
        raise ValueError(f"--model {name}={path}: not a model directory (no config.json)")
    from qkv.models.io import KINDS

    meta = meta if isinstance(meta, dict) else {}
    kind = ("qkv" if meta.get("kind") in KINDS
            else "bert" if meta.get("model_type") == "bert" else "transformers")  # fmt: skip
    wanted = _TOKENIZER_FILES[kind]
    if not any((config.parent / f).is_file() for f in wanted):
        raise ValueError(f"--model {name}={path}: no tokenizer in {config.parent} (looked for "
                         f"{' or '.join(wanted)}); the explorer needs one to read text")  # fmt: skip


def _random() -> Loaded:
    """The tiny random models (encoder + seq2seq) with the seq2seq as ``full_model``."""
    from qkv.inspect.loaders import load
    from qkv.inspect.tiny import TinySeq2Seq

    loaded = load("random")
    s2s = TinySeq2Seq()
    loaded.full_model = s2s  # the translation path (qkv.apps.serve.compute) decodes with it
    return loaded


def _minilm() -> Loaded:
    from qkv.inspect.loaders import load

    return load("minilm")


def _translator(spec: str | Path, name: str) -> Loaded:
    """A qkv translator as ``qkv.translate.load`` reads it, its :class:`~qkv.translate.Translator`
    kept (``Loaded.translator``): the explorer decodes and notes as ``qkv translate`` does
    (:mod:`qkv.apps.serve.decoding`)."""
    from qkv.inspect.translation import loaded_from_seq2seq
    from qkv.translate import load

    tr = load(spec)
    loaded = loaded_from_seq2seq(tr.model, tr.tokenizer, name)
    loaded.translator = tr
    return loaded


def _shipped(name: str) -> Callable[[], Loaded] | None:
    """A loader for a shipped translator, or ``None`` when this install has none of that name."""
    from qkv.models.shipped import shipped

    if SHIPPED_TRANSLATORS[name] not in shipped():
        return None
    return lambda: _translator(SHIPPED_TRANSLATORS[name], name)


def default_registry(dirs: dict[str, str] | None = None) -> Registry:
    """MiniLM, the random tiny model, shipped translators, and ``dirs`` (``{name: directory}``)."""
    reg = Registry()
    reg.add("minilm", _minilm, "all-MiniLM-L6-v2 (6 layers × 12 heads)", label_key="model.minilm")
    reg.add("random", _random, "tiny model, RANDOM weights (mechanics only)", translator=True,
            random=True, label_key="model.random")  # fmt: skip
    for name in SHIPPED_TRANSLATORS:
        loader = _shipped(name)
        if loader is not None:
            reg.add(name, loader, f"translator {name}", translator=True,
                    label_key="model.translator")  # fmt: skip
    for name, path in (dirs or {}).items():
        reg.add_dir(name, path)
    return reg


def entry_for(spec: str) -> Entry:
    """An entry for ``spec``: a name :func:`default_registry` offers, any name registered with
    :func:`qkv.inspect.loaders.register`, or a saved model directory (loaded now)."""
    reg = default_registry()
    if spec in reg.names():
        return reg.get(spec)
    from qkv.inspect.loaders import load

    loaded = load(spec)
    s2s = loaded.translate is not None and loaded.full_model is not None
    entry = Entry(Path(spec).name or spec, spec, lambda: loaded, translator=s2s)
    entry.loaded = loaded
    return entry
