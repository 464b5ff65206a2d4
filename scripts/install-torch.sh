#!/usr/bin/env bash
# Install PyTorch into a Python environment: the CPU build unless asked otherwise.
#
#   bash scripts/install-torch.sh PYTHON [torch==VERSION [PACKAGE...]]
#
# (the Makefile: `bash scripts/install-torch.sh .venv/bin/python torch==2.13.0 setuptools ninja`)
#
# A plain `pip install torch==2.13.0` gives, on Linux from PyPI, the CUDA build (triton, the
# CUDA toolkit, cuDNN, NCCL: several GB). So, with QKV_TORCH=cpu (the default):
#   1. when pip's own configuration already resolves the pin to a CPU build (a local +cpu
#      wheel in find-links, a mirror of PyTorch's CPU index, or macOS/Windows, whose PyPI
#      wheels carry no CUDA), that is what gets installed;
#   2. otherwise torch alone comes from PyTorch's CPU index (QKV_TORCH_CPU_INDEX, default
#      https://download.pytorch.org/whl/cpu), asked first whether it answers within 5 s;
#   3. when it does not answer, the plain pin from pip's usual sources, with a warning.
# QKV_TORCH=cuda installs the plain pin on purpose (on Linux from PyPI: the CUDA build);
# QKV_TORCH=URL takes torch from that index (e.g. https://download.pytorch.org/whl/cuXYZ),
# with no fallback. Everything else (torch's own dependencies, the PACKAGEs) comes from pip's
# usual sources. A torch already installed that satisfies the pin is kept, whatever its build
# (the script says which build it is, and how to switch). The last line names the build.
set -euo pipefail
PY=${1:?usage: install-torch.sh PYTHON [torch==VERSION [PACKAGE...]]}
shift
REQ=${1:-torch==2.13.0}
shift || true
MODE=${QKV_TORCH:-cpu}
CPU_INDEX=${QKV_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
PROBE_S=5
say() { echo "install-torch: $*" >&2; }
case $REQ in torch|torch[=\<\>~!\ ]*) ;; *) say "the first package must be torch (got '$REQ')"; exit 2 ;; esac
case $MODE in
    cpu | cuda | http://* | https://* | file://*) ;;
    *) say "QKV_TORCH must be cpu, cuda or an index URL (got '$MODE')"; exit 2 ;;
esac
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# "VERSION BUILD" of the torch that a pip --report (argument) resolved, or of the installed one
# (no argument; nothing printed when none satisfies REQ). BUILD: cpu, cuda, or the local
# version label (rocm6.4, ...): a label says it; without one, requirements on triton,
# nvidia-* or cuda-* (cuda-toolkit) mean the CUDA build (PyPI's Linux wheels), none a CPU build.
torch_build() {
    "$PY" - "$REQ" "$@" <<'PY'
import json, re, sys
from importlib import metadata

def build(version, requires):
    label = version.partition("+")[2]
    if label:
        return "cpu" if label.startswith("cpu") else "cuda" if re.match(r"cu\d", label) else label
    names = {re.split(r"[\s;<>=!~\[(]", r, maxsplit=1)[0].lower() for r in requires or ()}
    cuda = "triton" in names or any(n.startswith(("nvidia-", "cuda-")) for n in names)
    return "cuda" if cuda else "cpu"

if len(sys.argv) > 2:  # a report: the torch it would install
    for item in json.load(open(sys.argv[2]))["install"]:
        m = item["metadata"]
        if m["name"].lower() == "torch":
            print(m["version"], build(m["version"], m.get("requires_dist")),
                  item["download_info"]["url"])
    sys.exit()
try:
    dist = metadata.distribution("torch")
except metadata.PackageNotFoundError:
    sys.exit()
try:
    from pip._vendor.packaging.requirements import Requirement
    ok = Requirement(sys.argv[1]).specifier.contains(dist.version, prereleases=True)
except Exception:  # pip without its vendored packaging: let pip decide
    ok = False
if ok:
    print(dist.version, build(dist.version, dist.requires))
PY
}

