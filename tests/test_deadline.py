"""tests/deadline.py: waits stretched by the load, a saturated machine skips, an idle one fails."""

from __future__ import annotations

import sys

import pytest

import deadline


def test_scale_follows_the_load_and_the_environment(monkeypatch):
    monkeypatch.delenv(deadline.ENV, raising=False)
    monkeypatch.setattr(deadline, "load_per_cpu", lambda: 0.3)
    assert deadline.scale() == 1.0 and deadline.scaled(30) == 30
    monkeypatch.setattr(deadline, "load_per_cpu", lambda: 2.5)
    assert deadline.scaled(30) == 75
    monkeypatch.setenv(deadline.ENV, "0.5")
    assert deadline.scale() == 0.5
    for bad in ("0", "-1", "fast"):
        monkeypatch.setenv(deadline.ENV, bad)
        with pytest.raises(ValueError, match=deadline.ENV):
            deadline.scale()


def test_time_counts_slower_while_the_machine_is_busy(monkeypatch):
    monkeypatch.delenv(deadline.ENV, raising=False)
    clock = [100.0]
    monkeypatch.setattr(deadline.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(deadline, "load_per_cpu", lambda: 4.0)
    d = deadline.Deadline(10, "something")
    clock[0] += 39
    assert not d.expired()  # 39 s at scale 4: 9.75 quiet seconds
    monkeypatch.setattr(deadline, "load_per_cpu", lambda: 0.5)
    clock[0] += 0.25
    assert d.expired() and d.max_scale == 4.0


def _cpu(idle_share: float):
    """A fake /proc/stat reader: 1000 more jiffies per call, ``idle_share`` of them idle."""
    state = [0, 0]

    def read():
        state[0] += int(1000 * idle_share)
        state[1] += 1000
        return tuple(state)

    return read


@pytest.mark.parametrize("idle,outcome", [(0.02, pytest.skip.Exception),
                                          (0.9, pytest.fail.Exception)])  # fmt: skip
def test_giving_up_skips_when_saturated_and_fails_when_idle(monkeypatch, idle, outcome):
    monkeypatch.delenv(deadline.ENV, raising=False)
    monkeypatch.setattr(deadline, "_cpu_times", _cpu(idle))
    with pytest.raises(outcome) as e:
        deadline.wait_until(lambda: False, 0.05, "a file that never comes",
                            detail=lambda: "rank 1 alive")  # fmt: skip
    msg = str(e.value)
    assert "gave up waiting for a file that never comes" in msg and "rank 1 alive" in msg
    assert f"CPU idle {idle:.0%}" in msg


def test_a_scale_set_by_hand_never_skips(monkeypatch):
    monkeypatch.setenv(deadline.ENV, "1")
    monkeypatch.setattr(deadline, "_cpu_times", _cpu(0.0))
    with pytest.raises(pytest.fail.Exception, match="scale 1 from QKV_TEST_TIMEOUT_SCALE"):
        deadline.wait_until(lambda: False, 0.05, "nothing")


def test_run_says_what_ran_and_how_its_output_ends(monkeypatch):
    monkeypatch.setenv(deadline.ENV, "1")
    code = "import sys, time; print('started', flush=True); time.sleep(30)"
    with pytest.raises(pytest.fail.Exception) as e:
        deadline.run([sys.executable, "-c", code], 2, "a sleeper", capture_output=True,
                     text=True)  # fmt: skip
    assert "gave up waiting for a sleeper" in str(e.value) and "started" in str(e.value)
    ok = deadline.run([sys.executable, "-c", "print('hi')"], 60, "a greeter",
                      capture_output=True, text=True)  # fmt: skip
    assert ok.stdout.strip() == "hi"
