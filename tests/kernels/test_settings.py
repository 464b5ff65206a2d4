"""The QKV_* settings: a bad value is one clear error (the variable and the values it takes),
raised by the calls that read it and by no other: the kernels' status and an fp32 prefill
never read QKV_DECODE_*; a decode over the cache whose setting it is does."""

import os
import re
import sys

import pytest

import deadline
from qkv.kernels import _native, _settings
from qkv.kernels._settings import SettingError


@pytest.mark.parametrize("name", list(_settings.SETTINGS))
def test_a_bad_value_names_the_variable_and_its_values(monkeypatch, name):
    accepted = _settings.SETTINGS[name]
    monkeypatch.delenv(name, raising=False)
    assert _settings.value(name) == accepted[0]
    monkeypatch.setenv(name, "")  # empty: the default, as unset
    assert _settings.value(name) == accepted[0]
    for good in accepted:
        monkeypatch.setenv(name, good)
        assert _settings.value(name) == good
    for bad in ("fast", " auto", accepted[-1].upper() if accepted[-1].isalpha() else "2"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(SettingError) as e:
            _settings.value(name)
        want = f"{name} must be {', '.join(accepted[:-1])} or {accepted[-1]}; got {bad!r}"
        assert str(e.value) == want and isinstance(e.value, ValueError)
        assert (e.value.name, e.value.value) == (name, bad)


def test_the_table_takes_what_the_kernels_take():
    """The kernels parse QKV_BF16_MATMUL and QKV_DECODE_* themselves: the table must list
    the same values in the same order (the first is the default)."""
    csrc = _native.CSRC
    if not csrc.is_dir():
        pytest.skip("no kernel sources beside this install")
    decode = "".join(p.read_text() for p in sorted(csrc.glob("decode_*")))  # .cpp and its .h
    found = dict(re.findall(r'path_setting\("(QKV_DECODE_\w+)", \{([^}]*)\}\)', decode))
    assert sorted(found) == ["QKV_DECODE_BF16", "QKV_DECODE_FP32", "QKV_DECODE_INT8"]
    for name, values in found.items():
        assert tuple(re.findall(r'"(\w+)"', values)) == _settings.SETTINGS[name], name
    flash = (csrc / "flash_bf16.h").read_text()  # bf16_path
    said = re.search(r'"QKV_BF16_MATMUL must be ([^;]*); got', flash).group(1)
    assert tuple(re.split(r", | or ", said)) == _settings.SETTINGS["QKV_BF16_MATMUL"]


# In a process of its own (the kernels read QKV_DECODE_* once per process): the status,
# an fp32 prefill on the fused kernel, then a decode over each cache dtype, by the decode
# kernel's two entries (decode_attention, and "auto" dispatch's prepared call for one query)
_CALLS = """
import sys
import torch
from qkv.cache import quantize_rows
from qkv.functional import scaled_dot_product_attention as sdpa
from qkv.kernels._native import decode_ops, native_status
from qkv.kernels._settings import SettingError
from qkv.kernels.decode import decode_attention
if decode_ops() is None:
    print("skip:", native_status())
    sys.exit(0)
print("status:", native_status())
torch.manual_seed(0)
x = torch.randn(1, 4, 64, 32)  # (B, h, T, d)
assert torch.isfinite(sdpa(x, x, x, causal=True)).all()  # a prefill: no decode setting read
print("prefill: ok")
q = torch.randn(1, 4, 1, 32)  # one new token
caches = {"fp32": (x, x), "bf16": (x.bfloat16(), x.bfloat16()),
          "int8": (quantize_rows(x), quantize_rows(x))}
for kind, (k, v) in caches.items():
    for entry, call in (("decode_attention", decode_attention), ("auto", sdpa)):
        qq = q.bfloat16() if kind == "bf16" else q
        try:
            out = call(qq, k, v)
            print(f"{kind} {entry}: ok", bool(torch.isfinite(out).all()))
        except SettingError as e:
            print(f"{kind} {entry}: SettingError:", e)
print("ok")
"""


@pytest.mark.parametrize(("name", "kind"), [("QKV_DECODE_INT8", "int8"),
                                            ("QKV_DECODE_FP32", "fp32"),
                                            ("QKV_DECODE_BF16", "bf16")])  # fmt: skip
def test_a_bad_decode_setting_stops_only_the_decode_that_reads_it(name, kind):
    res = deadline.run([sys.executable, "-c", _CALLS], 120, f"attention calls with {name}",
                       env=dict(os.environ, **{name: "fast"}), capture_output=True, text=True)  # fmt: skip
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    if lines[0].startswith("skip:"):
        pytest.skip(f"no decode kernel here: {lines[0]}")
    *most, last = _settings.SETTINGS[name]
    error = f"{name} must be {', '.join(most)} or {last}; got 'fast'"
    assert lines[0].startswith("status: loaded") and error in lines[0], lines[0]
    assert lines[1] == "prefill: ok"
    for other in ("fp32", "bf16", "int8"):
        for entry in ("decode_attention", "auto"):
            line = next(ln for ln in lines if ln.startswith(f"{other} {entry}:"))
            if other == kind:
                assert line == f"{other} {entry}: SettingError: {error}", line
            else:
                assert line == f"{other} {entry}: ok True", line
    assert lines[-1] == "ok"


def test_a_bad_bf16_matmul_setting_stops_bf16_flash_calls_only(monkeypatch):
    import torch

    from qkv.kernels.flash import flash_attention

    if _native.native_ops() is None:
        pytest.skip(f"no fused kernel here: {_native.native_status()}")
    monkeypatch.setenv("QKV_BF16_MATMUL", "fast")
    q = torch.randn(1, 2, 16, 8)
    assert torch.isfinite(flash_attention(q, q, q)).all()  # fp32: not read
    with pytest.raises(SettingError, match="QKV_BF16_MATMUL must be auto, amx, onednn, dot, "
                                           "widen or brgemm; got 'fast'"):  # fmt: skip
        flash_attention(q.bfloat16(), q.bfloat16(), q.bfloat16())
    assert "bf16 path: QKV_BF16_MATMUL must be" in _native.native_status()


@pytest.mark.parametrize(("name", "value", "prog"), [("QKV_NATIVE", "fast", "qkv translate"),
                                                     ("QKV_ISA", "sse9", "qkv translate"),
                                                     ("QKV_DEBUG", "yes", "qkv")])  # fmt: skip
def test_a_bad_setting_is_exit_2_and_one_line_on_the_command_line(name, value, prog):
    """(QKV_DEBUG is the command line's own setting, read before the command is known.)"""
    env = {k: v for k, v in os.environ.items() if k != "QKV_DEBUG"}
    res = deadline.run([sys.executable, "-m", "qkv", "translate", "A dog runs."], 120,
                       f"qkv translate with {name}={value}", env={**env, name: value},
                       capture_output=True, text=True)  # fmt: skip
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert res.stderr.startswith(f"{prog}: error: {name} must be ") and \
        res.stderr.count("\n") == 1, res.stderr  # fmt: skip
    assert f"got {value!r}" in res.stderr and res.stdout == ""


_AMX = """
import torch
from qkv.kernels._native import decode_ops, native_status
from qkv.kernels._settings import SettingError
from qkv.kernels.decode import decode_attention
from qkv.kernels.flash import flash_attention
assert decode_ops() is not None, native_status()
x = torch.randn(1, 2, 64, 32).bfloat16()  # (B, h, T, d)
for call in (lambda: decode_attention(x[:, :, :1], x, x), lambda: flash_attention(x, x, x)):
    try:
        call()
        print("ran")
    except SettingError as e:
        print("SettingError:", e)
print("ok")
"""


def test_asking_for_amx_where_there_is_none_is_a_setting_error():
    """``amx`` is a value the kernels take, but a level without AMX tiles (the lowest, here)
    cannot run it: the same one-line error, not a RuntimeError out of the kernel."""
    from qkv.kernels import _levels

    if _native.native_ops() is None:
        pytest.skip(f"no fused kernels here: {_native.native_status()}")
    env = dict(os.environ, QKV_ISA=_levels.runnable_names()[0], QKV_DECODE_BF16="amx",
               QKV_BF16_MATMUL="amx")  # fmt: skip
    res = deadline.run([sys.executable, "-c", _AMX], 120, "bf16 calls asking for AMX",
                       env=env, capture_output=True, text=True)  # fmt: skip
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert res.stdout.splitlines() == [
        "SettingError: QKV_DECODE_BF16=amx: this build or CPU has no AMX tiles (or oneDNN "
        "does not see them)",
        "SettingError: QKV_BF16_MATMUL=amx: no AMX here (this CPU or level has none, or oneDNN "
        "does not see it: ONEDNN_MAX_CPU_ISA)",
        "ok"], res.stdout  # fmt: skip
