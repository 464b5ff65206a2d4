"""Builds qkv's C++ kernels when the package is built or installed (metadata: pyproject.toml).

Every source in src/qkv/csrc is compiled once per instruction-set level of this machine's
architecture (qkv/kernels/_levels.py) into the extension ``qkv._C_<level>``, stored as
``qkv/_C_<level>.kernels``; at run time qkv loads the best one the CPU supports, so using
qkv needs no compiler. The build runs against
the installed torch (``pip install --no-build-isolation``, as the Makefile does) and records
its version and the sources' digest in ``qkv/kernels/_built.json``.

``QKV_BUILD_LEVELS=avx2,portable`` builds only those levels (a quicker developer build; the
others are then compiled on first use, if a compiler is there).
"""

import contextlib
import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "src" / "qkv" / "csrc"


def _kernels_module(name: str):
    """qkv/kernels/<name>.py, loaded by path (qkv is not installed yet)."""
    spec = importlib.util.spec_from_file_location(f"_qkv{name}", ROOT / f"src/qkv/kernels/{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _minutes(seconds: float) -> str:
    s = round(seconds)
    return f"{s} s" if s < 60 else f"{s // 60} min {s % 60:02d} s"


@contextlib.contextmanager
def _progress(level: str, which: str, start: float, every: float = 30.0):
    """Say on stderr that ``level`` (``which``: "2 of 4") is compiling, how long it has taken
    every ``every`` s (and the whole build since ``start``), and when it is done: a level
    takes minutes. pip -q hides this; the Makefile builds the kernels in a step of its own."""

    def say(text):
        print(f"qkv: {text}", file=sys.stderr, flush=True)

    t0 = time.monotonic()
    say(f"compiling the kernels' level {level} ({which})")
    stop = threading.Event()

    def beat():
        while not stop.wait(every):
            now = time.monotonic()
            say(f"still compiling level {level} ({which}): {_minutes(now - t0)}, "
                f"{_minutes(now - start)} in all")  # fmt: skip

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    now = time.monotonic()
    say(f"level {level} ({which}) done in {_minutes(now - t0)}, {_minutes(now - start)} in all")


def _extensions():
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    L = _kernels_module("_levels")
    linkage = _kernels_module("_linkage")
    wanted = os.environ.get("QKV_BUILD_LEVELS")
    levels = L.levels_for_machine()
    if wanted:
        names = {w.strip() for w in wanted.split(",") if w.strip()}
        levels = [lv for lv in levels if lv.name in names]
    sources = [str(Path("src/qkv/csrc") / s) for s in L.SOURCES]
    exts = [
        CppExtension(
            f"qkv._C_{lv.name}",
            sources,
            extra_compile_args=[*L.COMMON_FLAGS, *lv.flags, f"-DQKV_LEVEL={lv.name}"],
            extra_link_args=list(L.LINK_FLAGS),
        )
        for lv in levels
    ]

    class Build(BuildExtension):
        def get_ext_filename(self, fullname):
            # qkv._C_<level> -> qkv/_C_<level>.kernels: a name no import machinery takes for a
            # module, so that nothing that walks the package (documentation tools, pkgutil)
            # loads a level this CPU cannot run; qkv loads the one it chooses by path
            # (called with the full dotted name and with its last part alone)
            name = super().get_ext_filename(fullname)
            last = fullname.rsplit(".", 1)[-1]
            if last.startswith("_C_"):
                return os.path.join(os.path.dirname(name), f"{last}.kernels")
            return name

        def finalize_options(self):
            super().finalize_options()
            # objects kept in the tree's build/ (editable installs would use a fresh temporary
            # directory): ninja then recompiles only the sources that changed
            self.build_temp = str(ROOT / "build" / "temp-qkv")

        def build_extension(self, ext):
            # one object directory per level: the levels compile the same files
            temp = self.build_temp
            self.build_temp = os.path.join(temp, ext.name.rsplit(".", 1)[-1])
            which = f"{self.extensions.index(ext) + 1} of {len(self.extensions)}"
            start = getattr(self, "_started", time.monotonic())
            try:
                with _progress(ext.name.rsplit("._C_", 1)[-1], which, start):
                    super().build_extension(ext)
            finally:
                self.build_temp = temp

        def _outs(self):  # where the libraries and _built.json go
            return {Path(self.build_lib), ROOT / "src"} if self.inplace else {Path(self.build_lib)}

        def _remove_built(self):
            for out in self._outs():
                for p in [*(out / "qkv").glob("_C_*"), out / "qkv/kernels/_built.json"]:
                    p.unlink(missing_ok=True)

        def run(self):
            # libraries an earlier build left under another name (build/lib is reused) must
            # not ship in a wheel beside the current ones
            for old in (Path(self.build_lib) / "qkv").glob("_C_*"):
                if old.suffix != ".kernels":
                    old.unlink()
            self._started = time.monotonic()
            super().run()
            for ext in self.extensions:
                if why := linkage.private_runtime(self.get_ext_fullpath(ext.name)):
                    self._remove_built()  # nothing left that a later import could load
                    raise SystemExit(f"qkv: build refused: {why}")
            libs = {ext.name.rsplit("._C_", 1)[-1]: Path(self.get_ext_fullpath(ext.name))
                    for ext in self.extensions}  # fmt: skip
            info = {
                "torch": torch.__version__,
                "sources": L.source_digest(CSRC),
                "levels": [lv.name for lv in levels],
                # checked before loading (both required): a damaged or truncated file is never
                # loaded (mapping one kills the process)
                "size": {name: path.stat().st_size for name, path in libs.items()},
                "sha256": {name: L.file_digest(path) for name, path in libs.items()},
            }
            for out in self._outs():
                target = out / "qkv" / "kernels" / "_built.json"
                if target.parent.is_dir():  # never a half-written record
                    tmp = target.with_name(target.name + ".tmp")
                    tmp.write_text(json.dumps(info, indent=1) + "\n")
                    os.replace(tmp, target)

    return exts, {"build_ext": Build.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
