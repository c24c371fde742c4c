"""RowGather (harts/exec/ops/gather.py) against advanced indexing: the same values, and in
float64 the same gradients as autograd's scatter-add (exactly: each row's gradient is a sum
in occurrence order either way), on drawn indices with repeats, with and without every
source row present; several tensors at once, one of them not requiring grad."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given

from harts.exec.ops.gather import RowGather
from tests.strategies import gather_indices


@given(gather_indices())
def test_gather_matches_indexing(case):
    n, idx = case
    g = torch.Generator().manual_seed(len(idx) * 31 + n)
    x = torch.randn(n, 3, 2, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randn(n, 4, dtype=torch.float64, generator=g, requires_grad=True)
    z = torch.randn(n, dtype=torch.float64, generator=g)  # no grad
    gather = RowGather(np.array(idx, dtype=np.int64), n, "cpu")
    gx, gy, gz = gather(x, y, z)
    t = torch.as_tensor(idx, dtype=torch.int64)
    assert torch.equal(gx, x[t]) and torch.equal(gy, y[t]) and torch.equal(gz, z[t])
    wx = torch.randn(gx.shape, dtype=torch.float64, generator=g)
    wy = torch.randn(gy.shape, dtype=torch.float64, generator=g)
    got = torch.autograd.grad((gx * wx).sum() + (gy * wy).sum(), (x, y), allow_unused=True)
    want = torch.autograd.grad((x[t] * wx).sum() + (y[t] * wy).sum(), (x, y), allow_unused=True)
    for a, b in zip(got, want, strict=True):
        if b is None:  # empty index: nothing depends on the inputs
            assert a is None or not a.any()
            continue
        assert torch.equal(a, b)
    assert gather.covers_all == (len(set(idx)) == n)


def test_gather_rejects_bad_input():
    with pytest.raises(ValueError, match="out of range"):
        RowGather(np.array([0, 3]), 3, "cpu")
    gather = RowGather(np.array([0, 2]), 3, "cpu")
    with pytest.raises(ValueError, match="3 rows"):
        gather(torch.zeros(4, 2))


def test_identity_gather_returns_its_inputs():
    """Every row once, in order: no copy, and the gradient is the caller's own."""
    gather = RowGather(np.arange(5), 5, "cpu")
    assert gather.identity and not RowGather(np.array([0, 1, 2, 3, 3]), 5, "cpu").identity
    assert not RowGather(np.array([1, 0, 2, 3, 4]), 5, "cpu").identity
    x = torch.randn(5, 2, requires_grad=True)
    (y,) = gather(x)
    assert y is x


@pytest.mark.parametrize("idx,mostly", [([0, 1, 2, 2, 4, 0], True), ([5, 0], False), ([0, 1, 2, 3, 4, 5], False)])
def test_gradient_paths_by_how_many_rows_occur(idx, mostly):
    """Most source rows occurring (the gather-then-zero backward), few (index_copy_ into
    zeros), all: the same gradient as autograd's scatter-add, exactly, in float64."""
    gather = RowGather(np.array(idx), 6, "cpu")
    assert gather.mostly == mostly
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 3, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(len(idx), 3, dtype=torch.float64, generator=g)
    (y,) = gather(x)
    got = torch.autograd.grad((y * w).sum(), x)[0]
    want = torch.autograd.grad((x[torch.tensor(idx)] * w).sum(), x)[0]
    assert torch.equal(got, want)
