"""Run a check script against the portable build of the fused kernels (plain C++ loops, what a
CPU without AVX-512 runs), in a fresh process: the build mode is fixed per process."""

import os
import subprocess
import sys


def assert_portable_ok(script: str) -> None:
    """``script`` must print ``ok`` as its last line under ``QKV_NATIVE_PORTABLE=1``."""
    env = dict(os.environ, QKV_NATIVE_PORTABLE="1")
    res = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]
