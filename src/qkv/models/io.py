"""Save and load a model directory: ``config.json`` + ``model.safetensors`` (+ ``tokenizer.json``).

Writes go to a temporary sibling directory that is renamed into place, so a crash never
leaves a half-written model; loading reads JSON and safetensors only (nothing is unpickled).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import save_model
from torch import nn

from qkv.loading import (
    ModelLoadError,
    build_config,
    load_safetensors_into,
    read_json,
    validate_safetensors,
)
from qkv.models.causal_lm import CausalLM
from qkv.models.config import TransformerConfig
from qkv.models.int8_rows import INT8_ROWS, STORAGE_KEY, load_int8_rows, save_int8_rows
from qkv.models.seq2seq import Seq2SeqTransformer

__all__ = ["save_pretrained", "load_pretrained", "atomic_dir", "replace_dir"]

KINDS = {"seq2seq": Seq2SeqTransformer, "causal_lm": CausalLM}


def atomic_dir(target: str | Path) -> Path:
    """A fresh temporary directory next to ``target`` (same filesystem, so rename is atomic)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))


def replace_dir(tmp: Path, target: str | Path) -> None:
    """Move the finished ``tmp`` onto ``target``: old → ``.old``, tmp → target, drop old.

    At every instant either ``target`` or ``target.old`` is a complete directory;
    :func:`resolve_dir` falls back to ``.old`` when a crash hit between the two renames.
    """
    target = Path(target)
    for f in tmp.iterdir():  # flush file contents before the rename makes them visible
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    old = target.with_name(target.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    if old.exists():
        shutil.rmtree(old)


def resolve_dir(path: str | Path) -> Path:
    """``path``, or its ``.old`` sibling if a save was interrupted between renames."""
    path = Path(path)
    old = path.with_name(path.name + ".old")
    if not path.exists() and old.exists():
        return old
    return path


def save_pretrained(
    model: nn.Module, directory: str | Path, *, tokenizer=None, extra: dict | None = None,
    storage: str = "as-is",
) -> Path:  # fmt: skip
    """Write ``model`` (a Seq2SeqTransformer or CausalLM) and its tokenizer atomically.

    ``extra`` files: ``{name: writer(path)}`` callables adding more files (training state).
    ``storage``: ``"as-is"`` (the tensors' own dtypes) or ``"int8-rows"`` (weight matrices as
    int8 rows with a scale each: :mod:`qkv.models.int8_rows`).
    """
    kind = {cls: name for name, cls in KINDS.items()}.get(type(model))
    if kind is None:
        raise TypeError(f"model must be one of {list(KINDS)}, got {type(model).__name__}")
    if storage not in ("as-is", INT8_ROWS):
        raise ValueError(f"storage must be 'as-is' or {INT8_ROWS!r}, got {storage!r}")
    tmp = atomic_dir(directory)
    try:
        meta = {"kind": kind, "config": json.loads(model.cfg.to_json())}
        (tmp / "config.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        if storage == INT8_ROWS:
            save_int8_rows(model, tmp / "model.safetensors")
        else:
            save_model(model, str(tmp / "model.safetensors"))
        if tokenizer is not None:
            tokenizer.save(tmp / "tokenizer.json")
        for name, writer in (extra or {}).items():
            writer(tmp / name)
        replace_dir(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Path(directory)


def load_config(directory: str | Path) -> tuple[str, TransformerConfig]:
    """``(kind, config)`` from ``directory/config.json``; a bad file is a
    :class:`~qkv.loading.ModelLoadError`."""
    directory = resolve_dir(directory)
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no model here: {path} is missing")
    meta = read_json(path, what="model config")
    if meta.get("kind") not in KINDS:
        raise ModelLoadError(
            path, f"kind must be one of {list(KINDS)}, got {meta.get('kind')!r:.40}"
        )
    return meta["kind"], build_config(path, TransformerConfig, meta.get("config"))


def load_pretrained(directory: str | Path, *, map_location: str = "cpu") -> nn.Module:
    """Rebuild the model saved by :func:`save_pretrained` (eval mode). Never unpickles.

    Raises ``FileNotFoundError`` for a missing file and :class:`~qkv.loading.ModelLoadError`
    (a ``ValueError``) for one that cannot be used.
    """
    directory = resolve_dir(directory)
    kind, cfg = load_config(directory)
    model = KINDS[kind](cfg)
    weights = directory / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"no weights here: {weights} is missing")
    meta = validate_safetensors(weights).get("__metadata__")
    if isinstance(meta, dict) and meta.get(STORAGE_KEY) == INT8_ROWS:
        load_int8_rows(model, weights, device=map_location)
    else:
        load_safetensors_into(model, weights, device=map_location)
    return model.eval()
