"""The kernels' instruction-set levels: which one a CPU gets, forcing one with QKV_ISA, and
which build is loaded (prebuilt, or compiled on first use under a name that carries the level)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import deadline
from qkv.kernels import _levels, _native

# /proc/cpuinfo flags of real CPUs (the relevant subset)
ZEN3 = frozenset("sse2 avx avx2 fma f16c bmi1 bmi2 movbe abm".split())
SKYLAKE_X = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
ICE_LAKE = SKYLAKE_X | {"avx512_vnni"}
ZEN4 = ICE_LAKE | {"avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}
OLD = frozenset({"sse2", "avx"})  # Sandy Bridge: AVX without AVX2/FMA
ALDER_LAKE = ZEN3 | {"avx_vnni"}  # AVX2 with AVX-VNNI, AVX-512 fused off


@pytest.mark.parametrize(
    ("features", "build", "name"),
    [(OLD, "portable", "portable"), (ZEN3, "avx2", "avx2"), (SKYLAKE_X, "avx512", "avx512"),
     (ICE_LAKE, "avx512", "avx512_vnni"), (ZEN4, "avx512_bf16", "avx512_bf16"),
     (SAPPHIRE_RAPIDS, "avx512_bf16", "amx"), (ALDER_LAKE, "avx2", "avx2_vnni"),
     (SAPPHIRE_RAPIDS | {"avx_vnni"}, "avx512_bf16", "amx")],
)  # fmt: skip
def test_each_cpu_gets_the_best_level_it_can_run(features, build, name):
    assert _levels.select_level("", features, "x86_64") == (build, name)
    assert _levels.select_level("auto", features, "x86_64") == (build, name)


def test_aarch64_has_its_own_levels():
    assert _levels.select_level("", frozenset({"fp", "asimd"}), "aarch64") == ("neon", "neon")
    with pytest.raises(ValueError, match="QKV_ISA must be one of auto, neon; got 'avx2'"):
        _levels.select_level("avx2", frozenset(), "aarch64")


def test_forcing_a_level():
    assert _levels.select_level("portable", SAPPHIRE_RAPIDS, "x86_64") == ("portable", "portable")
    assert _levels.select_level("AVX2", SAPPHIRE_RAPIDS, "x86_64") == ("avx2", "avx2")
    # avx512_bf16 on an AMX CPU: that build with its tiles off
    assert _levels.select_level("avx512_bf16", SAPPHIRE_RAPIDS, "x86_64") == (
        "avx512_bf16", "avx512_bf16")
    assert _levels.select_level("amx", SAPPHIRE_RAPIDS, "x86_64") == ("avx512_bf16", "amx")
    # avx2 on an AVX-VNNI CPU: that build as on a CPU without it; avx2_vnni with it
    assert _levels.select_level("avx2", ALDER_LAKE, "x86_64") == ("avx2", "avx2")
    assert _levels.select_level("avx2_vnni", ALDER_LAKE, "x86_64") == ("avx2", "avx2_vnni")
    assert _levels.runnable_names(ALDER_LAKE, "x86_64") == ["portable", "avx2", "avx2_vnni"]
    # avx512 on an AVX512_VNNI CPU: that build as on Skylake-X; avx512_vnni with it
    assert _levels.select_level("avx512", ICE_LAKE, "x86_64") == ("avx512", "avx512")
    assert _levels.select_level("avx512_vnni", ICE_LAKE, "x86_64") == ("avx512", "avx512_vnni")
    assert _levels.select_level(" AVX512_VNNI\n", ZEN4, "x86_64") == ("avx512", "avx512_vnni")
    assert _levels.runnable_names(SKYLAKE_X, "x86_64") == ["portable", "avx2", "avx512"]
    assert _levels.runnable_names(SAPPHIRE_RAPIDS | {"avx_vnni"}, "x86_64") == [
        "portable", "avx2", "avx2_vnni", "avx512", "avx512_vnni", "avx512_bf16", "amx"]


@pytest.mark.parametrize(
    ("features", "requested", "missing"),
    [(ZEN3, "avx512", "avx512bw, avx512cd, avx512dq, avx512f, avx512vl"),
     (ICE_LAKE, "avx512_bf16", "avx512_bf16"), (ZEN4, "amx", "amx_bf16, amx_tile"),
     (ZEN3, "avx2_vnni", "avx_vnni"), (OLD, "avx2_vnni", "abm, avx2, avx_vnni, bmi1, bmi2, f16c, fma, movbe"),
     (OLD, "avx2", "abm, avx2, bmi1, bmi2, f16c, fma, movbe"), (SKYLAKE_X, "avx512_vnni", "avx512_vnni"),
     (ZEN3, "avx512_vnni", "avx512_vnni, avx512bw, avx512cd, avx512dq, avx512f, avx512vl")],
)  # fmt: skip
def test_a_level_the_cpu_lacks_is_refused_naming_what_is_missing(features, requested, missing):
    with pytest.raises(RuntimeError, match=f"QKV_ISA={requested}: this CPU cannot run that "
                                           f"level \\(it lacks {missing}\\)"):  # fmt: skip
        _levels.select_level(requested, features, "x86_64")


def test_an_unknown_level_is_refused_listing_the_choices():
    with pytest.raises(ValueError, match="QKV_ISA must be one of auto, portable, avx2, avx512, "
                                         "avx512_bf16, amx, avx2_vnni, avx512_vnni; got 'sse4'"):  # fmt: skip
        _levels.select_level("sse4", ZEN3, "x86_64")


def test_the_level_agrees_with_pytorchs_view_of_this_cpu():
    """PyTorch's own dispatch (its CPU capability) against ours: the same vector width."""
    if _levels._machine() != "x86_64" or os.environ.get("ATEN_CPU_CAPABILITY"):
        pytest.skip("x86-64 with PyTorch's own capability detection only")
    ours = _levels.best_level()
    theirs = torch.backends.cpu.get_cpu_capability()  # DEFAULT, AVX2, AVX512 (or ZVECTOR...)
    expected = {"portable": "DEFAULT", "avx2": "AVX2", "avx512": "AVX512",
                "avx512_bf16": "AVX512"}[ours]  # fmt: skip
    assert theirs == expected, (ours, theirs)


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return deadline.run([sys.executable, "-c", code], 600, f"a fresh process with {env}",
                        env=dict(os.environ, **env), capture_output=True, text=True)  # fmt: skip


