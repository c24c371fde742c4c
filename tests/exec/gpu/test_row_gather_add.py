"""RowGather's backward as one gather-add (`segment_sum.gather_add`, the CUDA path) under
TRITON_INTERPRET=1: the gradient of x[index] with rows read many times, or left out, is
within its rounding of the float64 sum, as the occurrence levels' path is of theirs, and
equal to it bit for bit where no row is read twice, in float32 and bf16; float64 keeps the
levels."""

from tests.exec.gpu import interpret_triton  # noqa: E402

interpret_triton()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from harts.exec.ops import segment_sum  # noqa: E402
from harts.exec.ops.gather import RowGather  # noqa: E402
from tests.strategies import repeated_gathers  # noqa: E402


def _grad(gather: RowGather, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_()
    (y,) = gather(x)
    (y * w).sum().backward()
    return x.grad


@settings(max_examples=40, deadline=None)
@given(case=repeated_gathers(), dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_gather_add_backward_equals_the_levels_and_float64(case, dtype, seed):
    n, index, feat = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *feat, generator=g, dtype=torch.float64)
    w = torch.randn(index.size, *feat, generator=g, dtype=torch.float64)
    fused, levels = RowGather(index, n, "cpu", gather_add=True), RowGather(index, n, "cpu", gather_add=False)
    assert levels.inverse is None
    counts = np.bincount(index, minlength=n)
    repeats = bool(index.size) and counts.max() > 1
    # one gather-add unless the index is empty or reads every row exactly once
    assert (fused.inverse is None) == (not index.size or bool((counts == 1).all()))
    w = w.to(dtype)  # the float64 sums below are of the gradient as the backward gets it
    idx = torch.from_numpy(index)
    want = torch.zeros(n, *feat, dtype=torch.float64).index_add_(0, idx, w.double())
    scale = torch.zeros(n, *feat, dtype=torch.float64).index_add_(0, idx, w.double().abs())
    k = int(np.bincount(index, minlength=n).max()) if index.size else 0
    got = _grad(fused, x.to(dtype), w)
    plain = _grad(levels, x.to(dtype), w)
    assert got.dtype == dtype
    # fp32 sums over at most k terms, rounded to dtype once
    bound = (k * torch.finfo(torch.float32).eps + torch.finfo(dtype).eps) * scale + 1e-30
    assert ((got.double() - want).abs() <= bound).all()
    # the levels' sums round to dtype at every level
    assert ((plain.double() - want).abs() <= k * torch.finfo(dtype).eps * scale + 1e-30).all()
    if not repeats:  # every row read at most once: copied exactly both ways
        assert torch.equal(got, plain)


def test_float64_keeps_the_levels():
    index = np.array([0, 2, 2, 2, 1, 2], dtype=np.int64)
    fused = RowGather(index, 3, "cpu", gather_add=True)
    assert fused.inverse is not None
    x = torch.randn(3, 4, dtype=torch.float64)
    w = torch.randn(6, 4, dtype=torch.float64)
    want = torch.zeros(3, 4, dtype=torch.float64).index_add_(0, torch.from_numpy(index), w)
    torch.testing.assert_close(_grad(fused, x, w), want, rtol=1e-15, atol=1e-15)


@settings(max_examples=30, deadline=None)
@given(case=repeated_gathers(), BT=st.sampled_from([1, 4, 16]))
def test_inverse_host_is_the_device_inverse(case, BT):
    n, index, _ = case
    host = segment_sum.inverse_host(index, n, BT)
    dev = segment_sum.inverse(torch.from_numpy(index), n, BT)
    for a, b in zip(host, dev, strict=True):
        assert a.dtype == np.int32 and b.dtype == torch.int32
        assert a.tolist() == b.tolist()
