"""Weights stored as int8 rows: each row of a weight matrix as int8 with one fp32 scale.

A shipped translator's file in a quarter of fp32's bytes (half of float16's). Every 2-D
parameter (the linear layers, the embedding table) keeps ``round(row / s)`` with
``s = max|row| / 127`` under its own name and ``s`` under ``NAME.row_scale``; the other
tensors (biases, norms, buffers) are float16. Loading multiplies them back, rounds the
products to float16 like every other stored value (so each weight is a float16 number, as
the browser export expects: ``qkv.apps.web.weights``) and copies them into the model's fp32
parameters: the model runs in float as before (BLEU on the first 300 val sentences, en-fr
beam 5: 61.63 float16, 61.62 int8 rows).

A tensor shared by several parameters (tied embeddings) is stored once, under its first
name. The file is plain safetensors with ``{"qkv_storage": "int8-rows"}`` in its metadata;
:func:`qkv.models.load_pretrained` reads either kind.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from qkv.loading import ModelLoadError, read_safetensors

__all__ = ["INT8_ROWS", "STORAGE_KEY", "load_int8_rows", "save_int8_rows"]

STORAGE_KEY = "qkv_storage"  # the file's metadata field that says how its tensors are stored
INT8_ROWS = "int8-rows"
SCALE = ".row_scale"  # NAME + SCALE: the fp32 scale of each row of the int8 tensor NAME


def _aliases(model: nn.Module) -> dict[str, str]:
    """Every state-dict name -> the first name holding the same tensor (itself if none)."""
    first: dict[tuple, str] = {}
    out: dict[str, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        key = (t.data_ptr(), tuple(t.shape), t.stride()) if t.numel() else (name,)
        out[name] = first.setdefault(key, name)
    return out


def save_int8_rows(model: nn.Module, path: str | os.PathLike) -> None:
    """Write ``model``'s weights to the safetensors file ``path`` as int8 rows (module doc)."""
    from safetensors.torch import save_file

    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    aliases = _aliases(model)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if aliases[name] != name:
            continue  # tied: stored under its first name
        t = t.detach().cpu()
        if name in params and t.dim() == 2 and t.is_floating_point():
            w = t.float()
            s = w.abs().amax(dim=1) / 127  # (rows,); 0 for a row of zeros
            q = (w / s.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).round_()
            tensors[name] = q.clamp_(-127, 127).to(torch.int8).contiguous()
            tensors[name + SCALE] = s.contiguous()
        else:
            tensors[name] = (t.half() if t.is_floating_point() else t).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt", STORAGE_KEY: INT8_ROWS})


def load_int8_rows(model: nn.Module, path: str | os.PathLike, *, device: str = "cpu") -> None:
    """Load a file written by :func:`save_int8_rows` into ``model`` (strict: every name and
    shape must match); a file that does not fit is a :class:`~qkv.loading.ModelLoadError`."""
    stored = read_safetensors(path, device=device)
    state: dict[str, torch.Tensor] = {}
    for name, source in _aliases(model).items():
        t = stored.get(source)
        if t is None:
            raise ModelLoadError(path, f"weights do not fit the model: {source!r} is missing")
        if t.dtype == torch.int8:
            s = stored.get(source + SCALE)
            if s is None or s.shape != (t.shape[0],) or t.dim() != 2:
                raise ModelLoadError(path, f"int8 tensor {source!r} has no scale per row "
                                           f"({source + SCALE!r})")  # fmt: skip
            t = (t.float() * s.float()[:, None]).half()
        state[name] = t
    extra = set(stored) - set(state) - {n + SCALE for n in state}
    if extra:
        raise ModelLoadError(path, f"weights do not fit the model: unexpected {sorted(extra)[:5]}")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        msg = " ".join(str(e).split())
        raise ModelLoadError(path, f"weights do not fit the model: {msg[:300]}") from None