def test_forcing_a_level_this_cpu_lacks_is_a_clear_error_not_a_crash():
    """In a process of its own: the attention call raises naming the level, and the process
    goes on (nothing of that level is loaded)."""
    runnable = _levels.runnable_levels()
    lacking = [lv.name for lv in _levels.levels_for_machine() if lv.name not in runnable]
    requested = lacking[-1] if lacking else "neon" if _levels._machine() == "x86_64" else "avx2"
    code = """
import torch
from qkv.kernels._native import native_status
from qkv.kernels.flash import flash_attention
q = torch.randn(1, 1, 8, 16)
try:
    flash_attention(q, q, q)
except (RuntimeError, ValueError) as e:
    print("refused:", e)
print("status:", native_status())
"""
    res = _run(code, QKV_ISA=requested)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "refused: QKV_ISA" in res.stdout and requested in res.stdout, res.stdout
    assert "status: unavailable: QKV_ISA" in res.stdout, res.stdout


def test_a_prebuilt_library_is_used_only_for_its_sources_and_torch(tmp_path, monkeypatch):
    info = {"torch": torch.__version__, "sources": _levels.source_digest(_native.CSRC),
            "levels": [lv.name for lv in _levels.levels_for_machine()]}  # fmt: skip
    level = _levels.levels_for_machine()[-1].name  # any level of this machine's own
    built = tmp_path / "_built.json"
    monkeypatch.setattr(_native, "BUILT", built)
    assert _native._prebuilt(level)[1] == "no prebuilt kernels (qkv not built from this tree)"
    built.write_text(json.dumps({**info, "torch": "1.0.0"}))
    assert _native._prebuilt(level) == (None, f"prebuilt for torch 1.0.0, running "
                                                f"{torch.__version__}")  # fmt: skip
    built.write_text(json.dumps({**info, "sources": "0" * 16}))
    assert _native._prebuilt(level) == (
        None, "the kernel sources changed since the prebuilt kernels were compiled")
    built.write_text(json.dumps({**info, "levels": ["portable"]}))
    assert _native._prebuilt(level) == (
        None, f"level {level} not among the prebuilt ones (portable)")


