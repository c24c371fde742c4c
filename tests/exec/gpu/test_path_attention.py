"""Ancestor attention as varlen causal attention over root-to-row paths (the bf16 GPU path),
checked on CPU with the float64 per-segment kernel against the dense ancestor mask: output
and the gradients of q, k and v, for hypothesis-drawn forests, all rows or a subset of
query rows (a sharing window's consumer reads context rows it does not compute). The flash
kernel itself is checked on the GPU (tests/cuda/test_attention.py)."""

import numpy as np
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.exec.ops.attention.varlen import path_attention, reference_varlen, segments_of
from harts.testing import assert_close
from harts.tree import build_forest
from tests.strategies import trajectory_sets


def _dense_attention(q, k, v, end, q_local, scale):
    L = end.numel()
    kk = torch.arange(L)
    allowed = (kk[None, :] <= q_local[:, None]) & (q_local[:, None] <= end[None, :])
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=allowed, scale=scale)
    return o.transpose(0, 1)


def query_rows(f, subset_seed):
    """All local rows, or a seeded half of them (a consumer reading context rows)."""
    if subset_seed is None:
        return np.arange(f.num_rows)
    rng = np.random.default_rng(subset_seed)
    return np.sort(rng.choice(f.num_rows, max(1, f.num_rows // 2), replace=False))


def allowed_pairs(f, q_local) -> int:
    end, ql = torch.as_tensor(f.row_end), torch.as_tensor(q_local)
    return int(((torch.arange(f.num_rows)[None, :] <= ql[:, None]) & (ql[:, None] <= end[None, :])).sum())


def check_against_dense(f, q_local, attend, zero_grad_atol: float = 0.0):
    """attend(q, k, v, scale) against the dense ancestor mask in float64: output and the
    gradients of q, k and v (1e-12). Gradients that are exactly zero in the dense
    reference must be at most zero_grad_atol x max|do| here."""
    L = f.num_rows
    g = torch.Generator().manual_seed(L)
    H, D, E = 2, 12, 8
    q = torch.randn(q_local.size, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(L, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(L, H, E, generator=g, dtype=torch.float64, requires_grad=True)
    do = torch.randn(q_local.size, H, E, generator=g, dtype=torch.float64)
    o = attend(q, k, v, 0.3)
    grads = torch.autograd.grad(o, (q, k, v), do)
    o_ref = _dense_attention(q, k, v, torch.as_tensor(f.row_end), torch.as_tensor(q_local), 0.3)
    grads_ref = torch.autograd.grad(o_ref, (q, k, v), do)
    assert_close("o", o, o_ref, 1e-12)
    for name, a, b in zip(("dq", "dk", "dv"), grads, grads_ref, strict=True):
        if b.abs().max() > 0:  # keys no query reads (subset) have zero gradients in both
            assert_close(name, a, b, 1e-12)
        else:
            assert a.abs().max() <= zero_grad_atol * do.abs().max()


@settings(deadline=None)
@given(trajs=trajectory_sets(max_groups=3, max_per_group=5, max_len=20), subset_seed=st.none() | st.integers(0, 99))
def test_path_attention_equals_dense_ancestor_attention(trajs, subset_seed):
    f = build_forest(trajs)
    q_local = query_rows(f, subset_seed)
    seg = segments_of(f.row_parent, None if subset_seed is None else q_local)
    # every attended pair is computed exactly once: gathered pairs == allowed pairs
    n = np.diff(seg.cu_q)
    m = np.diff(seg.cu_k)
    assert int(((m - n) * n + n * (n + 1) // 2).sum()) == allowed_pairs(f, q_local)
    check_against_dense(f, q_local, lambda q, k, v, s: path_attention(q, k, v, s, seg, kernel=reference_varlen))


def test_segments_of_a_fork_and_a_context_boundary():
    # rows: 0 root, 1 child of 0, then 2 and 3 both children of 1 (fork), 4 child of 3
    parent = np.array([-1, 0, 1, 1, 3])
    seg = segments_of(parent)
    # the first branch (2) continues 0-1's segment; the second (3, 4) gathers the path 0, 1
    assert seg.cu_q.tolist() == [0, 3, 5]
    assert seg.key_rows.tolist() == [0, 1, 2, 0, 1, 3, 4]
    # queries 3 and 4 only (0-2 are context rows): one segment reading its path 0, 1
    seg = segments_of(parent, np.array([3, 4]))
    assert seg.cu_q.tolist() == [0, 2]
    assert seg.key_rows.tolist() == [0, 1, 3, 4]


@settings(deadline=None)
@given(trajs=trajectory_sets(max_groups=3, max_per_group=5, max_len=20))
def test_segments_follow_first_child_chains(trajs):
    # one segment per leaf when every row is a query, so the gathered keys are exactly the
    # leaves' root-to-leaf paths (the fewest a gather of whole paths can take)
    f = build_forest(trajs)
    seg = segments_of(f.row_parent)
    parent = f.row_parent
    kids = np.bincount(parent[parent >= 0], minlength=f.num_rows)
    leaves = np.flatnonzero(kids == 0)
    assert seg.num_segments == leaves.size
    depth = np.zeros(f.num_rows, np.int64)
    for r in range(f.num_rows):
        depth[r] = 1 + (depth[parent[r]] if parent[r] >= 0 else 0)
    assert seg.key_rows.size == int(depth[leaves].sum())
