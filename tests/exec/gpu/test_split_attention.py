"""Ancestor attention as two varlen calls merged by log-sum-exp (the cuDNN GPU path),
checked on CPU with the float64 reference kernel against the dense ancestor mask: output
and the gradients of q, k and v, for hypothesis-drawn forests, all rows or a subset of
query rows. The cuDNN kernel checks itself against the same reference on first use (on
the GPU: benchmarks/gpu/h200_run.py attnsplit)."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.exec.gpu.path_attention import segments_of
from harts.exec.gpu.split_attention import REFERENCE, split_attention, split_segments
from harts.testing import assert_close
from harts.tree import build_forest
from tests.exec.gpu.test_path_attention import allowed_pairs, check_against_dense, query_rows
from tests.strategies import trajectory_sets


@settings(deadline=None)
@given(trajs=trajectory_sets(max_groups=3, max_per_group=5, max_len=20), subset_seed=st.none() | st.integers(0, 99))
def test_split_attention_equals_dense_ancestor_attention(trajs, subset_seed):
    f = build_forest(trajs)
    q_local = query_rows(f, subset_seed)
    full = subset_seed is None
    sp = split_segments(segments_of(f.row_parent, None if full else q_local), full)
    # every attended pair exactly once: the rectangles plus the causal squares
    n_b = np.diff(sp.cu_q)
    pairs = int((n_b * (n_b + 1) // 2).sum() + (np.diff(sp.cu_qa) * np.diff(sp.cu_ka)).sum())
    assert pairs == allowed_pairs(f, q_local)
    # an exact zero in the reference (a lone key: softmax 1, so ds = dp - dp) is a
    # rounding residue of the explicit backward formulas here
    check_against_dense(f, q_local, lambda q, k, v, s: split_attention(q, k, v, s, sp, kernel=REFERENCE),
                        zero_grad_atol=1e-12)


def test_reference_kernel_backward_matches_autograd():
    # the explicit backward formulas (what a fused kernel computes from o and lse) against
    # autograd through the reference forward, on a causal square and a rectangle
    g = torch.Generator().manual_seed(0)
    for causal, n, m in ((True, [3, 6], [3, 6]), (False, [2, 5], [4, 7])):
        cu_q, cu_k = np.r_[0, np.cumsum(n)], np.r_[0, np.cumsum(m)]
        q = torch.randn(sum(n), 2, 5, generator=g, dtype=torch.float64, requires_grad=True)
        k = torch.randn(sum(m), 2, 5, generator=g, dtype=torch.float64, requires_grad=True)
        v = torch.randn(sum(m), 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
        do = torch.randn(sum(n), 2, 3, generator=g, dtype=torch.float64)
        o, lse, _ = REFERENCE.fwd(q, k, v, cu_q, cu_k, max(n), max(m), causal, 0.4)
        want = torch.autograd.grad(o, (q, k, v), do)
        got = REFERENCE.bwd(do, q.detach(), k.detach(), v.detach(), o.detach(), lse.detach(), None, cu_q, cu_k,
                            max(n), max(m), causal, 0.4)
        for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
            assert_close(name, a, b, 1e-12)


def test_dense_cudnn_kernel_takes_the_reference_for_short_sequences():
    # every sequence here is below MIN_CUDNN_ROWS, so no cuDNN call is made (this runs on
    # CPU) and the kernel must be the reference, forward and backward
    from harts.exec.gpu.split_attention import MIN_CUDNN_ROWS, _CuDNNDense

    kern = _CuDNNDense()
    kern.factor = 1.0
    g = torch.Generator().manual_seed(1)
    for causal, n, m in ((True, [3, 5, 7], [3, 5, 7]), (False, [2, 6], [9, 4])):
        assert max(n + m) < MIN_CUDNN_ROWS
        cu_q, cu_k = np.r_[0, np.cumsum(n)], np.r_[0, np.cumsum(m)]
        q = torch.randn(sum(n), 2, 8, generator=g, dtype=torch.float64)
        k = torch.randn(sum(m), 2, 8, generator=g, dtype=torch.float64)
        v = torch.randn(sum(m), 2, 4, generator=g, dtype=torch.float64)
        do = torch.randn(sum(n), 2, 4, generator=g, dtype=torch.float64)
        o, lse, aux = kern.fwd(q, k, v, cu_q, cu_k, max(n), max(m), causal, 0.3)
        o_ref, lse_ref, _ = REFERENCE.fwd(q, k, v, cu_q, cu_k, max(n), max(m), causal, 0.3)
        assert_close("o", o, o_ref, 1e-12)
        assert_close("lse", lse.double(), lse_ref, 1e-6)  # the kernel's lse is float32
        got = kern.bwd(do, q, k, v, o, lse, aux, cu_q, cu_k, max(n), max(m), causal, 0.3)
        want = REFERENCE.bwd(do, q, k, v, o_ref, lse_ref, None, cu_q, cu_k, max(n), max(m), causal, 0.3)
        for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
            assert_close(name, a, b, 1e-6)