def test_a_damaged_prebuilt_library_is_never_loaded(tmp_path, monkeypatch):
    """A truncated or overwritten library file fails the sha256 recorded at build time and is
    refused with a message saying what to do (loading it could kill the process)."""
    level = _levels.runnable_levels()[0]
    real = _native.LIB / f"_C_{level}.kernels"
    if not real.exists():
        pytest.skip("no prebuilt kernels in this install")
    data = real.read_bytes()
    info = {"torch": torch.__version__, "sources": _levels.source_digest(_native.CSRC),
            "levels": [level], "sha256": {level: _levels.file_digest(real)},
            "size": {level: len(data)}}  # fmt: skip
    monkeypatch.setattr(_native, "BUILT", tmp_path / "_built.json")
    monkeypatch.setattr(_native, "LIB", tmp_path)
    (tmp_path / "_built.json").write_text(json.dumps(info))
    copy = tmp_path / real.name
    copy.write_bytes(data[: len(data) // 2])
    assert _native._prebuilt(level) == (None, (
        f"prebuilt {copy} is damaged ({len(data) // 2} bytes, {len(data)} when it was built): "
        "reinstall qkv"))  # fmt: skip
    copy.write_bytes(os.urandom(len(data)))
    module, why = _native._prebuilt(level)
    assert module is None and why == (
        f"prebuilt {copy} is damaged (its sha256 differs from the one recorded when it "
        "was built): reinstall qkv"), why
    copy.unlink()
    assert _native._prebuilt(level)[1].startswith(f"prebuilt {real.name} cannot be read")


# one process, every record: each variant's _built.json is written, the loader's memo
# cleared, an attention call made (it must run, on the PyTorch-ops kernel where no library
# is loaded) and the status printed; the library is loaded last, from a complete record
_RECORDS = """
import json, sys
from pathlib import Path
import torch
from qkv.kernels import _native
from qkv.kernels.flash import flash_attention
lib = Path(sys.argv[1])
_native.LIB, _native.BUILT = lib, lib / "_built.json"
q = torch.randn(1, 2, 16, 8)
for variant in json.loads((lib / "variants.json").read_text()):
    name = variant["name"]
    _native.BUILT.write_bytes(bytes.fromhex(variant["record"]))
    (lib / variant["file"]).write_bytes((lib / variant["library"]).read_bytes())
    _native._load.cache_clear()
    print("== " + name, file=sys.stderr, flush=True)
    out = flash_attention(q, q, q)
    assert torch.isfinite(out).all()
    print(name + " -> " + _native.native_status(), flush=True)
print("ok")
"""


def test_a_prebuilt_library_is_loaded_only_from_a_complete_record(tmp_path):
    """The loader maps a library only after checking its size and sha256 against
    ``_built.json``: without them (a record of an older qkv) a truncated library, which would
    kill the process with SIGBUS, is never mapped; a record of any other shape (a list, keys
    missing, nulls, wrong types, bytes that are no JSON, an empty file) is no record. Each
    case: the attention call runs, one line is logged, no traceback, and native_status()
    says why; a complete record loads the library."""
    build = _levels.select_level("")[0]
    real = _native.LIB / f"_C_{build}.kernels"
    if not real.exists():
        pytest.skip("no prebuilt kernels in this install")
    data = real.read_bytes()
    name = real.name
    (tmp_path / "whole.so").write_bytes(data)
    (tmp_path / "truncated.so").write_bytes(data[: len(data) // 3])
    good = {"torch": torch.__version__, "sources": _levels.source_digest(_native.CSRC),
            "levels": [build], "sha256": {build: _levels.file_digest(real)},
            "size": {build: len(data)}}  # fmt: skip
    no_sums = {k: v for k, v in good.items() if k not in ("sha256", "size")}
    records = {
        "no checksum, truncated library": (json.dumps(no_sums), "truncated.so"),
        "no checksum": (json.dumps(no_sums), "whole.so"),
        "no size": (json.dumps({**good, "size": None}), "whole.so"),
        "sha256 null": (json.dumps({**good, "sha256": None}), "truncated.so"),
        "sha256 a list": (json.dumps({**good, "sha256": [good["sha256"][build]]}), "whole.so"),
        "size a string": (json.dumps({**good, "size": {build: str(len(data))}}), "whole.so"),
        "size true": (json.dumps({**good, "size": {build: True}}), "whole.so"),
        "a list": (json.dumps([good]), "whole.so"),
        "no levels": (json.dumps({k: v for k, v in good.items() if k != "levels"}), "whole.so"),
        "levels null": (json.dumps({**good, "levels": None}), "whole.so"),
        "levels a string": (json.dumps({**good, "levels": build}), "whole.so"),
        "levels of numbers": (json.dumps({**good, "levels": [1, None]}), "whole.so"),
        "garbage bytes": ("\udcff\udcfe\x00{garbage", "whole.so"),
        "empty file": ("", "whole.so"),
        "complete": (json.dumps(good), "whole.so"),  # last: the library stays loaded
    }  # fmt: skip
    variants = [{"name": k, "file": name, "library": lib,
                 "record": r.encode("utf-8", "surrogateescape").hex()}
                for k, (r, lib) in records.items()]  # fmt: skip
    (tmp_path / "variants.json").write_text(json.dumps(variants))
    res = deadline.run([sys.executable, "-c", _RECORDS, str(tmp_path)], 120,
                       "the loader over damaged records", capture_output=True, text=True,
                       env=dict(os.environ, QKV_NATIVE="prebuilt", QKV_ISA=""))  # fmt: skip
    # a signal (SIGBUS: a truncated library mapped) is a negative return code
    assert res.returncode == 0, (res.returncode, res.stdout[-2000:], res.stderr[-3000:])
    assert "Traceback" not in res.stderr and res.stdout.endswith("ok\n"), res.stderr[-3000:]
    status = dict(line.split(" -> ", 1) for line in res.stdout.splitlines()[:-1])
    assert list(status) == list(records), res.stdout
    # qkv's own lines (torch's libraries may add theirs: oneDNN under QEMU on aarch64)
    logged = {k.strip(): [line for line in v.strip().splitlines() if line.startswith("qkv")]
              for k, _, v in (part.partition("\n") for part in res.stderr.split("== ")[1:])}  # fmt: skip
    for case, said in status.items():
        if case == "complete":
            assert said.startswith(f"loaded: level {_levels.select_level('')[1]} (prebuilt)"), said
            assert logged[case] == [], logged[case]
            continue
        assert said.startswith("unavailable: ") and said.endswith(
            "reinstall qkv (QKV_NATIVE=prebuilt: no build on first use)"), (case, said)
        assert logged[case] == ["qkv: fused CPU kernels " + said], (case, logged[case])
    for case in ("no checksum, truncated library", "no checksum", "no size", "sha256 null",
                 "sha256 a list", "size a string", "size true"):  # fmt: skip
        assert f"does not record the size and sha256 of {name}" in status[case], status[case]
    for case in ("no levels", "levels null", "levels a string", "levels of numbers"):
        assert "lists no levels" in status[case], status[case]
    assert "holds a JSON list, not a build's record" in status["a list"]
    for case in ("garbage bytes", "empty file"):
        assert "is not the JSON record of a build" in status[case], status[case]


def test_a_damaged_cached_build_is_removed_before_loading(tmp_path, monkeypatch, caplog):
    """The just-in-time cache: a library whose checksum is not the one recorded after its
    build (or that has none: an interrupted build) is removed so that it is built again."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = _native._jit_name("portable")
    assert _levels.source_digest(_native.CSRC) in name and "portable" in name
    lib = tmp_path / name / f"{name}.so"
    lib.parent.mkdir()
    lib.write_bytes(b"\x7fELF half a library")
    record = lib.parent / _native.RECORD
    record.write_text(_levels.file_digest(lib) + "\n")
    assert _native._check_cached(name) == lib and lib.exists()  # intact: kept
    with open(lib, "ab") as f:
        f.write(b"more")
    with caplog.at_level("WARNING", logger="qkv.kernels"):
        assert _native._check_cached(name) == lib
    assert not lib.exists() and "does not match the checksum" in caplog.text
    lib.write_bytes(b"left by an interrupted build")
    record.unlink()
    _native._check_cached(name)
    assert not lib.exists()


def test_a_wait_for_another_build_is_said(tmp_path, monkeypatch, caplog):
    """A process that finds another one building says so (and keeps saying it), instead of
    waiting silently on the lock."""
    import fcntl
    import threading

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    beat = _native._heartbeat

    def waiting(what):  # the other process finishes a while after this one starts to wait
        threading.Timer(1.0, holder.close).start()
        return beat(what, every=0.05)

    monkeypatch.setattr(_native, "_heartbeat", waiting)
    name = "qkv_native_test_wait"
    (tmp_path / name).mkdir()
    holder = open(tmp_path / name / "qkv-build.flock", "w")
    fcntl.flock(holder, fcntl.LOCK_EX)
    with caplog.at_level("WARNING", logger="qkv.kernels"):
        with _native._build_lock(name):
            pass
    assert "waiting for another process to finish building qkv_native_test_wait" in caplog.text
    assert "still waiting" in caplog.text  # the heartbeat, every 0.05 s here


def test_the_heartbeat_reports_elapsed_time(caplog):
    import time

    with caplog.at_level("WARNING", logger="qkv.kernels"):
        with _native._heartbeat("still compiling the test kernels", every=0.05):
            time.sleep(0.2)
    beats = [r.getMessage() for r in caplog.records if "still compiling" in r.getMessage()]
    assert beats and beats[0].endswith("s so far)"), beats


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                    reason="no C++ compiler here (the wheel's install test)")  # fmt: skip
def test_a_build_cache_shared_by_two_cpus_never_loads_the_other_level(tmp_path):
    """A just-in-time build cache (``TORCH_EXTENSIONS_DIR``) shared by two machines: one
    compiles the portable level into it; the other, of another level, must not load that
    build. Simulated with QKV_ISA: the second process, with no compiler on PATH, has to
    report its own level unavailable rather than load the portable one."""
    runnable = _levels.runnable_levels()
    if len(runnable) < 2:
        pytest.skip("this CPU runs one level only")
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path), "QKV_NATIVE": "compile"}
    code = "from qkv.kernels._native import native_status; print(native_status())"
    first = _run(code, QKV_ISA="portable", **env)
    assert "loaded: level portable (compiled on first use" in first.stdout, first.stderr[-2000:]
    # a truncated library in the cache (a full disk, a killed copy) is found and rebuilt
    name = _native._jit_name("portable")
    lib = tmp_path / name / f"{name}.so"
    lib.write_bytes(lib.read_bytes()[:4096])
    again = _run(code, QKV_ISA="portable", **env)
    assert "loaded: level portable (compiled on first use" in again.stdout, again.stderr[-2000:]
    assert "does not match the checksum recorded after its build" in again.stderr
    no_compiler = tmp_path / "bin"
    no_compiler.mkdir()
    (no_compiler / "python").symlink_to(sys.executable)
    second = _run(code, QKV_ISA=runnable[-1], PATH=str(no_compiler), CXX="/nonexistent/c++",
                  **env)  # fmt: skip
    assert second.stdout.startswith("unavailable:"), (second.stdout, second.stderr[-2000:])
    assert "level portable" not in second.stdout


def test_no_tool_walking_the_package_can_load_a_level():
    """The levels' libraries are no modules to the import system: a documentation tool or
    pkgutil walking qkv must never load one this CPU cannot run (SIGILL)."""
    import importlib.util
    import pkgutil

    import qkv

    files = sorted(p.name for p in _native.LIB.glob("_C_*.kernels"))
    if not files:
        pytest.skip("no prebuilt kernels in this install")
    for name in files:
        assert importlib.util.find_spec(f"qkv.{name.split('.')[0]}") is None, name
    walked = [m.name for m in pkgutil.walk_packages(qkv.__path__, "qkv.", onerror=lambda _: None)]
    assert walked and not [m for m in walked if "._C_" in m], walked


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None,
                    reason="no aarch64-linux-gnu-g++ on PATH (scripts/setup-system.sh installs "
                    "it; the wheel's test runs with a PATH of the fresh venv alone)")  # fmt: skip
@pytest.mark.skipif(_levels._machine() == "aarch64", reason="this machine builds its Arm level")
def test_the_neon_level_compiles_for_aarch64(tmp_path):
    """Every kernel source with the aarch64 level's flags, cross-compiled against this torch's
    headers by the Arm build's own compile step (scripts/arm_build.py): the Arm build must
    compile (scripts/arm-test.sh runs it under QEMU)."""
    import importlib.util
    from pathlib import Path

    from torch.utils import cpp_extension

    path = Path(__file__).resolve().parents[2] / "scripts" / "arm_build.py"
    if not path.is_file():
        pytest.skip("scripts/ is not beside these tests (an installed copy of them)")
    spec = importlib.util.spec_from_file_location("arm_build", path)
    arm_build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(arm_build)

    objs = arm_build.compile_all(tmp_path, cpp_extension.include_paths())  # an error: its stderr
    assert [o.name for o in objs] == [f"{s}.o" for s in _levels.SOURCES]
    for obj in objs:
        assert obj.read_bytes()[18] == 183, obj  # e_machine: EM_AARCH64
