"""Translation models that ship inside qkv, by name: ``en-fr`` and ``fr-en``.

Each is a :func:`~qkv.models.save_pretrained` directory beside this file (``config.json``,
``model.safetensors`` in float16 or as int8 rows (:mod:`qkv.models.int8_rows`),
``tokenizer.json``) with a model card (``README.md``: the
command that trained it, the data, the commit, the time, the machine and its scores).

>>> sorted(shipped())  # doctest: +SKIP
['en-fr', 'fr-en']
>>> shipped_dir("en-fr")  # doctest: +SKIP
PosixPath('.../qkv/models/shipped/en-fr')
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["HERE", "shipped", "shipped_dir", "DEFAULT"]

HERE = Path(__file__).resolve().parent
DEFAULT = "en-fr"  # the notes' pair: `qkv translate` with no --model


def shipped() -> dict[str, Path]:
    """``{name: directory}`` of every shipped model present in this install."""
    return {
        p.name: p for p in sorted(HERE.iterdir())
        if p.is_dir() and (p / "config.json").is_file() and (p / "model.safetensors").is_file()
    }  # fmt: skip


def shipped_dir(name: str) -> Path:
    """The directory of the shipped model ``name``; ``ValueError`` naming the choices if none."""
    models = shipped()
    if name not in models:
        have = ", ".join(models) or "none in this install"
        raise ValueError(f"no shipped model named {name!r} (shipped: {have})")
    return models[name]
