"""Every model file qkv reads goes through here: one error type for every bad file.

A model directory holds up to four kinds of file; each has one reader:

    config.json                      read_json(path)            must be a JSON object
                                     check_fields(path, data, spec)   types of its fields
                                     build_config(path, cls, data)    a config dataclass
    model.safetensors                read_safetensors(path)     header checked before reading
                                     load_safetensors_into(model, path)
    model.safetensors.index.json     read_sharded(directory)    shards must stay inside it
    tokenizer.json                   read_tokenizer(path)       HuggingFace ``tokenizers``
    pytorch_model.bin                read_torch_weights(path)   ``weights_only=True``

A file that is there but cannot be used (truncated, random bytes, JSON of the wrong shape, a
field of the wrong type, a shard path leaving the directory) raises :class:`ModelLoadError`,
a ``ValueError`` whose message names the file and what is wrong. A missing file stays a
``FileNotFoundError``. Nothing is ever unpickled.

>>> read_json("config.json")                          # doctest: +SKIP
ModelLoadError: config.json: must be a JSON object, got a list
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

__all__ = [
    "ModelLoadError",
    "build_config",
    "check_fields",
    "inside",
    "load_safetensors_into",
    "read_hf_tokenizer",
    "read_json",
    "read_safetensors",
    "read_sharded",
    "read_tokenizer",
    "read_torch_weights",
    "validate_safetensors",
]

MAX_JSON_BYTES = 512 * 2**20  # tokenizer.json of large vocabularies is tens of MB
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
                "F64": 8}  # fmt: skip


class ModelLoadError(ValueError):
    """A model file exists but cannot be used. ``path``: the file; ``problem``: what is wrong."""

    def __init__(self, path: str | os.PathLike, problem: str) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


def _need_file(path: Path, what: str) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"no {what} here: {path} is missing")


def inside(directory: str | os.PathLike, name: str) -> Path:
    """``directory / name``, required to stay inside ``directory`` (no ``..``, no absolute path,
    no symlink leading out)."""
    directory = Path(directory)
    if not isinstance(name, str) or not name:
        raise ModelLoadError(directory, f"file name must be a non-empty string, got {name!r}")
    if os.path.isabs(name) or ".." in Path(name).parts or "\\" in name:
        raise ModelLoadError(directory, f"file {name!r} lies outside the model directory")
    path = directory / name
    root = directory.resolve()
    if not path.resolve().is_relative_to(root):
        raise ModelLoadError(directory, f"file {name!r} lies outside the model directory")
    return path


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(value),
                                                                        type(value).__name__)  # fmt: skip


def read_json(path: str | os.PathLike, *, what: str = "JSON file") -> dict[str, Any]:
    """The JSON object in ``path``; anything else (bad UTF-8, bad JSON, a list…) is a
    :class:`ModelLoadError`."""
    path = Path(path)
    _need_file(path, what)
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ModelLoadError(path, f"{size} bytes is too large for a {what}")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ModelLoadError(path, f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(path, f"not valid JSON ({e.msg}, line {e.lineno})") from None
    except RecursionError:
        raise ModelLoadError(path, "JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise ModelLoadError(path, f"must be a JSON object, got {_type_name(data)}")
    return data


def _is(value: Any, kind: str) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value))  # fmt: skip
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "None":
        return value is None
    raise ValueError(f"unknown field kind {kind!r}")


def check_fields(
    path: str | os.PathLike,
    data: Mapping[str, Any],
    spec: Mapping[str, str],
    *,
    required: tuple[str, ...] = (),
    positive: tuple[str, ...] = (),
    where: str = "",
) -> None:
    """Check ``data[key]`` against ``spec[key]`` (``"int"``, ``"float"``, ``"bool"``, ``"str"``,
    or alternatives such as ``"int | None"``) for every key present; ``required`` keys must be
    there, ``positive`` ones > 0. Keys not in ``spec`` are left alone."""
    where = f"{where}." if where else ""
    for key in required:
        if key not in data:
            raise ModelLoadError(path, f"missing key {where}{key!r}")
    for key, kinds in spec.items():
        if key not in data:
            continue
        value = data[key]
        options = [k.strip() for k in kinds.split("|")]
        if not any(_is(value, k) for k in options):
            raise ModelLoadError(path, f"{where}{key} must be {' or '.join(options)}, got "
                                       f"{_type_name(value)} {value!r:.40}")  # fmt: skip
        if key in positive and value is not None and not value > 0:
            raise ModelLoadError(path, f"{where}{key} must be > 0, got {value!r}")


def build_config(path: str | os.PathLike, cls: type, data: Any, *, where: str = "config"):
    """``cls(**data)`` for a config dataclass, with every field's type checked first (from its
    annotation: ``int``, ``float``, ``bool``, ``str``, ``X | None``); unknown or missing fields
    and the class's own checks become a :class:`ModelLoadError`."""
    if not isinstance(data, dict):
        raise ModelLoadError(path, f"{where} must be a JSON object, got {_type_name(data)}")
    fs = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(fs))
    if unknown:
        raise ModelLoadError(path, f"unknown {where} fields {unknown[:10]}")
    required = tuple(n for n, f in fs.items()
                     if f.default is MISSING and f.default_factory is MISSING)  # fmt: skip
    check_fields(path, data, {n: str(f.type) for n, f in fs.items()}, required=required,
                 where=where)  # fmt: skip
    try:
        return cls(**data)
    except (ValueError, TypeError, ZeroDivisionError) as e:
        raise ModelLoadError(path, f"{where}: {e}") from None


