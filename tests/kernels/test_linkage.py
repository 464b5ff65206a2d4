"""The kernels share torch's C++ runtime (qkv.kernels._linkage): a library that carries its
own static copy of libstdc++ is refused by the loader, the link flags keep a compiler that
adds -static-libstdc++ on the shared one, and the ELF reader agrees with binutils."""

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from qkv.kernels import _levels, _linkage, _native

CXX = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("g++")
needs_cxx = pytest.mark.skipif(CXX is None, reason="no C++ compiler here (the wheel's test)")

# formats a number through std::ostream, as the kernels' error messages do
SOURCE = r"""
#include <cstring>
#include <sstream>
extern "C" int fmt(long x, char* buf, int n) {
  std::ostringstream s;
  s << "x=" << x;
  std::strncpy(buf, s.str().c_str(), n);
  return 0;
}
"""

FORMAT = """
import ctypes, sys
import torch  # its libstdc++ is in the process first, as when qkv runs
buf = ctypes.create_string_buffer(64)
ctypes.CDLL(sys.argv[1]).fmt(ctypes.c_long(42), buf, 64)
print(buf.value.decode())
"""


def _library(tmp_path, name, *flags):
    src = tmp_path / "fmt.cpp"
    src.write_text(SOURCE)
    out = tmp_path / f"{name}.so"
    subprocess.run([CXX, "-shared", "-fPIC", "-O2", str(src), "-o", str(out), *flags],
                   check=True, capture_output=True, timeout=120)  # fmt: skip
    machine = lambda path: Path(path).read_bytes()[18:20]  # noqa: E731 (ELF e_machine)
    if machine(out) != machine(os.path.realpath(sys.executable)):
        pytest.skip("the C++ compiler here builds for another architecture (an emulated Python)")
    return out


def _formatted(lib) -> str:
    res = subprocess.run([sys.executable, "-c", FORMAT, str(lib)], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    return res.stdout.strip() if res.returncode == 0 else f"exit {res.returncode}"


@needs_cxx
def test_a_private_runtime_is_named_and_the_link_flags_avoid_it(tmp_path):
    """With torch's libstdc++ loaded first, a library holding a static copy of it loses the
    number it formats (seen elsewhere: a segfault); _linkage names such a library, and the
    kernels' link flags make the same compiler flag give one on the shared runtime."""
    private = _library(tmp_path, "private", "-static-libstdc++")
    fixed = _library(tmp_path, "fixed", "-static-libstdc++", *_levels.LINK_FLAGS)
    plain = _library(tmp_path, "plain")
    why = _linkage.private_runtime(private)
    assert why is not None and why.startswith("private.so carries its own copy of the C++ "
                                              "runtime (it does not need libstdc++.so")  # fmt: skip
    assert "libstdc++.so.6" not in _linkage.needed_libraries(private)
    for lib in (fixed, plain):
        assert "libstdc++.so.6" in _linkage.needed_libraries(lib), lib
        assert _linkage.private_runtime(lib) is None, lib
        assert _formatted(lib) == "x=42", lib
    assert _formatted(private) != "x=42"  # the hazard the check exists for


@pytest.mark.skipif(shutil.which("readelf") is None, reason="no binutils readelf here")
def test_the_needed_libraries_are_those_readelf_lists():
    lib = _native.native_module()
    files = [sys.executable, shutil.which("readelf")] + ([lib.__file__] if lib else [])
    for path in files:
        out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True,
                             check=True).stdout  # fmt: skip
        theirs = [line.split("[", 1)[1].rstrip("]") for line in out.splitlines()
                  if "(NEEDED)" in line]  # fmt: skip
        assert _linkage.needed_libraries(path) == theirs, path


def test_what_is_no_elf_library_is_not_judged(tmp_path):
    lib = _native.native_module()
    cut = tmp_path / "cut.so"
    cut.write_bytes(open(lib.__file__, "rb").read(4096) if lib else b"\x7fELF\x02\x01")
    for path in (__file__, cut):
        assert _linkage.needed_libraries(path) is None, path
        assert _linkage.private_runtime(path) is None, path


def test_the_kernels_in_use_share_torchs_runtime():
    lib = _native.native_module()
    if lib is None:
        pytest.skip(f"no kernels here: {_native.native_status()}")
    needed = _linkage.needed_libraries(lib.__file__)
    assert "libstdc++.so.6" in needed and "libc10.so" in needed, needed


@needs_cxx
@pytest.mark.parametrize("how", ["prebuilt", "compiled"])
def test_the_loader_refuses_a_library_with_a_private_runtime(tmp_path, monkeypatch, how):
    """The library is loaded but none of its ops is ever called: the status says why, and a
    just-in-time build is removed so that the next process builds it again."""
    private = _library(tmp_path, "private", "-static-libstdc++")
    module = SimpleNamespace(__file__=str(private))
    for name in ("_status", "_module", "_level"):  # restored after the test
        monkeypatch.setattr(_native, name, getattr(_native, name))
    monkeypatch.delenv("QKV_NATIVE", raising=False)
    if how == "prebuilt":
        monkeypatch.setattr(_native, "_prebuilt", lambda build: (module, "prebuilt"))
    else:
        monkeypatch.setattr(_native, "_prebuilt", lambda build: (None, "no prebuilt"))
        monkeypatch.setattr(_native, "_compile", lambda build: module)
    assert _native._load.__wrapped__() is None
    assert _native._status.startswith("unavailable: private.so carries its own copy"), _native._status
    assert private.exists() == (how == "prebuilt")
