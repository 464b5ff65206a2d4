"""qkv's fused CPU kernels (``qkv/csrc/*.cpp``): the build for this CPU, loaded on first use.

The C++ sources are compiled when qkv is installed, once per instruction-set level of the
machine's architecture (:mod:`qkv.kernels._levels`: portable, avx2, avx512, avx512_bf16 on
x86-64; neon on aarch64), into one extension per level, ``qkv/_C_<level>.kernels`` (a name
no import machinery takes for a module: a tool that walks the package never loads a level
the CPU cannot run). The first kernel call loads the best level the CPU supports, and only
that one; ``QKV_ISA=<level>`` forces a
level the CPU can run (``amx``: the avx512_bf16 build with AMX tiles; ``avx512_bf16`` on an
AMX CPU turns them off; likewise ``avx2_vnni`` and ``avx2`` for AVX-VNNI, ``avx512_vnni``
and ``avx512`` for AVX512_VNNI); a level the CPU lacks is an error, never a crash.

Where no prebuilt library fits (a source checkout not built, sources edited since the build,
another torch version), the level is compiled on first use with PyTorch's extension builder
(gcc + ninja, ~1-2 min) into ``~/.cache/torch_extensions`` (or ``$TORCH_EXTENSIONS_DIR``),
under a name that carries the level and the sources' digest: a cache shared by machines with
different CPUs never hands one CPU another's build, and two checkouts of different sources
never rebuild over each other. A build, and a wait for another process's build, say so on
stderr with the time spent; a library is loaded only if its size and sha256 match the ones
recorded after its build (``_built.json``, written by setup.py; a truncated or damaged file,
or one without that record, is rebuilt, with a message: mapping a truncated library kills
the process with SIGBUS; a record of any other shape is no record), and only if it
shares torch's C++ runtime (:mod:`qkv.kernels._linkage`: a library with its own static copy
of libstdc++ can crash the process at its first error message). ``QKV_NATIVE=0`` turns the
kernels off; ``QKV_NATIVE=prebuilt`` forbids the build on first use, ``QKV_NATIVE=compile``
makes it (ignoring the prebuilt kernels). A setting with another value is an error naming it
(:mod:`qkv.kernels._settings`), raised by the calls that read it.

``flash_cpu.cpp`` registers ``torch.ops.qkv_flash.fwd`` / ``.bwd`` (the flash backend),
``decode_cpu.cpp`` ``torch.ops.qkv_decode.fwd`` (the decode backend, a few queries over a
long KV cache), ``packed_cpu.cpp`` the generation step's ``qkv_decode.small_linear``
(few-row linears on panel-packed weights), ``search_cpu.cpp`` ``qkv_decode.beam_topk`` and
``argmax_rows`` (beam search's log-softmax + top-k, greedy search's argmax, one pass each),
``int8_cpu.cpp`` ``torch.ops.qkv_int8.linear`` (int8 linear layers, :mod:`qkv.kernels.int8`),
``step_cpu.cpp`` the fused decoder step; ``module.cpp`` makes the extension a Python module too, for the
few functions called on every attention call. Where no build can be had, the flash backend
keeps working on its PyTorch-ops kernel, the decode backend is not offered, and
:func:`native_status` says why.

bf16 block matmuls take one of three paths, chosen per call: AMX tiles (oneDNN's brgemm on
VNNI-packed K/V) where oneDNN sees AMX, qkv's AVX512_BF16 dot-product micro-kernel where
the CPU has AVX512_BF16 but no AMX, the fp32 kernel on inputs widened once per call
otherwise. ``QKV_BF16_MATMUL=dot|widen|brgemm|amx`` forces one (brgemm: oneDNN's unpacked
bf16 brgemm) (read on every call); oneDNN's own
``ONEDNN_MAX_CPU_ISA`` (e.g. ``AVX512_CORE_BF16``) hides AMX from oneDNN, and so from this
choice too. :func:`native_status` names the level and the paths.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import importlib.util
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from qkv.kernels import _levels, _linkage, _settings
from qkv.kernels._settings import SettingError

__all__ = ["decode_ops", "int8_ops", "native_level", "native_module", "native_ops",
           "native_status"]

logger = logging.getLogger("qkv.kernels")

CSRC = Path(__file__).resolve().parent.parent / "csrc"
BUILT = Path(__file__).resolve().parent / "_built.json"  # written by setup.py
LIB = Path(__file__).resolve().parent.parent  # the prebuilt levels: qkv/_C_<level>.kernels
_status = "not loaded yet"
_module = None  # the extension's Python module (module.cpp): functions on the per-call path
_level = None  # the level loaded ("amx" for the avx512_bf16 build with its tiles on)


def _flags(build: str) -> list[str]:
    return [*_levels.COMMON_FLAGS, *_levels.level_named(build).flags, f"-DQKV_LEVEL={build}"]


def _record() -> tuple[dict | None, str]:
    """``_built.json``, the record setup.py writes after a build, as a dict; else ``None``
    and why (missing, unreadable, not JSON, not an object)."""
    try:
        raw = BUILT.read_bytes()
    except FileNotFoundError:
        return None, "no prebuilt kernels (qkv not built from this tree)"
    except OSError as e:
        return None, f"{BUILT} cannot be read: {e.strerror or e}"
    try:
        info = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):  # bad UTF-8 (a ValueError too), bad JSON, empty
        return None, f"{BUILT} is not the JSON record of a build: reinstall qkv"
    if not isinstance(info, dict):
        kind = type(info).__name__
        return None, f"{BUILT} holds a JSON {kind}, not a build's record: reinstall qkv"
    return info, ""


def _verified(info: dict, build: str, path: Path) -> str | None:
    """Why ``path``, the library of level ``build``, must not be loaded (``None``: its size
    and sha256 are the ones recorded after its build). A file without both recorded is not
    verified, so not loaded: mapping a truncated library kills the process (SIGBUS)."""
    sums, sizes = info.get("sha256"), info.get("size")
    want = sums.get(build) if isinstance(sums, dict) else None
    size = sizes.get(build) if isinstance(sizes, dict) else None
    if not (isinstance(want, str) and len(want) == 64 and isinstance(size, int)
            and not isinstance(size, bool)):  # fmt: skip
        return (f"{BUILT.name} does not record the size and sha256 of {path.name} (a build "
                "of an older qkv, or a damaged record), so it is not loaded unverified: "
                "reinstall qkv")  # fmt: skip
    try:
        have = path.stat().st_size
        if have != size:
            return (f"prebuilt {path} is damaged ({have} bytes, {size} when it was built): "
                    "reinstall qkv")  # fmt: skip
        if _levels.file_digest(path) != want.lower():
            return (f"prebuilt {path} is damaged (its sha256 differs from the one recorded "
                    "when it was built): reinstall qkv")  # fmt: skip
    except OSError as e:
        return f"prebuilt {path.name} cannot be read: {e}"
    return None


def _prebuilt(build: str) -> tuple[object | None, str]:
    """The installed extension of level ``build``, or ``None`` and why it does not fit.
    Loaded only if its size and sha256 are those recorded after its build."""
    info, why = _record()
    if info is None:
        return None, why
    levels = info.get("levels")
    if not (isinstance(levels, list) and all(isinstance(lv, str) for lv in levels)):
        return None, f"{BUILT} lists no levels: reinstall qkv"
    if build not in levels:
        return None, f"level {build} not among the prebuilt ones ({', '.join(levels)})"
    if info.get("torch") != torch.__version__:
        return None, f"prebuilt for torch {info.get('torch')}, running {torch.__version__}"
    if CSRC.is_dir() and info.get("sources") != _levels.source_digest(CSRC):
        return None, "the kernel sources changed since the prebuilt kernels were compiled"
    path = LIB / f"_C_{build}.kernels"
    if why := _verified(info, build, path):
        return None, why
    try:  # by path: the file's name is no module's (see setup.py), so nothing else loads it
        loader = importlib.machinery.ExtensionFileLoader(f"qkv._C_{build}", str(path))
        spec = importlib.util.spec_from_file_location(f"qkv._C_{build}", path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module, "prebuilt"
    except ImportError as e:
        return None, f"prebuilt {build} does not load: {e}"


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
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process builds: say why this call waits
            logger.warning("qkv: waiting for another process to finish building %s (%s)",
                           name, directory)  # fmt: skip
            with _heartbeat(f"still waiting for the build of {name}"):
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


@contextlib.contextmanager
def _heartbeat(what: str, every: float = 30.0) -> Iterator[None]:
    """Log ``what`` with the time spent every ``every`` seconds until the block ends (a long
    build or wait is never silent)."""
    import threading
    import time

    start, done = time.monotonic(), threading.Event()

    def beat() -> None:
        while not done.wait(every):
            logger.warning("qkv: %s (%.0f s so far)", what, time.monotonic() - start)

    thread = threading.Thread(target=beat, name="qkv-build-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _jit_name(build: str) -> str:
    """The build's name in the extension cache: the level (a cache shared by CPUs of other
    levels) and the sources' digest (checkouts of other sources) make builds different."""
    return f"qkv_native_{build}_{_levels.source_digest(CSRC)}"


