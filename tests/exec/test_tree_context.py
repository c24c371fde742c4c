"""The tree MixingContext against the same ops run trajectory by trajectory.

Inputs are drawn per compact row, then expanded through the trajectory -> row map, so the
expanded path sees exactly the values the tree path sees; outputs are compared after
mapping the tree's rows back to every trajectory position.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.exec import backend
from harts.exec.ops.conv import short_conv, window_from_cu_seqlens
from harts.exec.ops.kda import chunk_kda
from harts.exec.stash import StashNeeds
from harts.exec.tree import TreeContext
from harts.testing import assert_close
from harts.tree import build_forest
from tests.strategies import trajectory_sets

H, K, V = 2, 4, 3


def _inputs(R: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(R, H, K, generator=gen, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(R, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(R, H, V, generator=gen, dtype=dtype)
    g = -torch.rand(R, H, K, generator=gen, dtype=dtype) * 0.7
    beta = torch.rand(R, H, generator=gen, dtype=dtype)
    return q, k, v, g, beta


def _expanded_kda(forest, q, k, v, g, beta, chunk):
    rows = torch.as_tensor(forest.traj_rows)
    cu = torch.as_tensor(forest.traj_offsets)
    return chunk_kda(q[rows], k[rows], v[rows], g[rows], beta[rows], cu_seqlens=cu,
                     chunk_size=chunk, output_final_state=False).o


@given(trajectory_sets(max_len=40), st.sampled_from([2, 4, 8]), st.integers(0, 2**16))
def test_kda_replay_is_bit_identical_to_per_trajectory_in_float32(trajs, chunk, seed):
    forest = build_forest(trajs)
    ins = _inputs(forest.num_rows, torch.float32, seed)
    ctx = TreeContext(forest, chunk_size=chunk, kda_mode="replay")
    o_tree = ctx.kda(0, *ins, K**-0.5)[torch.as_tensor(forest.traj_rows)]
    o_exp = _expanded_kda(forest, *ins, chunk)
    assert torch.equal(o_tree, o_exp)
    # the no-replay ablation computes the same function, with its own rounding
    o_node = TreeContext(forest, chunk_size=chunk, kda_mode="node").kda(0, *ins, K**-0.5)
    assert_close("no-replay kda", o_node[torch.as_tensor(forest.traj_rows)], o_exp, 1e-5)


@settings(max_examples=15)
@given(trajectory_sets(max_len=30), st.sampled_from([4, 8]), st.sampled_from(["replay", "node"]),
       st.integers(0, 2**16))
def test_kda_gradients_match_in_float64(trajs, chunk, mode, seed):
    forest = build_forest(trajs)
    ins = [x.requires_grad_() for x in _inputs(forest.num_rows, torch.float64, seed)]
    rows = torch.as_tensor(forest.traj_rows)
    w = torch.randn(int(rows.numel()), H, V, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    o_tree = TreeContext(forest, chunk_size=chunk, kda_mode=mode).kda(0, *ins, K**-0.5)[rows]
    grads_tree = torch.autograd.grad((o_tree * w).sum(), ins)
    o_exp = _expanded_kda(forest, *ins, chunk)
    grads_exp = torch.autograd.grad((o_exp * w).sum(), ins)
    assert_close("o", o_tree, o_exp, 1e-12)
    for name, a, b in zip("q k v g beta".split(), grads_tree, grads_exp, strict=True):
        if not b.any():
            # e.g. one-token trajectories: the decay never touches a non-zero state
            assert not a.any(), f"d{name} should be exactly zero"
        else:
            assert_close(f"d{name}", a, b, 1e-10)


@settings(max_examples=15)
@given(trajectory_sets(max_len=30), st.integers(0, 2**16))
def test_attention_and_conv_follow_each_path(trajs, seed):
    forest = build_forest(trajs)
    R = forest.num_rows
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(R, H, 5, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(R, H, 3, generator=gen, dtype=torch.float64)
    ctx = TreeContext(forest, chunk_size=4)
    rows = torch.as_tensor(forest.traj_rows)
    o_tree = ctx.attention(0, q, k, v, 0.3)[rows]
    outs = []
    off = forest.traj_offsets
    for i in range(forest.num_trajectories):
        r = rows[off[i] : off[i + 1]]
        o = F.scaled_dot_product_attention(*(x[r].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=0.3)
        outs.append(o.transpose(0, 1))
    assert_close("attention", o_tree, torch.cat(outs), 1e-13)

    x = torch.randn(R, 6, generator=gen, dtype=torch.float64)
    wgt = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    bias = torch.randn(6, generator=gen, dtype=torch.float64)
    y_tree = ctx.short_conv(0, "q", x, wgt, bias)[rows]
    cu = torch.as_tensor(off)
    y_exp = short_conv(x[rows], wgt, bias, window_TW=window_from_cu_seqlens(cu, 4, int(cu[-1])), activation="silu")
    assert_close("short conv", y_tree, y_exp, 1e-14)


def test_round_counts_come_from_the_planner():
    from harts.plan.kda_calls import plan_kda_calls_for
    from harts.tree import Trajectory

    T = Trajectory.make
    # a fork inside the first chunk (same round) and one past it (next round)
    trajs = [T("a", "g", np.arange(20) % 7), T("b", "g", np.r_[np.arange(3) % 7, [9] * 5]),
             T("c", "g", np.r_[np.arange(14) % 7, [8] * 4])]
    forest = build_forest(trajs)
    ctx = TreeContext(forest, chunk_size=8)
    plan = plan_kda_calls_for(forest, 8)
    assert ctx.kda_rounds == plan.num_rounds == 2
    assert ctx.replay_tokens == plan.replay_tokens == 3 + (14 - 8)


def _states_read_by_rounds(schedule) -> set[tuple[int, int]]:
    """(round, index into its full chunk-state list) of every state a later round starts from."""
    return {(int(r), int(i)) for rnd in schedule.rounds
            for r, i in zip(rnd.init_round, rnd.init_index, strict=True) if r >= 0}


def _spy_kda(calls: list):
    """backend.chunk_kda that records (requested index, states returned, all M) per call."""
    def spy(*args, **kw):
        for key in ("cu_seqlens_cpu", "kernels", "record"):  # the backend's arguments beyond the op's
            kw.pop(key, None)
        out = chunk_kda(*args, **kw)
        index = kw.get("chunk_state_index")
        calls.append((None if index is None else np.asarray(index).tolist(), int(out.chunk_states.shape[0]),
                      int(out.chunk_state_offsets[-1])))
        return out
    return spy


@settings(max_examples=15)
@given(trajectory_sets(max_len=40), st.sampled_from([2, 4, 8]), st.integers(0, 2**16))
def test_replay_rounds_request_only_the_states_later_rounds_read(trajs, chunk, seed):
    forest = build_forest(trajs)
    ins = _inputs(forest.num_rows, torch.float64, seed)
    ctx = TreeContext(forest, chunk_size=chunk)
    calls: list = []
    with mock.patch.object(backend, "chunk_kda", _spy_kda(calls)):
        o_tree = ctx.kda(0, *ins, K**-0.5)[torch.as_tensor(forest.traj_rows)]
    reads = _states_read_by_rounds(ctx.schedule)
    assert len(calls) == ctx.kda_rounds
    for r, (index, returned, _) in enumerate(calls):
        assert index == sorted(i for rr, i in reads if rr == r)
        assert returned == len(index)
    assert sum(returned for _, returned, _ in calls) == len(reads)
    assert_close("o", o_tree, _expanded_kda(forest, *ins, chunk), 1e-12)


def test_a_late_fork_requests_one_state_of_many():
    from harts.tree import Trajectory

    T = Trajectory.make
    trajs = [T("a", "g", np.arange(40) % 7), T("b", "g", np.r_[np.arange(30) % 7, [9] * 6])]
    forest = build_forest(trajs)
    calls: list = []
    with mock.patch.object(backend, "chunk_kda", _spy_kda(calls)):
        TreeContext(forest, chunk_size=4).kda(0, *_inputs(forest.num_rows, torch.float64, 0), K**-0.5)
    # round 0 runs the 40-token trunk (10 boundary states); round 1 starts b from S(28) alone
    assert [(index, returned) for index, returned, _ in calls] == [([6], 1), ([], 0)]
    assert calls[0][2] == 10


def _aligned_states(forest, chunk: int) -> list[tuple[int, int]]:
    """Every (row at depth a-1, a) with a a positive multiple of the chunk size."""
    pos = forest.row_position
    return [(int(r), int(pos[r]) + 1) for r in np.flatnonzero((pos + 1) % chunk == 0)]


@settings(max_examples=15)
@given(trajectory_sets(max_len=30), st.sampled_from([2, 4]), st.data())
def test_a_recording_context_keeps_exactly_the_states_its_consumers_read(trajs, chunk, data):
    forest = build_forest(trajs)
    candidates = _aligned_states(forest, chunk)
    wanted = sorted(data.draw(st.sets(st.sampled_from(candidates), max_size=5))) if candidates else []
    ins = [x.requires_grad_() for x in _inputs(forest.num_rows, torch.float64, 1)]
    empty = np.zeros(0, np.int64)
    needs = StashNeeds(empty, empty, empty, wanted)
    kept = []
    for record_states in (None, wanted):
        ctx = TreeContext(forest, chunk_size=chunk, record=True, record_states=record_states)
        o = ctx.kda(0, *ins, K**-0.5)
        ctx.record.keep(needs)
        kept.append((ctx, o, ctx.record.kda_states[0]))
    (all_ctx, o_all, s_all), (some_ctx, o_some, s_some) = kept
    assert all(index is None for index in all_ctx.chunk_state_index)
    assert torch.equal(o_all, o_some)
    if wanted:
        assert torch.equal(s_all, s_some)
        # gradients through the kept states reach the inputs the same way
        w = torch.randn(s_all.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        grads = [torch.autograd.grad((s * w).sum(), ins, materialize_grads=True) for s in (s_all, s_some)]
        for name, a, b in zip("q k v g beta".split(), *grads, strict=True):
            if not b.any():
                # states do not depend on the queries
                assert not a.any(), f"d{name} should be exactly zero"
            else:
                assert_close(f"d{name} through kept states", a, b, 1e-10)
    # requested: the distinct states later rounds start from, plus the consumers' (mapped as
    # the schedule numbers them: the row's round, its sequence's state base and start)
    sch = some_ctx.schedule

    def numbered(row, a):
        return (int(sch.row_round[row]),
                int(sch.row_state_base[row]) + (a - int(sch.row_seq_start[row])) // chunk - 1)

    reads = _states_read_by_rounds(sch) | {numbered(row, a) for row, a in wanted}
    assert sum(index.size for index in some_ctx.chunk_state_index) == len(reads)
    for r, index in enumerate(some_ctx.chunk_state_index):
        assert index.tolist() == sorted(i for rr, i in reads if rr == r)
    # a consumer asking for a state that was not requested is refused, not served another
    missing = [s for s in candidates if numbered(*s) not in reads]
    if missing:
        ctx = TreeContext(forest, chunk_size=chunk, record=True, record_states=wanted)
        o = ctx.kda(0, *ins, K**-0.5)
        with pytest.raises(ValueError, match="not requested"):
            ctx.record.keep(StashNeeds(empty, empty, empty, missing[:1]))


@settings(max_examples=15)
@given(trajectory_sets(max_len=40), st.sampled_from([2, 4, 8]), st.integers(0, 2**16))
def test_fused_kda_mixing_equals_convs_then_kda(trajs, chunk, seed):
    """`TreeContext.kda_mixing` (the convs writing straight in the rounds' order, replayed
    rows repeated; the gate computed from its gathered low-rank features) against the plain
    path (three convs and the gate over the computed rows, then `kda` gathering into the
    rounds): the same output and the same gradients of the projections, conv weights, gate
    features and weights and betas, in float64."""
    from harts.exec.model.kda import kda_mixing

    forest = build_forest(trajs)
    R, W, r = forest.num_rows, 3, 5
    gen = torch.Generator().manual_seed(seed)
    widths = (H * K, H * K, H * V)
    leaves = [torch.randn(R, d, generator=gen, dtype=torch.float64) for d in widths]
    leaves += [torch.randn(d, W, generator=gen, dtype=torch.float64) * 0.5 for d in widths]
    leaves += [torch.randn(R, r, generator=gen, dtype=torch.float64), torch.randn(r, H * K, generator=gen,
                                                                                 dtype=torch.float64) * 0.3,
               torch.rand(R, H, generator=gen, dtype=torch.float64)]
    dy = torch.randn(R, H, V, generator=gen, dtype=torch.float64)
    got = {}
    for name in ("fused", "plain"):
        ctx = TreeContext(forest, chunk_size=chunk, kda_mode="replay")
        if name == "plain":
            ctx.kda_mixing = None  # kda_mixing's plain path: ctx.short_conv x 3, then ctx.kda
        xs = [t.clone().requires_grad_() for t in leaves]
        q, k, v, wq, wk, wv, f, wf, beta = xs

        def gate(f_nr, wf=wf):
            return -F.softplus((f_nr @ wf).view(-1, H, K))

        o = kda_mixing(ctx, 0, q, k, v, (wq, wk, wv), f, gate, beta, K**-0.5)
        (o * dy).sum().backward()
        got[name] = [o.detach(), *(x.grad for x in xs)]
    ctx = TreeContext(forest, chunk_size=chunk, kda_mode="replay")
    assert ctx.kda_mixing(0, *leaves[:3], tuple(leaves[3:6]), leaves[6], gate, leaves[8], K**-0.5) is not None
    for i, (a, b) in enumerate(zip(got["fused"], got["plain"], strict=True)):
        if not b.any():  # e.g. the gates' gradient when no row has a state before it
            assert not a.any()
            continue
        assert_close(f"output/grad {i}", a, b, 1e-12)
