"""Ancestor attention as two varlen calls merged by log-sum-exp (the cuDNN GPU path),
checked on CPU with the float64 reference kernel against the dense ancestor mask: output
and the gradients of q, k and v, for hypothesis-drawn forests, all rows or a subset of
query rows. The cuDNN kernel checks itself against the same reference on first use (on
the GPU: tests/cuda/test_attention.py)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.exec.ops.attention.split import REFERENCE, split_attention, split_segments
from harts.exec.ops.attention.varlen import segments_of
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
    from harts.exec.ops.attention.split import MIN_CUDNN_ROWS, _CuDNNDense

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


@settings(deadline=None)
@given(trajs=trajectory_sets(max_groups=3, max_per_group=5, max_len=20), subset_seed=st.none() | st.integers(0, 99))
def test_path_forward_split_backward_equals_dense_ancestor_attention(trajs, subset_seed):
    # the forward as one bottom-right call over gathered root-to-row paths, the backward as
    # the split's two parts from that forward's o and lse (no forward aux: `aux_for`)
    from harts.exec.ops.attention.split import REFERENCE_BOTTOM_RIGHT, path_split_attention

    f = build_forest(trajs)
    q_local = query_rows(f, subset_seed)
    full = subset_seed is None
    seg = segments_of(f.row_parent, None if full else q_local)
    sp = split_segments(seg, full)
    check_against_dense(f, q_local, lambda q, k, v, s: path_split_attention(
        q, k, v, s, seg, sp, fwd_kernel=REFERENCE_BOTTOM_RIGHT, kernel=REFERENCE), zero_grad_atol=1e-12)


def test_bottom_right_reference_equals_path_reference():
    # REFERENCE_BOTTOM_RIGHT's forward against path_attention's reference_varlen, with the
    # log-sum-exp against a direct logsumexp of the masked scores
    from harts.exec.ops.attention.split import REFERENCE_BOTTOM_RIGHT
    from harts.exec.ops.attention.varlen import reference_varlen

    g = torch.Generator().manual_seed(2)
    n, m = [3, 1, 6], [7, 1, 6]
    cu_q, cu_k = np.r_[0, np.cumsum(n)], np.r_[0, np.cumsum(m)]
    q = torch.randn(sum(n), 2, 5, generator=g, dtype=torch.float64)
    k = torch.randn(sum(m), 2, 5, generator=g, dtype=torch.float64)
    v = torch.randn(sum(m), 2, 3, generator=g, dtype=torch.float64)
    o, lse, _ = REFERENCE_BOTTOM_RIGHT.fwd(q, k, v, cu_q, cu_k, max(n), max(m), True, 0.4)
    assert_close("o", o, reference_varlen(q, k, v, cu_q, cu_k, max(n), max(m), 0.4), 1e-12)
    for s in range(len(n)):
        qs, ks = q[cu_q[s]:cu_q[s + 1]], k[cu_k[s]:cu_k[s + 1]]
        sc = torch.einsum("nhd,mhd->hnm", qs, ks) * 0.4
        allowed = torch.arange(m[s])[None, :] <= (m[s] - n[s] + torch.arange(n[s]))[:, None]
        want = torch.logsumexp(sc.masked_fill(~allowed, float("-inf")), -1).transpose(0, 1)
        assert_close("lse", lse[cu_q[s]:cu_q[s + 1]], want, 1e-12)


def test_dense_kernel_aux_for_follows_the_forwards_rule():
    # with o and lse from another forward, the dense kernel's per-sequence aux must say
    # "reference math" exactly where its forward would have (a side under MIN_CUDNN_ROWS)
    from harts.exec.ops.attention.split import MIN_CUDNN_ROWS, _CuDNNDense

    kern = _CuDNNDense()
    kern.forward_extras = ("cq", "ck", "seed", "offset", torch.float32)
    cu_q = np.array([0, 3, 3 + MIN_CUDNN_ROWS, 3 + 2 * MIN_CUDNN_ROWS + 5])
    cu_k = np.array([0, 40, 40 + MIN_CUDNN_ROWS - 1, 40 + 2 * MIN_CUDNN_ROWS + 30])
    aux = kern.aux_for(cu_q, cu_k, 4, "cpu")
    assert aux[0] is None and aux[1] is None  # 3 queries; MIN_CUDNN_ROWS - 1 keys
    n, m = MIN_CUDNN_ROWS + 5, MIN_CUDNN_ROWS + 31
    assert aux[2] == ((1, 4, n, 1), torch.float32, "cq", "ck", n, m, "seed", "offset")


def test_identity_keys_only_for_one_fully_queried_chain():
    # one chain with every row a query: the paths are the rows in order (no gather); a fork
    # or a query subset needs the gather
    from harts.exec.ops.attention.split import (
        REFERENCE_BOTTOM_RIGHT,
        identity_keys,
        path_split_attention,
    )
    from harts.tree import Trajectory

    chain = build_forest([Trajectory.make("a", "g", [1, 2, 3, 4, 5])])
    seg = segments_of(chain.row_parent)
    assert identity_keys(seg, chain.num_rows)
    assert not identity_keys(segments_of(chain.row_parent, np.array([1, 3])), chain.num_rows)
    forked = build_forest([Trajectory.make("a", "g", [1, 2, 3, 4]), Trajectory.make("b", "g", [1, 2, 7, 8])])
    assert not identity_keys(segments_of(forked.row_parent), forked.num_rows)
    sp = split_segments(seg, True)
    check_against_dense(chain, np.arange(chain.num_rows), lambda q, k, v, s: path_split_attention(
        q, k, v, s, seg, sp, fwd_kernel=REFERENCE_BOTTOM_RIGHT, kernel=REFERENCE), zero_grad_atol=1e-12)


@settings(deadline=None)
@given(trajs=trajectory_sets(max_groups=3, max_per_group=5, max_len=20), subset_seed=st.none() | st.integers(0, 99))
def test_piece_backward_equals_dense_ancestor_attention(trajs, subset_seed):
    # part A grouped by key piece (query rows repeat across rectangles): every attended
    # pair exactly once, each key row in one rectangle, each rectangle's queries attending
    # all its keys; the path forward with this backward against the dense mask in float64
    from harts.exec.ops.attention.split import (
        REFERENCE_BOTTOM_RIGHT,
        path_split_attention,
        piece_segments,
    )

    f = build_forest(trajs)
    q_local = query_rows(f, subset_seed)
    full = subset_seed is None
    seg = segments_of(f.row_parent, None if full else q_local)
    sp = piece_segments(seg, full)
    n_b = np.diff(sp.cu_q)
    nq, nk = np.diff(sp.cu_qa), np.diff(sp.cu_ka)
    assert int((n_b * (n_b + 1) // 2).sum() + (nq * nk).sum()) == allowed_pairs(f, q_local)
    assert np.unique(sp.anc_rows).size == sp.anc_rows.size
    end = f.row_end
    for j in range(nq.size):
        qs = q_local[sp.qa_index[sp.cu_qa[j]:sp.cu_qa[j + 1]]]
        ks = sp.anc_rows[sp.cu_ka[j]:sp.cu_ka[j + 1]]
        assert ((ks[None, :] < qs[:, None]) & (qs[:, None] <= end[ks][None, :])).all()
    check_against_dense(f, q_local, lambda q, k, v, s: path_split_attention(
        q, k, v, s, seg, sp, fwd_kernel=REFERENCE_BOTTOM_RIGHT, kernel=REFERENCE), zero_grad_atol=1e-12)


def test_pieces_of_branches_off_a_shared_prompt():
    # a 4-row prompt, a 3-row branch continuing it, and two more branches forking at rows 1
    # and 3: the prompt rows 0-1 are attended by both other branches (one rectangle, their
    # queries stacked), rows 2-3 by the branch forking at 3 only; the forward refuses it
    from harts.exec.ops.attention.split import piece_segments
    from harts.tree import Trajectory

    f = build_forest([Trajectory.make("a", "g", [1, 2, 3, 4, 5, 6, 7]), Trajectory.make("b", "g", [1, 2, 3, 4, 8, 9]),
                      Trajectory.make("c", "g", [1, 2, 10, 11])])
    seg = segments_of(f.row_parent)
    sp = piece_segments(seg, True)
    rects = [(sp.qa_index[sp.cu_qa[j]:sp.cu_qa[j + 1]].tolist(), sp.anc_rows[sp.cu_ka[j]:sp.cu_ka[j + 1]].tolist())
             for j in range(sp.cu_qa.size - 1)]
    assert f.row_parent.tolist() == [-1, 0, 1, 2, 3, 4, 5, 3, 7, 1, 9]
    assert rects == [([7, 8, 9, 10], [0, 1]), ([7, 8], [2, 3])]
    assert not sp.qa_unique and split_segments(seg, True).qa_unique
    q = torch.zeros(f.num_rows, 1, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="each query once"):
        split_attention(q, q, q, 0.5, sp, kernel=REFERENCE)


@pytest.mark.parametrize("pieces", [False, True], ids=["split", "pieces"])
def test_a_chain_piece_reads_its_context_by_row_range(pieces):
    # a piece of a chain of windows: its queries the last rows of one chain, its keys
    # [context | own]. The backward reads the parts as row ranges (`context_first`): against
    # the dense ancestor mask in float64, and in float32 the general path's values exactly
    # (the same kernel calls on the same rows; each key row one share, dq one addition)
    from harts.exec.ops.attention.split import (
        REFERENCE_BOTTOM_RIGHT,
        context_first,
        device_index,
        path_split_attention,
        piece_segments,
    )
    from harts.tree import Trajectory

    chain = build_forest([Trajectory.make("a", "g", list(range(1, 30)))])
    q_local = np.arange(20, chain.num_rows)
    seg = segments_of(chain.row_parent, q_local)
    sp = (piece_segments if pieces else split_segments)(seg, False)

    def attend(idx):
        return lambda q, k, v, s: path_split_attention(q, k, v, s, seg, sp, fwd_kernel=REFERENCE_BOTTOM_RIGHT,
                                                       kernel=REFERENCE, idx=idx)

    idx = device_index(sp, "cpu")
    check_against_dense(chain, q_local, attend(idx), zero_grad_atol=1e-12)
    assert idx["context_first"] == 20
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, 2, d, generator=g, requires_grad=True) for n, d in ((9, 12), (29, 12), (29, 8)))
    do = torch.randn(9, 2, 8, generator=g)
    general = device_index(sp, "cpu")
    general["context_first"] = None
    got, want = (torch.autograd.grad(attend(i)(q, k, v, 0.3), (q, k, v), do) for i in (device_index(sp, "cpu"), general))
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert torch.equal(a, b), name
    # not a chain piece: a fork under the context, queries with a gap, or every row a query
    forked = build_forest([Trajectory.make("a", "g", list(range(1, 30))),
                           Trajectory.make("b", "g", [*range(1, 25), 40, 41])])
    for f, ql in ((forked, np.arange(20, forked.num_rows)), (chain, np.r_[18, 20:chain.num_rows]),
                  (chain, np.arange(chain.num_rows))):
        s2 = segments_of(f.row_parent, None if ql.size == f.num_rows else ql)
        sp2 = (piece_segments if pieces else split_segments)(s2, ql.size == f.num_rows)
        assert context_first(sp2, device_index(sp2, "cpu"), ql.size, f.num_rows) is None


def test_a_chain_piece_context_as_causal_squares(monkeypatch):
    # KernelConfig.rectangle_triangles_min_rows: a chain piece whose context is a multiple
    # of its rows takes its context's backward as causal squares; float64 against the
    # dense ancestor mask, and the squares did run
    from harts.exec.ops.attention import triangles
    from harts.exec.ops.attention.split import (
        REFERENCE_BOTTOM_RIGHT,
        device_index,
        path_split_attention,
    )
    from harts.tree import Trajectory

    calls = []
    run = triangles.rectangle_backward
    monkeypatch.setattr(triangles, "rectangle_backward", lambda *a, **kw: calls.append(1) or run(*a, **kw))
    chain = build_forest([Trajectory.make("a", "g", list(range(1, 31)))])
    q_local = np.arange(20, chain.num_rows)
    seg = segments_of(chain.row_parent, q_local)
    sp = split_segments(seg, False)
    idx = device_index(sp, "cpu")
    idx["triangles_min_rows"] = 10
    check_against_dense(chain, q_local, lambda q, k, v, s: path_split_attention(
        q, k, v, s, seg, sp, fwd_kernel=REFERENCE_BOTTOM_RIGHT, kernel=REFERENCE, idx=idx), zero_grad_atol=1e-12)
    assert calls == [1]
    # the squares' own kernel where the layout names one (FastTreeAttention picks it for
    # their shape on the GPU), the parts' otherwise
    seen = []

    class Squares(type(REFERENCE)):
        def bwd(self, *a):
            seen.append((a[9], a[11]))  # rows per square, causal
            return super().bwd(*a)

    idx["triangles_kernel"] = Squares()
    check_against_dense(chain, q_local, lambda q, k, v, s: path_split_attention(
        q, k, v, s, seg, sp, fwd_kernel=REFERENCE_BOTTOM_RIGHT, kernel=REFERENCE, idx=idx), zero_grad_atol=1e-12)
    assert seen == [(10, True), (9, True)]


def test_responses_under_one_shared_prompt_read_it_by_row_range():
    # a consumer of three responses under a 12-row prompt it does not compute: with part A
    # by key piece the prompt is one rectangle under every response, read as rows [0, 12);
    # by query segment it is three rectangles (the general path)
    from harts.exec.ops.attention.split import (
        REFERENCE_BOTTOM_RIGHT,
        context_first,
        device_index,
        path_split_attention,
        piece_segments,
    )
    from harts.tree import Trajectory

    prompt = list(range(1, 13))
    f = build_forest([Trajectory.make(f"r{i}", "g", prompt + [50 + 10 * i + j for j in range(3 + i)])
                      for i in range(3)])
    q_local = np.arange(12, f.num_rows)
    seg = segments_of(f.row_parent, q_local)
    sp = piece_segments(seg, False)
    idx = device_index(sp, "cpu")
    check_against_dense(f, q_local, lambda q, k, v, s: path_split_attention(
        q, k, v, s, seg, sp, fwd_kernel=REFERENCE_BOTTOM_RIGHT, kernel=REFERENCE, idx=idx), zero_grad_atol=1e-12)
    assert idx["context_first"] == 12
    by_query = split_segments(seg, False)
    assert context_first(by_query, device_index(by_query, "cpu"), q_local.size, f.num_rows) is None
