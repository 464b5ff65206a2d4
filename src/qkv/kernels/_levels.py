"""The instruction-set levels qkv's C++ kernels are built for, and which one this CPU runs.

One source per kernel (``qkv/csrc``), compiled once per level with that level's compiler flags
into its own extension (``qkv._C_<level>``): the sources' ``#ifdef`` blocks
(``csrc/simd.h``) pick the vector code each level has. At run time the best level the CPU
supports is loaded, and only that one: a build is never loaded on a CPU that lacks one of
its instructions. ``QKV_ISA=<level>`` forces a level (an error if the CPU cannot run it).

This file is read by ``setup.py`` too (by path, before qkv is installed): it imports nothing
from qkv or torch.
"""

from __future__ import annotations

import hashlib
import os
import platform
from dataclasses import dataclass
from pathlib import Path

__all__ = ["COMMON_FLAGS", "LINK_FLAGS", "LEVELS", "Level", "best_level", "build_of",
           "cpu_features", "level_named", "levels_for_machine", "runnable_levels",
           "runnable_names", "select_level", "source_digest", "SOURCES"]

# No -ffast-math: the kernels rely on IEEE infinities; their reductions are vectorised by hand
# or `omp simd`. -fopenmp: their threads are PyTorch's own OpenMP runtime (libtorch links
# libgomp). -g0: Python's own CFLAGS carry -g, which costs a third of the build time.
COMMON_FLAGS = ("-O3", "-g0", "-fopenmp", "-fno-math-errno", "-fno-trapping-math")
# -lstdc++ ahead of the compiler's own libraries: the shared C++ runtime, the one torch loaded,
# even where a compiler adds -static-libstdc++ (a private copy can crash the process;
# _linkage.py checks the result).
LINK_FLAGS = ("-fopenmp", "-lstdc++")
SOURCES = ("flash_cpu.cpp", "flash_bwd.cpp", "flash_amx.cpp", "finite_cpu.cpp", "decode_cpu.cpp", "search_cpu.cpp", "packed_cpu.cpp", "int8_cpu.cpp",
           "step_cpu.cpp", "module.cpp")


def source_digest(csrc: Path) -> str:
    """A digest of the kernel sources (every file of ``csrc``): a prebuilt library records
    the digest it was built from, and is not used with other sources (an edited checkout)."""
    h = hashlib.sha256()
    for p in sorted(csrc.iterdir()):
        if p.suffix in (".cpp", ".h"):
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def file_digest(path: Path) -> str:
    """The sha256 of a built library: recorded after a successful build and checked before
    loading, so that a truncated or damaged file is rebuilt, never loaded (a bus error)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class Level:
    name: str
    flags: tuple[str, ...]  # compiler flags on top of the common ones
    needs: frozenset[str]  # CPU feature flags (as /proc/cpuinfo names them) it executes
    machine: str  # "x86_64" or "aarch64"


_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})  # x86-64-v3
_V4 = _V3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
_BF16 = _V4 | {"avx512_bf16", "avx512_vnni"}

# Ordered from the least to the most capable. avx512_bf16 and amx are one build: its AMX
# code runs only where the CPU has AMX tiles, the OS grants them (arch_prctl) and oneDNN sees
# them; QKV_ISA=avx512_bf16 turns them off on such a CPU. Likewise avx2 and avx2_vnni: the
# avx2 build's int8 loops issue AVX-VNNI (vpdpwssd, vpdpbusd on 8 lanes: Intel since Alder
# Lake, AMD since Zen 5) where the CPU has it; QKV_ISA=avx2 runs them as on a CPU without.
# And avx512 and avx512_vnni: the avx512 build's int8 loops issue AVX512_VNNI (Cascade Lake,
# Ice Lake, Tiger Lake: AVX-512 with VNNI but no BF16) where the CPU has it.
LEVELS: tuple[Level, ...] = (
    Level("portable", ("-march=x86-64", "-mtune=generic"), frozenset(), "x86_64"),
    Level("avx2", ("-march=x86-64-v3", "-mtune=generic"), _V3, "x86_64"),
    Level("avx512", ("-march=x86-64-v4", "-mtune=generic", "-mprefer-vector-width=512"), _V4,
          "x86_64"),
    Level("avx512_bf16", ("-march=x86-64-v4", "-mtune=generic", "-mprefer-vector-width=512",
                          "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16",
                          "-mamx-int8"), _BF16, "x86_64"),
    # aarch64: NEON (ASIMD) is part of the base architecture; one level
    Level("neon", ("-march=armv8-a",), frozenset(), "aarch64"),
)
# QKV_ISA names that map to a build with instructions on top (what the CPU must have for them)
_ALIASES = {"amx": "avx512_bf16", "avx2_vnni": "avx2", "avx512_vnni": "avx512"}
_EXTRA = {"amx": frozenset({"amx_tile", "amx_bf16"}), "avx2_vnni": frozenset({"avx_vnni"}),
          "avx512_vnni": frozenset({"avx512_vnni"})}


def build_of(name: str) -> str:
    """The build a level runs (``avx512_bf16`` for ``amx``, ``avx2`` for ``avx2_vnni``,
    ``avx512`` for ``avx512_vnni``)."""
    return _ALIASES.get(name, name)


def _machine() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def levels_for_machine(machine: str | None = None) -> list[Level]:
    """The levels built for this machine's architecture (all of them, whatever the CPU)."""
    machine = machine or _machine()
    return [lv for lv in LEVELS if lv.machine == machine]


