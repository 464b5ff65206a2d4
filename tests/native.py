"""Helpers for the tests of qkv's compiled kernels (qkv/csrc/)."""

import os
import subprocess
import sys

import pytest


def require_built(built: bool, what: str, status: str) -> None:
    """Skip the calling test module when ``what`` is not built here; fail it on CI, which has
    a compiler, so that a kernel that stops building is a failure there."""
    if built:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{what}: {status}", pytrace=False)
    pytest.skip(f"{what}: {status}", allow_module_level=True)


def assert_portable_ok(script: str) -> None:
    """Run ``script`` against the portable build (plain C++ loops, what a CPU without AVX-512
    runs) in a fresh process, the build mode being fixed per process; under
    ``QKV_NATIVE_PORTABLE=1`` it must print ``ok`` as its last line."""
    assert_script_ok(script, QKV_NATIVE_PORTABLE="1")


def assert_script_ok(script: str, **env: str) -> None:
    """Run ``script`` in a fresh process with ``env`` added (settings the kernels read once per
    process); it must print ``ok`` as its last line."""
    res = subprocess.run(
        [sys.executable, "-c", script], env=dict(os.environ, **env), capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]
