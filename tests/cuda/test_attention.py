"""Tree attention on the GPU against float64: FlexAttention over the DFS block mask, varlen
flash over root-to-row paths, the cuDNN split (dense per sequence; one graph call), the
bottom-right graph path, the backward split by query segment and by key piece, the graph
kernel on zero-length sequences, and the backend's pick (`FastTreeAttention`). bf16 at the
model's head dims (qk 192, v 128); the same decompositions are checked in float64 on CPU in
tests/exec/gpu."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harts.exec.ops.attention import cudnn_graph
from harts.exec.ops.attention.flex import tree_attention, tree_block_mask
from harts.exec.ops.attention.kernel import REFERENCE, REFERENCE_BOTTOM_RIGHT, _case
from harts.exec.ops.attention.split import (
    cudnn_kernel,
    device_index,
    path_split_attention,
    piece_segments,
    split_attention,
    split_segments,
)
from harts.exec.ops.attention.tree import FastTreeAttention, graph_kernels, split_part_kernel
from harts.exec.ops.attention.varlen import (
    flash_varlen,
    path_attention,
    segments_of,
)
from harts.tree import build_forest
from harts.tree.workload import generate, generate_trajectories, preset
from tests.cuda.conftest import TOL_BF16, TOL_F32, assert_rel

pytestmark = pytest.mark.cuda

QK, VD, H = 192, 128, 4
SCALE = QK**-0.5
GRADS = ("o", "dq", "dk", "dv")


@functools.cache
def forked_parents(rows: int = 6000) -> np.ndarray:
    """The first `rows` rows of swe-treestep-1 (DFS order), cut into a forked layout."""
    f = generate(preset("swe-treestep-1")).forest()
    par = f.row_parent[:rows]
    return np.where(par < rows, par, -1)


def _qkv(nq: int, nk: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(nq, H, QK, device="cuda", generator=g), torch.randn(nk, H, QK, device="cuda", generator=g),
            torch.randn(nk, H, VD, device="cuda", generator=g), torch.randn(nq, H, VD, device="cuda", generator=g))


def _run(fn, q, k, v, do, dtype):
    ins = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    o = fn(*ins)
    return [o.detach(), *torch.autograd.grad(o, ins, do.to(dtype))]


def _reference(par, q_local, q, k, v, do):
    """Dense float64 attention of the query rows `q_local` (all rows if None) over their
    ancestors-or-self, the mask read from the parent array alone (no segments, no gathered
    key paths: one [H, queries, rows] score tensor)."""
    R = par.size
    end = np.arange(R)
    for i in range(R - 1, -1, -1):  # DFS order: a row's subtree ends where its last descendant's does
        if par[i] >= 0:
            end[par[i]] = max(end[par[i]], end[i])
    rows = np.arange(R) if q_local is None else np.asarray(q_local)
    j = np.arange(R)
    allowed = torch.as_tensor((j[None, :] <= rows[:, None]) & (rows[:, None] <= end[None, :]), device="cuda")
    return _run(lambda a, b, c: F.scaled_dot_product_attention(a.transpose(0, 1), b.transpose(0, 1),
                                                               c.transpose(0, 1), attn_mask=allowed,
                                                               scale=SCALE).transpose(0, 1),
                q, k, v, do, torch.float64)


def _assert_all(got, want, tol):
    for name, a, b in zip(GRADS, got, want, strict=True):
        assert_rel(name, a, b, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flex_tree_attention_matches_dense_float64(dtype):
    f = build_forest(generate_trajectories("small-treestep"))
    R = f.num_rows
    end = torch.as_tensor(f.row_end, device="cuda")
    idx = torch.arange(R, device="cuda")
    dense = (idx[None, :] <= idx[:, None]) & (idx[:, None] <= end[None, :])
    q, k, v, do = _qkv(R, R)
    got = _run(lambda a, b, c: tree_attention(a, b, c, SCALE, tree_block_mask(end)), q, k, v, do, dtype)
    want = _run(lambda a, b, c: F.scaled_dot_product_attention(a.transpose(0, 1), b.transpose(0, 1),
                                                               c.transpose(0, 1), attn_mask=dense,
                                                               scale=SCALE).transpose(0, 1),
                q, k, v, do, torch.float64)
    _assert_all(got, want, TOL_F32 if dtype == torch.float32 else TOL_BF16)


@pytest.mark.parametrize("queries", ["all", "subset"])
def test_varlen_flash_path_attention_matches_float64(queries):
    par = forked_parents()
    R = par.size
    q_local = None if queries == "all" else np.sort(np.random.default_rng(0).choice(R, R // 2, replace=False))
    seg = segments_of(par, q_local)
    q, k, v, do = _qkv(R if q_local is None else q_local.size, R)
    got = _run(lambda a, b, c: path_attention(a, b, c, SCALE, seg, kernel=flash_varlen), q, k, v, do, torch.bfloat16)
    _assert_all(got, _reference(par, q_local, q, k, v, do), TOL_BF16)


@pytest.mark.parametrize(("variant", "queries"), [("dense", "all"), ("dense", "subset"), ("dense-strided", "all"),
                                                  ("dense-strided", "subset"), ("graph", "all"),
                                                  ("graph-nondet", "all")])
def test_cudnn_split_attention_matches_float64(variant, queries):
    # "subset": a consumer's queries, the rows from R/2 on (their ancestors above are context)
    par = forked_parents()
    R = par.size
    q_local = None if queries == "all" else np.arange(R // 2, R)
    seg = segments_of(par, q_local)
    sp = split_segments(seg, q_local is None)
    kern = cudnn_kernel(QK, VD, variant)  # self-checked against the float64 reference on creation
    q, k, v, do = _qkv(R if q_local is None else q_local.size, R)
    got = _run(lambda a, b, c: split_attention(a, b, c, SCALE, sp, kernel=kern), q, k, v, do, torch.bfloat16)
    _assert_all(got, _reference(par, q_local, q, k, v, do), TOL_BF16)


def test_deterministic_graph_split_reruns_bit_identically():
    par = forked_parents()
    seg = segments_of(par)
    sp = split_segments(seg, True)
    kern = cudnn_kernel(QK, VD, "graph")
    q, k, v, do = _qkv(par.size, par.size)
    first = _run(lambda a, b, c: split_attention(a, b, c, SCALE, sp, kernel=kern), q, k, v, do, torch.bfloat16)
    again = _run(lambda a, b, c: split_attention(a, b, c, SCALE, sp, kernel=kern), q, k, v, do, torch.bfloat16)
    for name, a, b in zip(GRADS, first, again, strict=True):
        assert torch.equal(a, b), name


def test_bottom_right_graph_path_matches_float64():
    par = forked_parents()
    seg = segments_of(par)
    br = cudnn_graph.check_bottom_right(cudnn_graph.setup(QK, VD, bottom_right=True), QK, VD)
    q, k, v, do = _qkv(par.size, par.size)
    got = _run(lambda a, b, c: path_attention(a, b, c, SCALE, seg, kernel=cudnn_graph.varlen_fn(br)), q, k, v, do,
               torch.bfloat16)
    _assert_all(got, _reference(par, None, q, k, v, do), TOL_BF16)


@pytest.mark.parametrize("kernels", ["default", "dense", "nondet", "det"])
@pytest.mark.parametrize("split", ["query", "piece"])
def test_path_split_backward_matches_float64(split, kernels):
    # the graph path's backward, part A by query segment or by key piece, on each kernel the
    # backend may pick; against the same decomposition on the float64 reference kernels
    par = generate(preset("small-treestep")).forest().row_parent
    seg = segments_of(par)
    L = par.size
    sp = (split_segments if split == "query" else piece_segments)(seg, True)
    assert graph_kernels(QK, VD) is not None, "the cuDNN graph kernels failed their self-checks (or no frontend)"
    fwd_k, det = graph_kernels(QK, VD)
    picks = {"default": (split_part_kernel(QK, VD, H, L, seg.num_segments, sp.max_q, sp.max_q),
                         split_part_kernel(QK, VD, H, int(sp.qa_index.size), int(sp.cu_qa.size - 1), sp.max_qa,
                                           sp.max_ka)),
             "dense": cudnn_kernel(QK, VD), "nondet": cudnn_kernel(QK, VD, "graph-nondet"), "det": det}
    keys = torch.as_tensor(seg.key_rows, device="cuda")
    idx = device_index(sp, "cuda")
    q, k, v, do = _qkv(L, L, seed=5)

    def run(fk, kern, dtype):
        return _run(lambda a, b, c: path_split_attention(a, b, c, SCALE, seg, sp, fk, kern, key_rows=keys, idx=idx),
                    q, k, v, do, dtype)

    want = run(REFERENCE_BOTTOM_RIGHT, REFERENCE, torch.float64)
    _assert_all(run(fwd_k, picks[kernels], torch.bfloat16), want, TOL_BF16)


@pytest.mark.parametrize("case", ["causal", "rect", "bottom_right", "long_then_empty"])
def test_graph_kernel_takes_zero_length_sequences(case):
    # empty sequences pad a batch to its bucketed size: they must change nothing
    causal, br, nq, nk = {"causal": (True, False, [5, 0, 40, 0, 0], [5, 0, 40, 0, 0]),
                          "rect": (False, False, [5, 0, 30, 0], [9, 0, 41, 0]),
                          "bottom_right": (True, True, [3, 0, 20, 0], [9, 0, 41, 0]),
                          "long_then_empty": (True, False, [700, 0, 0, 0], [700, 0, 0, 0])}[case]
    kern = cudnn_graph.GraphKernel(bottom_right=br)
    ref_k = REFERENCE_BOTTOM_RIGHT if br else REFERENCE
    q, k, v, do, cu_q, cu_k = _case(QK, VD, nq, nk, 4)
    wide = [x.double() for x in (q, k, v)]
    o_r, lse_r, _ = ref_k.fwd(*wide, cu_q, cu_k, max(nq), max(nk), causal, SCALE)
    ref = ref_k.bwd(do.double(), *wide, o_r, lse_r, None, cu_q, cu_k, max(nq), max(nk), causal, SCALE)
    o, lse, aux = kern.fwd(q, k, v, cu_q, cu_k, max(nq), max(nk), causal, SCALE)
    got = kern.bwd(do, q, k, v, o, lse, aux, cu_q, cu_k, max(nq), max(nk), causal, SCALE)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, *got), (o_r, lse_r, *ref), strict=True):
        assert_rel(name, a, b, TOL_BF16)


def test_backend_tree_attention_matches_float64():
    # what the tree step runs (FastTreeAttention's pick for bf16 at these dims)
    par = forked_parents()
    R = par.size
    f = generate(preset("swe-treestep-1")).forest()
    end = torch.as_tensor(np.minimum(f.row_end[:R], R - 1), device="cuda")
    att = FastTreeAttention(torch.arange(R, device="cuda"), end, parent_L=par)
    q, k, v, do = _qkv(R, R)
    got = _run(lambda a, b, c: att(a, b, c, SCALE), q, k, v, do, torch.bfloat16)
    _assert_all(got, _reference(par, None, q, k, v, do), TOL_BF16)


@pytest.mark.parametrize("squares", [False, True], ids=["one-call", "squares"])
@pytest.mark.parametrize("kernel", ["dense", "nondet", "det"])
def test_chain_piece_context_as_causal_squares_matches_float64(kernel, squares):
    # a chain piece (one chain, the last 700 rows queried, a 2,100-row context: 3 squares):
    # its backward by row ranges (`split.context_first`), the context in one call or as
    # causal squares (`rectangle_triangles_min_rows`), on each kernel the backend may pick,
    # against the float64 reference kernels
    from harts.tree import Trajectory

    chain = build_forest([Trajectory.make("a", "g", np.arange(1, 2801))])
    q_local = np.arange(2100, chain.num_rows)
    seg = segments_of(chain.row_parent, q_local)
    sp = split_segments(seg, False)
    from harts.exec.ops.attention.split import context_first

    assert context_first(sp, {}, q_local.size, chain.num_rows) == 2100
    assert graph_kernels(QK, VD) is not None, "the cuDNN graph kernels failed their self-checks (or no frontend)"
    fwd_k, det = graph_kernels(QK, VD)
    kern = {"dense": cudnn_kernel(QK, VD), "nondet": cudnn_kernel(QK, VD, "graph-nondet"), "det": det}[kernel]
    keys = torch.as_tensor(seg.key_rows, device="cuda")
    q, k, v, do = _qkv(q_local.size, chain.num_rows, seed=6)

    def run(fk, kern_, dtype, squares):
        idx = device_index(sp, "cuda")
        idx["triangles_min_rows"] = 512 if squares else 0
        return _run(lambda a, b, c: path_split_attention(a, b, c, SCALE, seg, sp, fk, kern_, key_rows=keys, idx=idx),
                    q, k, v, do, dtype)

    want = run(REFERENCE_BOTTOM_RIGHT, REFERENCE, torch.float64, False)
    _assert_all(run(fwd_k, kern, torch.bfloat16, squares), want, TOL_BF16)
    if squares:
        _assert_all(run(REFERENCE_BOTTOM_RIGHT, REFERENCE, torch.float64, True), want, 1e-12)
