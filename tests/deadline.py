"""Deadlines for tests that wait on other processes or on files, scaled to how busy the machine is.

A fixed timeout that suits a quiet machine turns a loaded laptop (a browser open, a build
running) into a row of "hung" failures. Here a wait is given ``base`` seconds of a quiet
machine's time: while the 1-minute load average per CPU is above 1, time counts slower by
that factor (re-read as the wait goes on). ``QKV_TEST_TIMEOUT_SCALE`` fixes the factor
instead (e.g. ``3`` on a slow emulator, ``1`` to measure).

When a wait still runs out, :meth:`Deadline.give_up` says what it was waiting for, how long,
and how busy the machine was. If the CPUs had no idle time to speak of during the wait, the
test is skipped (a starved process is not a hang); if they were idle, nothing was computing,
so it is a real hang and the test fails.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from typing import NoReturn

import pytest

ENV = "QKV_TEST_TIMEOUT_SCALE"
BUSY_IDLE = 0.1  # below this share of idle CPU time over a wait, the machine was saturated


def load_per_cpu() -> float:
    """The 1-minute load average per CPU (0 where the OS has none)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (AttributeError, OSError):
        return 0.0


def scale() -> float:
    """How much longer than on a quiet machine waits may take now: ``QKV_TEST_TIMEOUT_SCALE``
    if set, else ``max(1, load average / CPUs)``."""
    env = os.environ.get(ENV)
    if env:
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"{ENV} must be a number > 0, got {env!r}") from None
        if not value > 0:
            raise ValueError(f"{ENV} must be a number > 0, got {env!r}")
        return value
    return max(1.0, load_per_cpu())


def scaled(base: float) -> float:
    """``base`` seconds on a quiet machine, in seconds now (for timeouts handed to a child)."""
    return base * scale()


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies of all CPUs since boot, from /proc/stat (Linux); else None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[3] + fields[4], sum(fields[:8])  # idle + iowait; user..steal


class Deadline:
    """``base`` seconds of quiet-machine time, for a wait on ``what``.

    >>> d = Deadline(30, "rank 0's result")
    >>> while not done() and not d.expired():  # doctest: +SKIP
    ...     time.sleep(0.1)
    """

    def __init__(self, base: float, what: str) -> None:
        self.base, self.what = base, what
        self.start = self._last = time.monotonic()
        self.used = 0.0  # quiet-machine seconds spent so far
        self.max_scale = scale()
        self._cpu0 = _cpu_times()

    def expired(self) -> bool:
        """Count the time since the last call at the current scale; True once it is spent."""
        now = time.monotonic()
        s = scale()
        self.max_scale = max(self.max_scale, s)
        self.used += (now - self._last) / s
        self._last = now
        return self.used >= self.base

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def idle_share(self) -> float | None:
        """The share of CPU time that was idle since the wait began (None: unknown)."""
        now = _cpu_times()
        if now is None or self._cpu0 is None or now[1] == self._cpu0[1]:
            return None
        return (now[0] - self._cpu0[0]) / (now[1] - self._cpu0[1])

    def busy(self) -> bool:
        """Whether the machine was saturated during the wait: idle CPU time under
        ``BUSY_IDLE`` (or, without /proc/stat, a load average above the CPU count)."""
        if os.environ.get(ENV):
            return False  # the timeouts were set by hand: running out is a failure
        idle = self.idle_share()
        return self.max_scale > 1.0 if idle is None else idle < BUSY_IDLE

    def report(self, detail: str = "") -> str:
        idle = self.idle_share()
        idle_s = "unknown" if idle is None else f"{idle:.0%}"
        how = (
            f"scale {self.max_scale:g} from {ENV}" if os.environ.get(ENV)
            else f"load scale up to {self.max_scale:.1f} ({ENV} sets it)"
        )  # fmt: skip
        msg = (
            f"gave up waiting for {self.what} after {self.elapsed():.0f} s "
            f"({self.base:g} s of a quiet machine; {how}; load average "
            f"{load_per_cpu() * (os.cpu_count() or 1):.1f} on {os.cpu_count()} CPUs, "
            f"CPU idle {idle_s})"
        )
        return f"{msg}: {detail}" if detail else msg

    def give_up(self, detail: str = "") -> NoReturn:
        """Skip the test if the machine was too busy to tell a hang from slowness, else fail."""
        if self.busy():
            pytest.skip("machine too busy: " + self.report(detail))
        pytest.fail(self.report(detail), pytrace=False)


def wait_until(
    done: Callable[[], bool],
    base: float,
    what: str,
    detail: Callable[[], str] = lambda: "",
    poll: float = 0.1,
) -> float:
    """Poll ``done()`` until true; give up (skip or fail, see :meth:`Deadline.give_up`) after
    ``base`` quiet-machine seconds, with ``detail()`` in the message. Returns the seconds
    waited."""
    d = Deadline(base, what)
    while not done():
        if d.expired():
            d.give_up(detail())
        time.sleep(poll)
    return d.elapsed()


def run(cmd: list[str], base: float, what: str, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, **kwargs)`` with a timeout of ``base`` quiet-machine seconds,
    scaled by the load when it starts; past it, skip or fail as :meth:`Deadline.give_up`,
    saying ``what`` ran and how its output ends."""
    wait = Deadline(base, what)
    try:
        return subprocess.run(cmd, timeout=base * wait.max_scale, **kwargs)
    except subprocess.TimeoutExpired as e:
        out = e.stderr or e.output or ""
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
        wait.give_up(f"{cmd[0]} killed; its output ends:\n{out[-1500:] or '(nothing)'}")
