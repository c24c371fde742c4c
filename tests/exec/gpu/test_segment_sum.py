"""Scatter-adds as fixed-order gathers (`harts.exec.ops.segment_sum`) under
TRITON_INTERPRET=1: the inverse lists every source row of a target in ascending order; the
kernel equals `index_add_` in float64 (to float32 rounding; exactly on integer values,
where the order cannot matter); and the split attention's backward through it equals the
index_add_ path on hypothesis-drawn forests."""


from tests.exec.gpu import interpret_triton  # noqa: E402

interpret_triton()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from harts.exec.ops import segment_sum  # noqa: E402
from harts.exec.ops.attention.split import REFERENCE, device_index, split_attention, split_segments  # noqa: E402
from harts.exec.ops.attention.varlen import segments_of  # noqa: E402
from harts.testing import assert_close  # noqa: E402
from harts.tree import build_forest  # noqa: E402
from tests.strategies import segment_scatters, trajectory_sets  # noqa: E402


@settings(max_examples=30, deadline=None)
@given(case=segment_scatters(), BT=st.sampled_from([1, 4, 16]))
def test_inverse_lists_each_targets_sources_in_order(case, BT):
    T, targets, _ = case
    ptr, order, tile_pairs = segment_sum.inverse(targets, T, BT)
    counts = []
    for t in range(T):
        assert order[ptr[t]:ptr[t + 1]].tolist() == torch.nonzero(targets == t).flatten().tolist()
        counts.append(int(ptr[t + 1] - ptr[t]))
    assert [int(x) for x in tile_pairs] == [max(counts[i:i + BT]) for i in range(0, T, BT)]


@settings(max_examples=30, deadline=None)
@given(case=segment_scatters(), with_base=st.booleans(), integers=st.booleans(), seed=st.integers(0, 2**16))
def test_gather_add_equals_index_add(case, with_base, integers, seed):
    T, targets, feat = case
    g = torch.Generator().manual_seed(seed)
    mk = (lambda *s: torch.randint(-8, 9, s, generator=g).float()) if integers else \
        (lambda *s: torch.randn(*s, generator=g))
    src = mk(targets.numel(), *feat)
    base = mk(T, *feat) if with_base else None
    inv = segment_sum.inverse(targets, T, segment_sum.BT)
    got = segment_sum.gather_add(base, src, inv, rows=T)
    want = segment_sum.reference_gather_add(base, src, targets, rows=T, wide=torch.float64)
    if integers or not bool(want.any()):  # exact sums: the order cannot matter
        assert torch.equal(got, want)
    else:
        assert_close("gather_add", got.double(), segment_sum.reference_gather_add(
            base, src, targets, rows=T, dtype=torch.float64, wide=torch.float64), 1e-6)


def test_gather_add_rejects_an_inverse_of_another_size():
    inv = segment_sum.inverse(torch.tensor([0, 1, 1]), 2, segment_sum.BT)
    with pytest.raises(ValueError, match="another row count"):
        segment_sum.gather_add(torch.zeros(3, 2), torch.zeros(3, 2), inv)


@settings(max_examples=20, deadline=None)
@given(trajs=trajectory_sets(max_groups=2, max_per_group=4, max_len=16), key_only=st.integers(0, 12))
def test_split_attention_backward_through_gathers_equals_index_add(trajs, key_only):
    """Every row a query, or (key_only > 0) the first rows keys only, as a window consumer's
    stashed context rows are."""
    f = build_forest(trajs)
    L = f.num_rows
    queries = None if not key_only else np.arange(min(key_only, L - 1), L)
    sp = split_segments(segments_of(f.row_parent, queries), queries is None)
    assume(sp.has_ancestors)  # the path under test
    C = L if queries is None else queries.size
    g = torch.Generator().manual_seed(L)
    q, do = torch.randn(C, 2, 8, generator=g), torch.randn(C, 2, 4, generator=g)
    k, v = torch.randn(L, 2, 8, generator=g), torch.randn(L, 2, 4, generator=g)
    out = {}
    for fast in (False, True):
        idx = {**device_index(sp, q.device), "gather_add": fast}
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = split_attention(*leaves, 0.3, sp, kernel=REFERENCE, idx=idx)
        out[fast] = [o.detach(), *torch.autograd.grad(o, leaves, do)]
    for name, a, b in zip(("o", "dq", "dk", "dv"), out[True], out[False], strict=True):
        if bool(b.any()):
            assert_close(name, a.double(), b.double(), 1e-6)
        else:  # lone keys: exact zeros both ways
            assert torch.equal(a, b)