def cpu_features() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (``/proc/cpuinfo``: CPUID bits the
    kernel has enabled, i.e. whose register state the OS saves); empty if unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("flags", "Features"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def level_named(name: str) -> Level:
    """The level called ``name`` (a build's name, not an alias such as ``amx``)."""
    return next(lv for lv in LEVELS if lv.name == name)


def runnable_levels(features: frozenset[str] | None = None,
                    machine: str | None = None) -> list[str]:
    """The names of the built levels whose instructions the CPU has, least capable first."""
    features = cpu_features() if features is None else features
    return [lv.name for lv in levels_for_machine(machine) if lv.needs <= features]


def runnable_names(features: frozenset[str] | None = None,
                   machine: str | None = None) -> list[str]:
    """Every level name ``QKV_ISA`` accepts on this CPU: the runnable builds, each followed by
    its names with instructions on top that the CPU also has (``avx2_vnni``, ``avx512_vnni``,
    ``amx``)."""
    features = cpu_features() if features is None else features
    extra = [(a, b) for a, b in _ALIASES.items() if _EXTRA[a] <= features]
    return [n for b in runnable_levels(features, machine)
            for n in (b, *(a for a, ab in extra if ab == b))]


def best_level(features: frozenset[str] | None = None, machine: str | None = None) -> str:
    """The most capable built level whose instructions the CPU has."""
    ok = runnable_levels(features, machine)
    if not ok:
        raise RuntimeError(f"qkv: no kernel level for machine {machine or _machine()!r}")
    return ok[-1]


def select_level(requested: str | None = None, features: frozenset[str] | None = None,
                 machine: str | None = None) -> tuple[str, str]:
    """``(build, name)``: the build to load and the level's name (they differ for ``amx``,
    which runs the ``avx512_bf16`` build, and for ``avx2_vnni`` and ``avx512_vnni``).
    ``requested`` (default ``$QKV_ISA``; ``auto`` or empty: the best level) must be a level of
    this machine that the CPU can run."""
    requested = os.environ.get("QKV_ISA", "") if requested is None else requested
    requested = requested.strip().lower()
    features = cpu_features() if features is None else features
    if requested in ("", "auto"):
        best = best_level(features, machine)
        return best, runnable_names(features, machine)[-1]
    names = [lv.name for lv in levels_for_machine(machine)]
    build = _ALIASES.get(requested, requested)
    if build not in names:
        choices = ", ".join(["auto", *names, *(a for a, b in _ALIASES.items() if b in names)])
        raise ValueError(f"QKV_ISA must be one of {choices}; got {requested!r}")
    level = level_named(build)
    missing = sorted(level.needs - features | (_EXTRA.get(requested, frozenset()) - features))
    if missing:
        raise RuntimeError(
            f"QKV_ISA={requested}: this CPU cannot run that level (it lacks "
            f"{', '.join(missing)}); it can run {best_level(features, machine)} and below"
        )
    return build, requested