# 0 when URL's page for torch answers within PROBE_S seconds (file:// URLs: the folder exists)
index_answers() {
    "$PY" - "$1" "$PROBE_S" <<'PY'
import os, sys, urllib.parse, urllib.request

url, timeout = sys.argv[1].rstrip("/") + "/torch/", float(sys.argv[2])
if url.startswith("file:"):
    sys.exit(0 if os.path.isdir(urllib.request.url2pathname(urllib.parse.urlparse(url).path)) else 1)
try:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        r.read(1)
except Exception as e:
    print(f"install-torch: {sys.argv[1]} not reachable ({e}; waited at most {timeout:g} s)",
          file=sys.stderr)
    sys.exit(1)
PY
}

describe() {  # VERSION BUILD -> words
    case $2 in
        "") echo "no torch that satisfies $REQ (pip --dry-run?)" ;;
        cpu) echo "torch $1, the CPU build" ;;
        cuda) echo "torch $1, a CUDA build" ;;
        *) echo "torch $1, the $2 build" ;;
    esac
}

finish() {  # install the rest from pip's usual sources, then say what torch is there
    "$PY" -m pip install -q "$REQ" "$@"
    read -r version build < <(torch_build) || true
    say "installed: $(describe "$version" "$build") ($ROUTE)"
}

if read -r version build < <(torch_build) && [ -n "${version:-}" ]; then
    want=$MODE
    case $MODE in http* | file*) want=$build ;; esac  # an index of the user's: any build
    if [ "$build" = "$want" ]; then
        ROUTE="already installed"
    else
        ROUTE="already installed, kept; QKV_TORCH=$MODE asks for the ${want^^} build: to switch, \
$PY -m pip uninstall -y torch and run this again"
    fi
    finish "$@"
    exit
fi

case $MODE in
    cuda)
        ROUTE="QKV_TORCH=cuda: the plain pin from pip's usual sources"
        ;;
    http* | file*)
        "$PY" -m pip install -q --no-deps --index-url "$MODE" "$REQ"
        ROUTE="QKV_TORCH: from $MODE"
        ;;
    cpu)
        # 1. what pip's own configuration resolves the pin to (metadata only, no download
        # where the index serves it apart, as PyPI does)
        resolved=""
        if "$PY" -m pip install -q --dry-run --ignore-installed --no-deps --timeout "$PROBE_S" \
                --retries 0 --report "$TMP/report.json" "$REQ" >"$TMP/dry-run.log" 2>&1; then
            resolved=$(torch_build "$TMP/report.json")
        else
            say "pip could not resolve $REQ from its configured sources: $(tail -n 1 "$TMP/dry-run.log")"
        fi
        read -r r_version r_build r_url <<<"$resolved" || true
        if [ "${r_build:-}" = cpu ]; then
            ROUTE="pip's configured sources give the CPU build: ${r_url:-}"
        elif index_answers "$CPU_INDEX"; then
            if "$PY" -m pip install -q --no-deps --index-url "$CPU_INDEX" "$REQ"; then
                ROUTE="from PyTorch's CPU index $CPU_INDEX"
            else
                say "warning: $CPU_INDEX answered but installing $REQ from it failed"
                ROUTE="the plain pin from pip's usual sources: $CPU_INDEX failed"
            fi
        else
            what="likely a CUDA build"
            [ "${r_build:-}" = cuda ] && what="torch $r_version, a CUDA build"
            say "warning: installing $REQ from pip's usual sources instead: on Linux" \
                "$what (several GB). For the CPU build, make $CPU_INDEX reachable or set" \
                "QKV_TORCH_CPU_INDEX to a mirror of it"
            ROUTE="the plain pin from pip's usual sources: $CPU_INDEX unreachable"
        fi
        ;;
esac
finish "$@"
