"""Helpers for the tests of qkv's compiled kernels (qkv/csrc/)."""

import os
import sys

import pytest

import deadline


def require_built(built: bool, what: str, status: str) -> None:
    """Skip the calling test module when ``what`` is not built here; fail it on CI, which has
    a compiler, so that a kernel that stops building is a failure there."""
    if built:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{what}: {status}", pytrace=False)
    pytest.skip(f"{what}: {status}", allow_module_level=True)


def other_levels() -> list[str]:
    """The kernel levels this CPU can run besides the one loaded by default (which the rest
    of the suite tests in-process): each is tested in a process of its own."""
    from qkv.kernels import _levels

    default = _levels.select_level("")[1]
    # with a build's extra instructions off (avx512_bf16 on an AMX CPU, avx2 on an AVX-VNNI
    # one) it is a level of its own
    return [name for name in _levels.runnable_names() if name != default]


_LEVEL_CHECK = """import os
from qkv.kernels._native import native_level, native_status
assert native_level() == os.environ["QKV_ISA"], (os.environ["QKV_ISA"], native_status())
# a level below amx forced on an AMX CPU runs as on a CPU without it: no oneDNN tiles either
assert native_level() == "amx" or "bf16 path: amx" not in native_status(), native_status()
"""


def assert_level_ok(script: str, level: str, **env: str) -> None:
    """Run ``script`` in a fresh process on kernel level ``level`` (``QKV_ISA``; the level is
    fixed per process; ``env`` added), checking first that this level is the one loaded; it
    must print ``ok`` as its last line."""
    assert_script_ok(_LEVEL_CHECK + script, QKV_ISA=level, **env)


def assert_script_ok(script: str, **env: str) -> None:
    """Run ``script`` in a fresh process with ``env`` added (settings the kernels read once per
    process); it must print ``ok`` as its last line."""
    res = deadline.run(
        [sys.executable, "-c", script], 600, f"a fresh process with {env or 'no settings'}",
        env=dict(os.environ, **env), capture_output=True, text=True,
    )  # fmt: skip
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]
