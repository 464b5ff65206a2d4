#!/usr/bin/env bash
# Run qkv's kernel tests on its Arm level (aarch64, NEON) on an x86-64 machine, under QEMU's
# user-mode emulation: an aarch64 Debian (bookworm, Python 3.11), an aarch64 torch from PyPI,
# the kernels cross-compiled by scripts/arm_build.py, the tests run by that Python.
#
#   scripts/arm-test.sh                      # tests/kernels, 2 workers (~15 min on 2 cores)
#   scripts/arm-test.sh tests/kernels/test_decode.py -k fp64    # pytest's arguments
#
# Correctness only: emulated time says nothing about an Arm CPU's speed. Everything is kept
# in $QKV_ARM_DIR (default ~/.cache/qkv-arm, ~1.3 GB) and reused. The first run needs root
# (apt-get: qemu-user, debootstrap, the cross compiler; binfmt_misc, so that the tests'
# subprocesses run emulated too) and the package registries (Debian's and PyPI).
# Needs .venv from `make venv` (its Python runs the build).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$ROOT/.venv/bin/python
DIR=${QKV_ARM_DIR:-$HOME/.cache/qkv-arm}
# the newest torch on PyPI whose aarch64 wheel is a CPU build (later ones need CUDA's libraries)
TORCH_ARM=2.10.0
mkdir -p "$DIR"

need=()
command -v qemu-aarch64 >/dev/null 2>&1 || need+=(qemu-user)
command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || need+=(debootstrap)
command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 || need+=(g++-aarch64-linux-gnu)
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "arm-test: missing ${need[*]}: install them (Debian: apt-get install ${need[*]})" >&2
        exit 1
    fi
    echo "arm-test: installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# an aarch64 Debian to run: debootstrap's first stage downloads the packages, which are
# unpacked as they are (no maintainer scripts: nothing aarch64 runs during the setup)
ROOTFS=$DIR/rootfs
if [ ! -x "$ROOTFS/usr/bin/python3.11" ]; then
    echo "arm-test: making an aarch64 Debian in $ROOTFS"
    rm -rf "$ROOTFS.tmp"
    /usr/sbin/debootstrap --foreign --arch=arm64 --variant=minbase --include=python3 bookworm \
        "$ROOTFS.tmp" http://deb.debian.org/debian >/dev/null
    for deb in "$ROOTFS.tmp"/var/cache/apt/archives/*.deb; do dpkg-deb -x "$deb" "$ROOTFS.tmp"; done
    rm -rf "$ROOTFS" && mv "$ROOTFS.tmp" "$ROOTFS"
fi
export QEMU_LD_PREFIX=$ROOTFS  # where the emulated programs find their loader and libraries

# binfmt_misc runs aarch64 programs through QEMU (the tests start Python subprocesses):
# an aarch64 ELF executable's header, unless a handler for it is registered already
BINFMT=/proc/sys/fs/binfmt_misc
[ -e $BINFMT/register ] || mount -t binfmt_misc binfmt_misc $BINFMT
if ! grep -qs "^magic 7f454c460201010000000000000000000200b700" $BINFMT/*; then
    magic='\x7f\x45\x4c\x46\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00'
    mask='\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff'
    echo ":qkv-aarch64:M::$magic:$mask:$(command -v qemu-aarch64):" > $BINFMT/register
fi

# aarch64 wheels into one folder (pip's --platform; the dependencies named, since pip would
# read torch's markers for this x86-64 machine); made again when this list changes
SITE=$DIR/site-torch-$TORCH_ARM
WANT="torch==$TORCH_ARM filelock typing-extensions sympy networkx jinja2 fsspec numpy safetensors
      tqdm rich tokenizers transformers setuptools pytest pytest-xdist hypothesis"
if [ "$(cat "$SITE/.packages" 2>/dev/null)" != "$(echo $WANT)" ]; then
    echo "arm-test: aarch64 torch $TORCH_ARM and the test tools into $SITE"
    rm -rf "$SITE.tmp"
    plat=(--only-binary=:all: --python-version 311 --implementation cp
          --platform manylinux_2_28_aarch64 --platform manylinux_2_17_aarch64
          --platform manylinux2014_aarch64)
    "$PY" -m pip install -q --no-warn-script-location --target "$SITE.tmp" "${plat[@]}" \
        --no-deps "torch==$TORCH_ARM"
    # shellcheck disable=SC2086
    "$PY" -m pip install -q --no-warn-script-location --target "$SITE.tmp" "${plat[@]}" \
        ${WANT#torch==$TORCH_ARM}
    echo $WANT > "$SITE.tmp/.packages"
    rm -rf "$SITE" && mv "$SITE.tmp" "$SITE"
fi

"$PY" scripts/arm_build.py --torch-dir "$SITE" --out "$DIR/pkg-$TORCH_ARM"

export PYTHONPATH=$DIR/pkg-$TORCH_ARM:$SITE HF_HUB_OFFLINE=1
ARMPY=$ROOTFS/usr/bin/python3.11
"$ARMPY" - <<'PY'
import platform

import torch

from qkv.kernels._native import native_status

status = native_status()
print(f"arm-test: {platform.machine()}, torch {torch.__version__}: {status}")
assert platform.machine() == "aarch64" and "level neon (prebuilt)" in status, status
PY
# tests/kernels unless the arguments name tests of their own
paths=(tests/kernels)
for a in "$@"; do [[ $a == tests* ]] && paths=(); done
export QKV_HYPOTHESIS_PROFILE=${QKV_HYPOTHESIS_PROFILE:-qkv-emulated}  # tests/conftest.py
exec "$ARMPY" -m pytest -q -p no:cacheprovider -n 2 "$@" "${paths[@]}"
