"""The tree MixingContext against the same ops run trajectory by trajectory.

Inputs are drawn per compact row, then expanded through the trajectory -> row map, so the
expanded path sees exactly the values the tree path sees; outputs are compared after
mapping the tree's rows back to every trajectory position.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.exec.ops.conv import short_conv, window_from_cu_seqlens
from harts.exec.ops.kda import chunk_kda
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
