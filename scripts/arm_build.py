"""Cross-compile qkv's kernels for aarch64 (the ``neon`` level) on an x86-64 machine.

``python scripts/arm_build.py --torch-dir SITE --out DIR`` compiles every kernel source with
Debian's ``aarch64-linux-gnu-g++`` and the neon level's flags (``qkv/kernels/_levels.py``,
as ``setup.py`` would on an Arm machine), links them against the aarch64 torch installed in
``SITE``, and writes a copy of the package to ``DIR/qkv`` holding that build as its prebuilt
``_C_neon.kernels`` (with the ``_built.json`` record ``setup.py`` writes; objects are kept
in ``DIR/build``). Used by ``scripts/arm-test.sh`` (the kernel tests under QEMU) and,
compile step only, by the tests.
It reads qkv's files by path and imports neither qkv nor torch.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import runpy
import shutil
import subprocess
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "qkv"
CXX = "aarch64-linux-gnu-g++"


@functools.cache
def _levels() -> SimpleNamespace:
    """qkv/kernels/_levels.py, run by path (it imports nothing from qkv or torch)."""
    return SimpleNamespace(**runpy.run_path(str(PACKAGE / "kernels" / "_levels.py")))


def compile_command(source: str, out: Path, torch_include: list[str]) -> list[str]:
    """The command that compiles one kernel source to an aarch64 object: the neon level's
    flags, torch's headers from ``torch_include``, this Python's own headers (the C API of
    one Python version is the same on every 64-bit Linux)."""
    L = _levels()
    neon = next(lv for lv in L.LEVELS if lv.machine == "aarch64")
    includes = [*torch_include, sysconfig.get_paths()["include"]]
    return [CXX, "-c", "-fPIC", "-std=c++17", *L.COMMON_FLAGS, *neon.flags,
            f"-DQKV_LEVEL={neon.name}", f"-DTORCH_EXTENSION_NAME=_C_{neon.name}",
            "-DTORCH_API_INCLUDE_EXTENSION_H", "-D_GLIBCXX_USE_CXX11_ABI=1",
            *(f"-isystem{p}" for p in includes), str(PACKAGE / "csrc" / source),
            "-o", str(out)]  # fmt: skip


def compile_all(objdir: Path, torch_include: list[str]) -> list[Path]:
    """Every kernel source to ``objdir/<source>.o``, two at a time, each within 10 min; an
    error names the file."""
    L = _levels()
    objdir.mkdir(parents=True, exist_ok=True)
    objs = [objdir / f"{s}.o" for s in L.SOURCES]

    def one(pair):
        source, obj = pair
        return source, subprocess.run(compile_command(source, obj, torch_include),
                                      capture_output=True, text=True, timeout=600)  # fmt: skip

    with ThreadPoolExecutor(2) as pool:
        for source, res in pool.map(one, zip(L.SOURCES, objs)):
            if res.returncode != 0:
                raise SystemExit(f"arm_build: {source} does not compile:\n{res.stderr[-4000:]}")
    return objs


def _torch_version(site: Path) -> str:
    text = (site / "torch" / "version.py").read_text()
    return re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", text, re.M).group(1)


def build(site: Path, out: Path) -> Path:
    """``out/qkv``: a fresh copy of the package holding the neon build. The kernels are
    compiled again only when the sources or the torch differ from the last build's."""
    L = _levels()
    digest = L.source_digest(PACKAGE / "csrc")
    version = _torch_version(site)
    kernels, record = out / "build" / "_C_neon.kernels", out / "build" / "_built.json"
    info = json.loads(record.read_text()) if record.exists() else {}
    if ((info.get("sources"), info.get("torch")) == (digest, version) and kernels.exists()
            and "size" in info):  # (a record without a size: from before the loader needed it)
        print(f"arm_build: kernels up to date (sources {digest}, torch {version})")
    else:
        t0 = time.time()
        record.unlink(missing_ok=True)  # no record: a build cut short is never taken as current
        objs = compile_all(out / "build" / "obj", [
            str(site / "torch/include"), str(site / "torch/include/torch/csrc/api/include")])
        subprocess.run([CXX, "-shared", *L.LINK_FLAGS, *map(str, objs), f"-L{site / 'torch/lib'}",
                        "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", "-o", str(kernels)],
                       check=True)  # fmt: skip
        info = {"torch": version, "sources": digest, "levels": ["neon"],
                "size": {"neon": kernels.stat().st_size},  # the loader requires both
                "sha256": {"neon": L.file_digest(kernels)}}  # fmt: skip
        record.write_text(json.dumps(info, indent=1) + "\n")
        print(f"arm_build: neon kernels for torch {version} in {time.time() - t0:.0f} s")
    staged = out / "qkv.tmp"
    shutil.rmtree(staged, ignore_errors=True)
    shutil.copytree(PACKAGE, staged, ignore=shutil.ignore_patterns("_C_*.kernels", "__pycache__",
                                                                   "_built.json"))  # fmt: skip
    shutil.copy2(kernels, staged / kernels.name)
    shutil.copy2(record, staged / "kernels" / "_built.json")
    shutil.rmtree(out / "qkv", ignore_errors=True)
    staged.rename(out / "qkv")
    print(f"arm_build: the package with its neon kernels -> {out / 'qkv'}")
    return out / "qkv"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--torch-dir", type=Path, required=True,
                    help="site-packages folder holding an aarch64 torch")
    ap.add_argument("--out", type=Path, required=True, help="folder for the package copy")
    args = ap.parse_args(argv)
    if not (args.torch_dir / "torch" / "version.py").is_file():
        ap.error(f"--torch-dir: expected a folder holding torch/, got {args.torch_dir}")
    if shutil.which(CXX) is None:
        ap.error(f"{CXX} not found (Debian: apt-get install g++-aarch64-linux-gnu)")
    build(args.torch_dir, args.out)


if __name__ == "__main__":
    main()
