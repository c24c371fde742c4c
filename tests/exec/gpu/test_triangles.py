"""A rectangle's attention backward as causal squares (harts.exec.ops.attention.triangles)
against the rectangle's own backward, float64 on the CPU with the reference kernel, wide
and tall, with and without a strip left over: from
the rectangle's own o and lse, and from a union's (the rectangle beside a causal square of
the queries' own rows, as the split runs it)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.exec.ops.attention.kernel import REFERENCE
from harts.exec.ops.attention.triangles import fits, rectangle_backward
from harts.testing import assert_close


@settings(deadline=None, max_examples=30)
@given(n=st.integers(2, 12), m=st.integers(2, 30), heads=st.integers(1, 3), union=st.booleans(),
       seed=st.integers(0, 2**16), group_rows=st.sampled_from((1, 8, 24, 65536)))
def test_squares_give_the_rectangles_backward(n, m, heads, union, seed, group_rows):
    # wide and tall rectangles, multiples of their shorter side or with a strip left over,
    # their squares in groups of one square up to all of them
    g = torch.Generator().manual_seed(seed)
    D, E = 6, 4
    q = torch.randn(n, heads, D, generator=g, dtype=torch.float64)
    k = torch.randn(m, heads, D, generator=g, dtype=torch.float64)
    v = torch.randn(m, heads, E, generator=g, dtype=torch.float64)
    do = torch.randn(n, heads, E, generator=g, dtype=torch.float64)
    cq, ck = np.array([0, n]), np.array([0, m])
    o, lse, _ = REFERENCE.fwd(q, k, v, cq, ck, n, m, False, 0.4)
    if union:  # the union with the queries' own causal square: merged o and lse
        kb, vb = torch.randn(n, heads, D, generator=g, dtype=torch.float64), torch.randn(n, heads, E, generator=g,
                                                                                          dtype=torch.float64)
        ob, lseb, _ = REFERENCE.fwd(q, kb, vb, cq, cq, n, n, True, 0.4)
        merged = torch.logaddexp(lse, lseb)
        o = o * torch.exp(lse - merged)[..., None] + ob * torch.exp(lseb - merged)[..., None]
        lse = merged
    want = REFERENCE.bwd(do, q, k, v, o, lse, None, cq, ck, n, m, False, 0.4)
    got = rectangle_backward(REFERENCE, do, q, k, v, o, lse, 0.4, group_rows=group_rows)
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert_close(name, a, b, 1e-12)


def test_which_rectangles_fit():
    assert fits(4, 12, 1) and fits(4, 4, 4) and fits(4, 10, 4) and fits(12, 4, 4)
    assert not fits(4, 12, 0) and not fits(4, 12, 5) and not fits(12, 4, 5) and not fits(1, 3, 1)
    with pytest.raises(ValueError, match="at least 2"):
        z = torch.zeros(3, 1, 2, dtype=torch.float64)
        rectangle_backward(REFERENCE, z, z, torch.zeros(1, 1, 2, dtype=torch.float64),
                           torch.zeros(1, 1, 2, dtype=torch.float64), z, torch.zeros(3, 1, dtype=torch.float64), 1.0)


@pytest.mark.parametrize("n, m", [(4, 26), (26, 4)])
def test_groups_of_squares_give_the_same_gradients_in_low_precision(n, m):
    # bfloat16 inputs: the longer side's rows take the same float32 sums in the same order
    # whatever the grouping (bit for bit); the shorter side's add over the groups in float32
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(r, 2, c, generator=g).to(torch.bfloat16) for r, c in ((n, 6), (m, 6), (m, 4), (n, 4)))
    cq, ck = np.array([0, n]), np.array([0, m])
    o, lse, _ = REFERENCE.fwd(q, k, v, cq, ck, n, m, False, 0.4)
    one = rectangle_backward(REFERENCE, do, q, k, v, o, lse, 0.4)
    for rows in (1, 2 * min(n, m)):
        got = rectangle_backward(REFERENCE, do, q, k, v, o, lse, 0.4, group_rows=rows)
        longer = (1, 2) if n <= m else (0,)
        for i, (a, b) in enumerate(zip(got, one, strict=True)):
            assert a.dtype == torch.bfloat16
            if i in longer:
                assert torch.equal(a, b)
            else:
                assert_close("shorter side", a.float(), b.float(), 1e-2)