def validate_safetensors(path: str | os.PathLike) -> dict[str, Any]:
    """Check a safetensors file's header against its size without reading the tensors.

    Returns the header (tensor name → ``{dtype, shape, data_offsets}``).
    """
    path = Path(path)
    _need_file(path, "weights")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelLoadError(path, f"truncated: {size} bytes, not a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise ModelLoadError(path, f"not a safetensors file, or truncated (header of {n} "
                                       f"bytes in a file of {size})")  # fmt: skip
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise ModelLoadError(path, "not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ModelLoadError(path, "not a safetensors file (its header is not a JSON object)")
    data_bytes = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        ok = (isinstance(info, dict) and info.get("dtype") in _DTYPE_BYTES
              and isinstance(info.get("shape"), list)
              and all(_is(d, "int") and d >= 0 for d in info["shape"])
              and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
              and all(_is(o, "int") for o in info["data_offsets"]))  # fmt: skip
        if not ok:
            raise ModelLoadError(path, f"tensor {name!r}: malformed header entry {info!r:.80}")
        begin, end = info["data_offsets"]
        want = math.prod(info["shape"]) * _DTYPE_BYTES[info["dtype"]]
        if not 0 <= begin <= end <= data_bytes or end - begin != want:
            raise ModelLoadError(path, f"truncated or corrupt: tensor {name!r} "
                                       f"{info['dtype']}{info['shape']} needs bytes "
                                       f"[{begin}, {end}) of {data_bytes}")  # fmt: skip
    return header


def read_safetensors(path: str | os.PathLike, *, device: str = "cpu") -> dict:
    """Every tensor in a safetensors file (``name → Tensor``), header checked first."""
    from safetensors.torch import load_file

    validate_safetensors(path)
    try:
        return load_file(str(path), device=device)
    except Exception as e:  # SafetensorError is no ValueError; keep the one error type
        raise ModelLoadError(path, f"unreadable safetensors file ({e})") from None


def load_safetensors_into(model, path: str | os.PathLike, *, device: str = "cpu") -> None:
    """Load a safetensors file into ``model`` (strict: every name and shape must match)."""
    from safetensors.torch import load_model

    validate_safetensors(path)
    try:
        load_model(model, str(path), strict=True, device=device)
    except Exception as e:
        msg = " ".join(str(e).split())
        raise ModelLoadError(path, f"weights do not fit the model: {msg[:300]}") from None


def read_sharded(directory: str | os.PathLike, *, device: str = "cpu") -> dict:
    """The tensors of ``model.safetensors.index.json``'s shards, each required to lie inside
    ``directory``."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    data = read_json(index, what="weight index")
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelLoadError(index, "weight_map must be an object of tensor name -> shard file")
    shards = [inside(directory, s) for s in sorted(set(weight_map.values()))]
    out: dict = {}
    for shard in shards:
        if not shard.is_file():
            raise ModelLoadError(index, f"shard {shard.name!r} is missing")
        out.update(read_safetensors(shard, device=device))
    return out


def read_torch_weights(path: str | os.PathLike) -> dict:
    """A ``pytorch_model.bin`` state dict, read with ``weights_only=True`` (no code runs)."""
    import torch

    path = Path(path)
    _need_file(path, "weights")
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        msg = " ".join(str(e).split())
        raise ModelLoadError(
            path, f"refused by torch.load(weights_only=True) or unreadable ({msg[:200]})"
        ) from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ModelLoadError(path, "must hold a dict of tensors")
    return sd


def read_tokenizer(path: str | os.PathLike):
    """A HuggingFace ``tokenizers.Tokenizer`` from ``tokenizer.json``."""
    from tokenizers import Tokenizer

    path = Path(path)
    read_json(path, what="tokenizer")  # a clear message for non-JSON and non-objects
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        msg = " ".join(str(e).split())
        raise ModelLoadError(path, f"not a tokenizer file ({msg[:200]})") from None


def read_hf_tokenizer(directory: str | os.PathLike):
    """The HuggingFace (``transformers``) tokenizer stored in ``directory``, read offline."""
    directory = Path(directory)
    names = ("tokenizer.json", "vocab.txt")
    if not any((directory / n).is_file() for n in names):
        raise FileNotFoundError(f"no tokenizer.json or vocab.txt in {str(directory)!r}")
    if (directory / "tokenizer.json").is_file():
        read_json(directory / "tokenizer.json", what="tokenizer")
    os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never download
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:
        msg = " ".join(str(e).split())
        raise ModelLoadError(directory, f"cannot read its tokenizer ({msg[:200]})") from None
