"""qkv's fused CPU kernels (``qkv/csrc/*.cpp``), compiled on first use.

The C++ sources are built once per machine into one extension with PyTorch's extension
builder (gcc + ninja, ~30 s; cached under ``~/.cache/torch_extensions``, or
``$TORCH_EXTENSIONS_DIR``). ``flash_cpu.cpp`` registers ``torch.ops.qkv_flash.fwd`` / ``.bwd``
(the flash backend), ``decode_cpu.cpp`` ``torch.ops.qkv_decode.fwd`` (the decode backend, a
few queries over a long KV cache) and the generation step's ``qkv_decode.small_linear``
(few-row linears on panel-packed weights) and ``qkv_decode.beam_topk`` (beam search's
log-softmax + top-k in one pass), ``int8_cpu.cpp`` ``torch.ops.qkv_int8.linear`` (int8
linear layers, :mod:`qkv.kernels.int8`); ``module.cpp`` makes the extension a Python module
too, for the few functions called on every attention call. Where they cannot be built (no
compiler, another OS) the flash backend keeps working on its PyTorch-ops kernel, the decode
backend is not offered, and :func:`native_status` says why.
``QKV_NATIVE=0`` turns the fused kernel off; ``QKV_NATIVE_PORTABLE=1`` builds it without
``-march=native`` (plain C++ loops instead of the AVX-512 ones; used by the tests to check
that path on machines that have AVX-512).

bf16 block matmuls take one of three paths, chosen per call: AMX tiles (oneDNN's brgemm on
VNNI-packed K/V) where oneDNN sees AMX, qkv's AVX512_BF16 dot-product micro-kernel where
the CPU has AVX512_BF16 but no AMX, oneDNN's unpacked brgemm otherwise. ``QKV_ISA=avx512``
forces the AVX512_BF16 kernel (to develop and check it on an AMX machine), ``QKV_ISA=brgemm``
the unpacked brgemm, ``QKV_ISA=amx`` requires AMX; oneDNN's own ``ONEDNN_MAX_CPU_ISA`` (e.g.
``AVX512_CORE_BF16``) hides AMX from oneDNN, and so from this choice too.
:func:`native_status` names the path (``torch.ops.qkv_flash.bf16_path()``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["decode_ops", "int8_ops", "native_module", "native_ops", "native_status"]

logger = logging.getLogger("qkv.kernels")

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = [
    CSRC / "flash_cpu.cpp", CSRC / "decode_cpu.cpp", CSRC / "int8_cpu.cpp", CSRC / "step_cpu.cpp",
    CSRC / "module.cpp",
]  # fmt: skip
_status = "not loaded yet"
_module = None  # the extension's Python module (module.cpp): functions on the per-call path


def _portable() -> bool:
    return os.environ.get("QKV_NATIVE_PORTABLE", "0") == "1"


def _flags() -> list[str]:
    # -march=native: the build is per machine (the cache lives on it). No -ffast-math: the
    # kernel relies on IEEE infinities; its reductions are vectorised by hand or `omp simd`.
    # -fopenmp: its threads are PyTorch's own OpenMP runtime (libtorch links libgomp).
    flags = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]
    if platform.machine() in ("x86_64", "AMD64") and not _portable():
        flags += ["-march=native", "-mprefer-vector-width=512"]
    return flags


@contextlib.contextmanager
def _build_lock(name: str) -> Iterator[None]:
    """Hold an OS lock on the build directory while building or loading.

    PyTorch's builder marks a build in progress with a ``lock`` file that it deletes when done;
    a process killed mid-build (Ctrl-C, a timeout) leaves the file behind, and every later
    load then waits for it forever. This lock is ``flock``'s, which the OS releases when its
    holder dies: whoever holds it is the only qkv builder, so a ``lock`` file found then is
    stale and removed.
    """
    try:
        import fcntl

        from torch.utils.cpp_extension import _get_build_directory
    except ImportError:  # not POSIX, or a PyTorch without the helper: PyTorch's lock alone
        yield
        return
    directory = Path(_get_build_directory(name, verbose=False))
    with open(directory / "qkv-build.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        stale = directory / "lock"
        if stale.exists():
            logger.warning("qkv: removing a stale build lock left by an interrupted build: %s",
                           stale)  # fmt: skip
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@functools.cache
def native_ops() -> object | None:
    """``torch.ops.qkv_flash`` once the kernel is built and loaded, else ``None``."""
    global _status
    if os.environ.get("QKV_NATIVE", "1") == "0":
        _status = "off (QKV_NATIVE=0)"
        return None
    try:
        from torch.utils import cpp_extension

        logger.info("qkv: loading the fused CPU kernel (the first build takes ~15 s)")
        name = "qkv_flash_cpu_portable" if _portable() else "qkv_flash_cpu"
        with _build_lock(name):
            module = cpp_extension.load(
                name=name,
                sources=[str(p) for p in SOURCES],
                extra_cflags=_flags(),
                is_python_module=True,
                verbose=False,
            )
        ops = torch.ops.qkv_flash
        ops.fwd  # noqa: B018 (raises if the library did not register its ops)
        torch.ops.qkv_decode.fwd  # noqa: B018
        torch.ops.qkv_int8.linear  # noqa: B018
    except Exception as e:  # no compiler/ninja, unsupported platform, failed build
        _status = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        logger.warning("qkv: fused CPU kernel %s; flash uses its PyTorch-ops kernel", _status)
        return None
    global _module
    _module = module
    _status = (f"loaded ({' '.join(_flags())}; decode path {torch.ops.qkv_decode.isa()}; "
               f"int8 linears {torch.ops.qkv_int8.isa()})")  # fmt: skip
    return ops


def native_module() -> object | None:
    """The extension's Python module (plain functions for per-call work, e.g.
    ``max_abs_product``: no operator schema to parse), else ``None``."""
    return None if native_ops() is None else _module


def decode_ops() -> object | None:
    """``torch.ops.qkv_decode`` (loads the extension if needed), else ``None``."""
    return None if native_ops() is None else torch.ops.qkv_decode


def int8_ops() -> object | None:
    """``torch.ops.qkv_int8`` (loads the extension if needed), else ``None``."""
    return None if native_ops() is None else torch.ops.qkv_int8


def native_status() -> str:
    """Whether the fused kernel is in use, and if not, why (loads it if not tried yet);
    when loaded, also the bf16 matmul path it takes now (``QKV_ISA`` is read per call)."""
    ops = native_ops()
    if ops is not None and hasattr(ops, "bf16_path"):
        try:
            path = ops.bf16_path()
        except RuntimeError as e:  # a bad QKV_ISA value: say so rather than raise here
            path = str(e).splitlines()[0]
        return f"{_status}; bf16 path: {path}"
    return _status