RECORD = "qkv-build.sha256"  # beside a just-in-time build: its library's sha256


def _check_cached(name: str) -> Path:
    """The path of build ``name``'s cached library; a library there whose sha256 is not the
    one recorded after its build (truncated, damaged, or left by an interrupted build) is
    removed, with a message, so that the builder makes it again."""
    from torch.utils.cpp_extension import _get_build_directory

    directory = Path(_get_build_directory(name, verbose=False))
    lib, record = directory / f"{name}.so", directory / RECORD
    if lib.exists():
        try:
            ok = record.read_text().strip() == _levels.file_digest(lib)
        except OSError:
            ok = False
        if not ok:
            logger.warning("qkv: %s does not match the checksum recorded after its build "
                           "(truncated, damaged or interrupted): building it again", lib)
            lib.unlink(missing_ok=True)
    return lib


def _compile(build: str) -> object:
    """Compile level ``build`` now (a checkout without a fitting prebuilt library)."""
    from torch.utils import cpp_extension

    name = _jit_name(build)
    with _build_lock(name):
        lib = _check_cached(name)
        fresh = not lib.exists()
        if fresh:
            logger.warning("qkv: compiling the %s kernels for this machine (once, ~1-2 min)",
                           build)  # fmt: skip
        with _heartbeat(f"still compiling the {build} kernels"):
            module = cpp_extension.load(
                name=name,
                sources=[str(CSRC / s) for s in _levels.SOURCES],
                extra_cflags=_flags(build),
                extra_ldflags=list(_levels.LINK_FLAGS),
                is_python_module=True,
                verbose=False,
            )
        if fresh:  # record the new library's checksum (after a complete build only)
            record = lib.parent / RECORD
            tmp = record.with_suffix(".tmp")
            tmp.write_text(_levels.file_digest(lib) + "\n")
            tmp.replace(record)  # never a half-written record
        return module


