"""scripts/install-torch.sh picks the torch build as documented, against fake indexes on
127.0.0.1: PyTorch's CPU index when it answers; the plain pin, quickly, when it does not or
when pip's own configuration already gives a CPU build; the plain pin on purpose with
QKV_TORCH=cuda. The stub wheels hold one module, torch/_source.py, naming where they came
from; each case installs into a copy of one fresh virtual environment (no network)."""

import base64
import hashlib
import http.server
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "install-torch.sh"
PIN = "torch==2.13.0"
pytestmark = pytest.mark.skipif(os.name != "posix", reason="a bash script")


def stub_wheel(folder: Path, name: str, version: str, source: str, requires=()) -> str:
    """A pure-Python wheel ``name-version-py3-none-any.whl`` in ``folder``; returns its name."""
    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": "",
        f"{name}/_source.py": f"SOURCE = {source!r}\n",
        f"{dist_info}/METADATA": "Metadata-Version: 2.1\n"
        f"Name: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: qkv-tests\n"
        "Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    files[f"{dist_info}/RECORD"] = "\n".join(record + [f"{dist_info}/RECORD,,"]) + "\n"
    filename = f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(folder / filename, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return filename


def simple_index(root: Path, wheels: dict[str, list[str]]) -> None:
    """A PEP 503 index at ``root``: one page per project, linking to the served ``/files/``."""
    for project, filenames in wheels.items():
        (root / project).mkdir(parents=True)
        links = "".join(f'<a href="/files/{f.replace("+", "%2B")}">{f}</a>\n' for f in filenames)
        (root / project / "index.html").write_text(
            f"<!DOCTYPE html><html><body>\n{links}</body></html>\n"
        )


def template_venv(venv: Path) -> None:
    """A virtual environment with pip: the running pip copied in when there is one (a tenth
    of a second), else the standard library's (several seconds on a busy machine)."""
    try:
        import pip
    except ImportError:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        return
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    shutil.copytree(
        Path(pip.__file__).parent, Path(site) / "pip", ignore=shutil.ignore_patterns("__pycache__")
    )


class Quiet(http.server.SimpleHTTPRequestHandler):
    seen: list[str] = []

    def log_message(self, *args):
        Quiet.seen.append(self.path)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The served folder (fake PyPI under /pypi/simple/, fake CPU index under /cpu/), a
    find-links folder with a local +cpu wheel, and a template virtual environment."""
    top = tmp_path_factory.mktemp("install-torch")
    served, files, local = top / "served", top / "served" / "files", top / "local"
    files.mkdir(parents=True)
    local.mkdir()
    # fake PyPI: torch as on PyPI for Linux (a CUDA build: nvidia-* requirements), its deps
    pypi_torch = stub_wheel(
        files, "torch", "2.13.0", "pypi", ["filelock", "nvidia-cuda-runtime-cu13"]
    )
    filelock = stub_wheel(files, "filelock", "3.20.0", "pypi")
    nvidia = stub_wheel(files, "nvidia_cuda_runtime_cu13", "13.0.96", "pypi")
    simple_index(served / "pypi" / "simple", {
        "torch": [pypi_torch], "filelock": [filelock], "nvidia-cuda-runtime-cu13": [nvidia],
    })  # fmt: skip
    cpu_torch = stub_wheel(files, "torch", "2.13.0+cpu", "cpu-index", ["filelock"])
    simple_index(served / "cpu", {"torch": [cpu_torch]})
    stub_wheel(local, "torch", "2.13.0+cpu", "find-links", ["filelock"])

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), lambda *a: Quiet(*a, directory=str(served))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    silent = socket.socket()  # accepts connections (the kernel's backlog), never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)

    venv = top / "venv"
    template_venv(venv)
    yield {
        "url": f"http://127.0.0.1:{server.server_address[1]}",
        "silent": f"http://127.0.0.1:{silent.getsockname()[1]}/whl/cpu",
        "local": local,
        "venv": venv,
    }
    server.shutdown()
    silent.close()


def install(world, tmp_path, *, find_links=None, **qkv_env):
    """Run the script into a copy of the template venv with pip's configuration replaced by
    the fake indexes; returns (torch's source, its version, the script's stderr, seconds,
    the paths the server was asked for)."""
    venv = tmp_path / "venv"
    if not venv.exists():
        shutil.copytree(world["venv"], venv, symlinks=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "QKV_TORCH"))}
    env.update(
        PIP_CONFIG_FILE=os.devnull,  # no pip.conf of this machine's
        PIP_INDEX_URL=world["url"] + "/pypi/simple/",
        PIP_NO_CACHE_DIR="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        QKV_TORCH_CPU_INDEX=world["url"] + "/cpu/",
        no_proxy="127.0.0.1",
        NO_PROXY="127.0.0.1",
    )
    env.update(qkv_env)
    if find_links:
        env["PIP_FIND_LINKS"] = str(find_links)
    py = venv / "bin" / "python"
    Quiet.seen.clear()
    start = time.monotonic()
    r = subprocess.run(
        ["bash", str(SCRIPT), str(py), PIN], env=env, capture_output=True, text=True, timeout=120
    )
    took = time.monotonic() - start
    assert r.returncode == 0, r.stdout + r.stderr
    out = subprocess.run(
        [str(py), "-c", "import importlib.metadata as m, torch._source as s;"
         "print(s.SOURCE, m.version('torch'))"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    return out[0], out[1], r.stderr, took, list(Quiet.seen)


def installed(venv_parent: Path, name: str) -> bool:
    return bool(list((venv_parent / "venv" / "lib").glob(f"python3*/site-packages/{name}-*")))


def test_cpu_index_answers_gives_cpu_build(world, tmp_path):
    source, version, err, _, seen = install(world, tmp_path)
    assert (source, version) == ("cpu-index", "2.13.0+cpu"), err
    assert "installed: torch 2.13.0+cpu, the CPU build (from PyTorch's CPU index" in err
    assert any(p.startswith("/cpu/torch/") for p in seen)
    # torch alone came from the CPU index: its dependency from pip's usual index, no CUDA
    assert installed(tmp_path, "filelock")
    assert not installed(tmp_path, "nvidia_cuda_runtime_cu13")
    # again: kept, nothing asked of any index
    source, version, err, _, seen = install(world, tmp_path)
    assert (source, version) == ("cpu-index", "2.13.0+cpu"), err
    assert "the CPU build (already installed)" in err and not any("torch" in p for p in seen)


def test_cpu_index_unreachable_falls_back_quickly(world, tmp_path):
    source, version, err, took, _ = install(world, tmp_path, QKV_TORCH_CPU_INDEX=world["silent"])
    assert (source, version) == ("pypi", "2.13.0"), err
    assert "not reachable" in err and "warning: installing torch==2.13.0 from pip's usual" in err
    assert "a CUDA build" in err and "unreachable)" in err
    # a silent host costs the 5 s probe timeout, no more (the rest is pip on stub wheels)
    assert took < 20, took


def test_local_cpu_wheel_configured_is_used(world, tmp_path):
    source, version, err, _, seen = install(world, tmp_path, find_links=world["local"])
    assert (source, version) == ("find-links", "2.13.0+cpu"), err
    assert "pip's configured sources give the CPU build: file://" in err
    assert not any(p.startswith("/cpu/") for p in seen)  # the CPU index was never asked


def test_cuda_on_purpose_takes_the_plain_pin(world, tmp_path):
    source, version, err, _, seen = install(world, tmp_path, QKV_TORCH="cuda")
    assert (source, version) == ("pypi", "2.13.0"), err
    assert "installed: torch 2.13.0, a CUDA build (QKV_TORCH=cuda" in err
    assert installed(tmp_path, "nvidia_cuda_runtime_cu13")
    assert not any(p.startswith("/cpu/") for p in seen)
    # the default run afterwards keeps it, and says how to switch
    source, version, err, _, seen = install(world, tmp_path)
    assert (source, version) == ("pypi", "2.13.0"), err
    assert "a CUDA build (already installed, kept; QKV_TORCH=cpu asks for the CPU build" in err
    assert not any("torch" in p for p in seen)


def test_index_url_on_purpose(world, tmp_path):
    source, version, err, _, _ = install(world, tmp_path, QKV_TORCH=world["url"] + "/cpu/")
    assert (source, version) == ("cpu-index", "2.13.0+cpu"), err


def test_bad_setting_is_refused(tmp_path):
    r = subprocess.run(
        ["bash", str(SCRIPT), sys.executable, PIN],
        env={**os.environ, "QKV_TORCH": "gpu"}, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert r.returncode == 2 and "QKV_TORCH must be cpu, cuda or an index URL" in r.stderr
