"""The ``QKV_*`` settings read from the environment, each checked where it is read.

A setting with a value qkv does not take is a :class:`SettingError` (a ``ValueError``) that
names the variable and the values it takes, raised by the call that would use it, before
any kernel reads it: ``QKV_DECODE_INT8=fast`` stops a decode over an int8 cache, never an
fp32 prefill (which does not read it), nor :func:`qkv.kernels._native.native_status`.

============================  ========================================  ====================
variable                      values (unset or empty: the first)        read by
============================  ========================================  ====================
``QKV_NATIVE``                ``1``, ``0``, ``prebuilt``, ``compile``    the first kernel call
``QKV_ISA``                   ``auto`` or a level (``_levels``)          the first kernel call
``QKV_BF16_MATMUL``           ``auto``, ``amx``, ``onednn``, ``dot``,    every bf16 flash call
                              ``widen``, ``brgemm``
``QKV_DECODE_FP32``           ``auto``, ``avx2``, ``avx512``             fp32 K/V decode calls
``QKV_DECODE_BF16``           ``auto``, ``amx``, ``dot``, ``widen``      bf16 K/V decode calls
``QKV_DECODE_INT8``           ``auto``, ``int16``, ``widen``             int8 K/V decode calls
``QKV_DEBUG``                 ``0``, ``1``                               the ``qkv`` command
============================  ========================================  ====================

The kernel paths (``QKV_BF16_MATMUL``, ``QKV_DECODE_*``) are parsed by the C++ kernels
themselves (``csrc/flash_cpu.cpp``, ``csrc/decode_cpu.cpp``: the value exactly, no case
folding or trimming); the table here takes exactly what they take. ``QKV_DECODE_*`` are read
once per process by the kernels, so a value accepted once is not checked again.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

__all__ = ["SETTINGS", "SettingError", "check_bf16_matmul", "check_decode", "value"]

# variable -> the values it takes (the first is the default, for unset or empty too)
SETTINGS: dict[str, tuple[str, ...]] = {
    "QKV_NATIVE": ("1", "0", "prebuilt", "compile"),
    "QKV_BF16_MATMUL": ("auto", "amx", "onednn", "dot", "widen", "brgemm"),
    "QKV_DECODE_FP32": ("auto", "avx2", "avx512"),
    "QKV_DECODE_BF16": ("auto", "amx", "dot", "widen"),
    "QKV_DECODE_INT8": ("auto", "int16", "widen"),
    "QKV_DEBUG": ("0", "1"),
}
# the decode kernel's setting for each dtype of K/V
_DECODE = {torch.float32: "QKV_DECODE_FP32", torch.bfloat16: "QKV_DECODE_BF16",
           torch.int8: "QKV_DECODE_INT8"}  # fmt: skip
_accepted: set[str] = set()  # decode settings found good (the kernels read them once)
_accepted_values: set[str] = set()  # QKV_BF16_MATMUL values found good here


class SettingError(ValueError):
    """A ``QKV_*`` environment variable set to a value qkv does not take. ``name``: the
    variable; ``value``: its value."""

    def __init__(self, name: str, value: str, message: str | None = None) -> None:
        self.name, self.value = name, value
        if message is None:
            *most, last = SETTINGS[name]
            message = f"{name} must be {', '.join(most)} or {last}; got {value!r}"
        super().__init__(message)


def value(name: str) -> str:
    """The value of setting ``name`` (its default when unset or empty), checked."""
    raw = os.environ.get(name, "")
    if not raw:
        return SETTINGS[name][0]
    if raw not in SETTINGS[name]:
        raise SettingError(name, raw)
    return raw


def check_decode(kv_dtype: torch.dtype, ops: object | None = None) -> None:
    """Check the decode kernel's setting for K/V of ``kv_dtype`` (``QKV_DECODE_FP32``,
    ``_BF16``, ``_INT8``) before a decode call reads it: a set lookup once it passed.
    ``QKV_DECODE_BF16=amx`` where the tiles cannot run is refused too (``ops``:
    ``torch.ops.qkv_decode``, asked with a tiny call)."""
    name = _DECODE.get(kv_dtype)
    if name is None or name in _accepted:
        return
    if value(name) == "amx" and ops is not None:
        x = torch.zeros(1, 1, 1, 32, dtype=torch.bfloat16)  # (B, h, T, d)
        _unavailable(name, lambda: ops.fwd(x, x, x, None, 1.0, False, -1))
    _accepted.add(name)


def check_bf16_matmul(ops: object | None = None) -> None:
    """Check ``QKV_BF16_MATMUL`` before a bf16 flash call (the kernel reads it per call);
    ``amx`` where this CPU or level has none is refused too (``ops``: ``torch.ops.qkv_flash``)."""
    raw = os.environ.get("QKV_BF16_MATMUL")
    if not raw or raw in _accepted_values:
        return
    if raw not in SETTINGS["QKV_BF16_MATMUL"]:
        raise SettingError("QKV_BF16_MATMUL", raw)
    if raw == "amx" and ops is not None:
        _unavailable("QKV_BF16_MATMUL", ops.bf16_path)
    _accepted_values.add(raw)


def _unavailable(name: str, ask: Callable[[], object]) -> None:
    """Run ``ask()``, a kernel call that reads setting ``name``; the kernel's refusal (a
    path this CPU, level or oneDNN cannot take) becomes a :class:`SettingError`."""
    try:
        ask()
    except RuntimeError as e:
        raise SettingError(name, os.environ.get(name, ""), str(e).splitlines()[0]) from None
