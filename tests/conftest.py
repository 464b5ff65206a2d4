"""Hypothesis settings for the whole suite, set once here (a profile loaded by a test module
would hold for every module collected with it)."""

import os

from hypothesis import HealthCheck, settings

# derandomized: a failing case comes back on every run and machine; no deadline: a kernel
# call's time depends on the machine and its load
settings.register_profile("qkv", deadline=None, max_examples=60, derandomize=True)
# under emulation (scripts/arm-test.sh) drawing an input takes ~30x longer than Hypothesis's
# health check allows
settings.register_profile("qkv-emulated", parent=settings.get_profile("qkv"),
                          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
# CI's Arm subset (scripts/arm-test.sh --ci): the same checks on fewer drawn inputs (a test
# that sets its own max_examples keeps it)
settings.register_profile("qkv-emulated-ci", parent=settings.get_profile("qkv-emulated"),
                          max_examples=10)  # fmt: skip
settings.load_profile(os.environ.get("QKV_HYPOTHESIS_PROFILE", "qkv"))
