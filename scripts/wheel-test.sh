#!/usr/bin/env bash
# Build qkv's wheel, install it into a fresh virtual environment with no compiler on PATH, and
# run the compiled kernels' tests against that install: using qkv must need no compiler.
# Needs .venv from `make venv` (torch and the test tools come from there; the wheel's build
# reuses build/temp-qkv, so only changed sources are recompiled).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$ROOT/.venv/bin/python
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

rm -rf dist
"$PY" -m pip wheel -q --no-build-isolation --no-deps -w dist .
WHEEL=$(ls dist/qkv-*.whl)
echo "wheel-test: built $WHEEL ($(du -h "$WHEEL" | cut -f1))"
"$PY" -c 'import sys, zipfile; [print("wheel-test:  ", n) for n in zipfile.ZipFile(sys.argv[1]).namelist() if n.endswith(".kernels")]' "$WHEEL"

python3 -m venv "$WORK/venv"
V=$WORK/venv/bin/python
"$V" -m pip install -q --no-deps --no-index "$WHEEL"
# the dependencies (torch, pytest, ...) from .venv, after the venv's own site-packages: qkv
# itself comes from the wheel (a path added this way does not run .venv's editable hook)
SITE=$("$V" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$SITE/qkv-deps.pth"

# the tests, away from the source tree (nothing of src/ on the path), with no compiler: PATH
# holds the fresh venv's bin/ alone
cp -r tests "$WORK/tests"
cp pyproject.toml "$WORK/"  # the pytest settings (markers; pythonpath: the helpers in tests/)
cd "$WORK"
(
export PATH=$WORK/venv/bin CC=/nonexistent/cc CXX=/nonexistent/c++
export TORCH_EXTENSIONS_DIR=$WORK/torch_extensions  # an empty build cache
python - <<'PY'
import shutil

import qkv
from qkv.kernels._native import native_status

status = native_status()
print("wheel-test:", qkv.__file__)
print("wheel-test:", status)
assert shutil.which("c++") is None and shutil.which("gcc") is None
assert "site-packages" in qkv.__file__ and "(prebuilt)" in status, status
PY
python -m pytest -q -p no:cacheprovider tests/kernels/test_levels.py \
    tests/kernels/test_flash_native.py tests/kernels/test_decode.py tests/kernels/test_kv_int8.py \
    tests/kernels/test_int8.py tests/kernels/test_step_kernels.py \
    tests/kernels/test_flash_variants.py
)