def _select() -> tuple[str, str]:
    """``(build, level)`` to load (:func:`qkv.kernels._levels.select_level`); a ``QKV_ISA``
    that names no level, or one this CPU cannot run, is a :class:`SettingError`."""
    try:
        return _levels.select_level()
    except (ValueError, RuntimeError) as e:
        requested = os.environ.get("QKV_ISA", "")
        if requested.strip().lower() in ("", "auto"):  # no level for this machine at all
            raise
        raise SettingError("QKV_ISA", requested, str(e)) from None


@functools.cache
def _load() -> object | None:
    global _status, _module, _level
    mode = _settings.value("QKV_NATIVE")  # a bad value raises (not cached: raised again)
    if mode == "0":
        _status = "off (QKV_NATIVE=0)"
        return None
    build, level = _select()
    module, how = (None, "QKV_NATIVE=compile") if mode == "compile" else _prebuilt(build)
    if module is None:  # how: why no prebuilt library fits
        if mode == "prebuilt":
            _status = f"unavailable: {how} (QKV_NATIVE=prebuilt: no build on first use)"
            logger.warning("qkv: fused CPU kernels %s", _status)
            return None
        try:
            module, how = _compile(build), f"compiled on first use: {how}"
        except Exception as e:  # no compiler/ninja, unsupported platform, failed build
            first = str(e).splitlines()[0] if str(e) else ""
            _status = f"unavailable: {how}; build failed: {type(e).__name__}: {first}"
            logger.warning("qkv: fused CPU kernels %s; flash uses its PyTorch-ops kernel",
                           _status)  # fmt: skip
            return None
    if why := _linkage.private_runtime(module.__file__):  # loaded, but never called
        if how.startswith("compiled"):  # rebuilt by the next process, perhaps with CXX fixed
            Path(module.__file__).unlink(missing_ok=True)
        _status = f"unavailable: {why}"
        logger.warning("qkv: fused CPU kernels %s", _status)
        return None
    try:
        ops = torch.ops.qkv_flash
        assert ops.level() == build, (ops.level(), build)
        torch.ops.qkv_decode.fwd  # noqa: B018 (raises if the library did not register its ops)
        torch.ops.qkv_int8.linear  # noqa: B018
    except Exception as e:
        _status = f"unavailable: the {build} library is broken: {type(e).__name__}: {e}"
        logger.warning("qkv: fused CPU kernels %s", _status)
        return None
    _module, _level = module, level
    # the paths (decode, int8, bf16) are asked when the status is: the kernels read the
    # QKV_DECODE_* settings there, and a bad one must not stop the kernels' loading
    _status = f"loaded: level {level} ({how})"
    return ops


def native_ops() -> object | None:
    """``torch.ops.qkv_flash`` once the kernels are loaded, else ``None``. Raises if
    ``QKV_ISA`` names an unknown level or one this CPU cannot run."""
    return _load()


def native_level() -> str | None:
    """The instruction-set level of the loaded kernels (``None``: none loaded)."""
    return _level if _load() is not None else None


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
    """Whether the fused kernels are in use (their level, prebuilt or compiled here, and the
    paths they take), and if not, why; loads them if not tried yet. The bf16 matmul path is
    the one taken now (``QKV_BF16_MATMUL`` is read per call). Never raises: a bad setting
    is named in the status."""
    try:
        ops = native_ops()
    except (ValueError, RuntimeError) as e:  # a bad QKV_ISA or QKV_NATIVE: said, not raised
        return f"unavailable: {e}"
    if ops is None:
        return _status

    def ask(what: Callable[[], str]) -> str:  # a bad QKV_* setting: its message instead
        try:
            return what()
        except RuntimeError as e:
            return str(e).splitlines()[0]

    return (f"{_status}; decode path {ask(torch.ops.qkv_decode.isa)}; "
            f"int8 linears {ask(torch.ops.qkv_int8.isa)}; bf16 path: {ask(ops.bf16_path)}")
