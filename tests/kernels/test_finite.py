"""The kernels' ``finite`` look (flash_cpu.cpp's ``all_finite``, bound in module.cpp): the
NaN/inf rule's first look at a call's inputs (qkv._nonfinite.quick_look), against PyTorch's
own ``isfinite`` / ``isnan`` / ``isposinf`` on every float dtype, contiguous or not."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from native import assert_level_ok, other_levels, require_built
from qkv.kernels._native import native_module, native_status

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
SPECIALS = (float("nan"), float("inf"), -float("inf"), -float("nan"), 0.0, -0.0, 1e30)


@pytest.fixture(scope="module")
def module():
    m = native_module()
    require_built(m is not None, "the fused kernels' module", native_status())
    return m


def _expected(x: torch.Tensor, bias: bool) -> bool:
    if bias:  # -inf masks a key: only NaN and +inf break a bias
        return not bool((x.isnan() | x.isposinf()).any())
    return bool(torch.isfinite(x).all())


@settings(max_examples=150, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(0, 300),  # past a vector's width and its tail
    specials=st.lists(st.tuples(st.integers(0, 299), st.sampled_from(SPECIALS)), max_size=3),
    strided=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_finite_equals_torch(module, dtype, n, specials, strided, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2 * n if strided else n, generator=g) * 1e3).to(dtype)
    for i, val in specials:
        if i < x.numel():
            x[i] = val
    if strided:
        x = x[::2]  # not contiguous: ATen's path
    assert module.finite(None, None, x, None) is _expected(x, bias=False)
    assert module.finite(x, None, None, None) is _expected(x, bias=False)
    assert module.finite(None, None, None, x) is _expected(x, bias=True)


def test_finite_reads_every_argument(module):
    ok, nan = torch.ones(4, 5), torch.ones(4, 5)
    nan[3, 4] = float("nan")
    for i in range(3):
        args = [ok, ok, ok]
        assert module.finite(*args, ok) is True
        args[i] = nan
        assert module.finite(*args, ok) is False
    ninf = torch.zeros(7)
    ninf[6] = -float("inf")
    assert module.finite(ok, ok, ok, ninf) is True  # a bias's -inf masks
    assert module.finite(ninf, ok, ok, None) is False  # q's does not
    assert module.finite(None, None, None, None) is True
    # integers and bools hold no NaN
    assert module.finite(None, None, torch.ones(3, dtype=torch.int8), torch.ones(3) > 0) is True


_SCRIPT = """
import torch
from qkv.kernels._native import native_module
m = native_module()
for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
    for n in (1, 7, 64, 67, 1000):
        x = torch.randn(n).to(dt)
        assert m.finite(None, None, x, None) and m.finite(None, None, None, x)
        for val, ok_v, ok_b in ((float("nan"), False, False), (float("inf"), False, False),
                                (-float("inf"), False, True)):
            for i in (0, n // 2, n - 1):
                y = x.clone(); y[i] = val
                assert m.finite(None, None, y, None) is ok_v, (dt, n, val, i)
                assert m.finite(None, None, None, y) is ok_b, (dt, n, val, i)
print("ok")
"""


@pytest.mark.parametrize("level", other_levels())
def test_finite_on_every_level(level):
    """The same look on each other kernel level this CPU runs (its loop is compiled per level)."""
    assert_level_ok(_SCRIPT, level)
