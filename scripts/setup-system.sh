#!/usr/bin/env bash
# System packages the inspection tools need: Debian's chromium (the viewer's browser test)
# and Noto fonts (plot labels in any script); node and npm (ONNX Runtime Web for the static
# site and its tests); and the aarch64 cross compiler for one test.
# Idempotent: installs only what is missing, and does nothing (with a note) when not root or
# without apt-get.
set -euo pipefail
need=()
command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ] || need+=(chromium)
command -v npm >/dev/null 2>&1 || need+=(nodejs npm)
# g++-aarch64-linux-gnu: the tests cross-compile the kernels' Arm level (no Arm machine here)
for pkg in fonts-noto-core fonts-noto-cjk g++-aarch64-linux-gnu; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
if [ ${#need[@]} -eq 0 ]; then
    echo "setup-system: chromium, node, Noto fonts and the aarch64 cross compiler already present"
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "setup-system: missing ${need[*]}; run as root on Debian/Ubuntu to install (skipping)" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}"
fc-cache -f >/dev/null 2>&1 || true
echo "setup-system: installed ${need[*]}"
