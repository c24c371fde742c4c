"""A tree holding more than a replica's share of the step, split over data-parallel
replicas (`harts.plan.planners.tree_split`): its trajectories in groups, each group's
root paths a window tree of its own; kept where the finished plan's step load is lower."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harts.config.plan import PlanConfig
from harts.plan.planners import make_plan
from harts.plan.planners.chains import heavy_trees, step_load
from harts.plan.planners.common import ForestIndex, floored_load, lockstep_load
from harts.plan.planners.tree_split import group_trajectories
from harts.tree import build_forest, shapes
from tests.strategies import long_chain_trajectories, split_tree_cases


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(split_tree_cases(), st.integers(2, 6), st.sampled_from(("contiguous", "fork")))
def test_groups_partition_a_trees_trajectories(case, k, how):
    forest, config = case
    idx = ForestIndex(forest, config.cost_model)
    for r in forest.roots.tolist():
        groups = group_trajectories(idx, r, k, how)
        flat = sorted(t for g in groups for t in g)
        assert flat == sorted(idx.trajs_in_subtree(r))
        assert 1 <= len(groups) <= min(k, len(flat)) and all(groups)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(split_tree_cases(), st.sampled_from(("l1", "l1l2")))
def test_split_plans_are_valid_and_cover_every_row(case, planner):
    forest, config = case
    plan = make_plan(forest, planner, config)
    plan.validate(forest, cost_model=config.cost_model)
    # every row of every trajectory's path is computed on the replica that owns it
    starts = forest.node_row_start
    for m in plan.microbatches:
        if not m.trajectories:
            continue
        chain, rows = m, set()
        while chain is not None:
            rows |= {int(starts[v]) + i for v, a, b in chain.pieces for i in range(a, b)}
            chain = None if chain.producer is None else plan.microbatches[chain.producer]
        for t in m.trajectories:
            v, path = int(forest.traj_node[t]), set()
            while v >= 0:
                path |= set(range(int(starts[v]), int(starts[v]) + int(forest.node_length[v])))
                v = int(forest.node_parent[v])
            assert path <= rows, (m.id, t)
    if plan.info.get("split_trees"):
        # a split computes the rows its groups share once per group
        assert plan.executed_tokens > forest.compact_tokens


def test_a_group_under_a_long_prompt_is_split_over_both_replicas():
    # long-group/105 drawn at 16k and planned at 8k: a prompt under four responses, one of
    # 54,859 tokens; unsplit, one replica computes the whole tree
    forest = build_forest(shapes.draw("long-group", 105, 16384))
    config = PlanConfig(dp=2, microbatch_tokens=8192)
    assert heavy_trees(forest, 2)
    plan = make_plan(forest, "l1l2", config)
    assert plan.info["split_trees"] == [2]
    assert {m.replica for m in plan.microbatches} == {0, 1}
    one = make_plan(forest, "l1l2", PlanConfig(dp=1, microbatch_tokens=8192))
    # the heavier replica holds the longest trajectory's chain, well under the whole tree
    assert step_load(plan, config) < 0.8 * step_load(one, PlanConfig(dp=1, microbatch_tokens=8192))


def test_trees_within_a_replicas_share_are_not_split():
    # two long trees of like size, one per replica, as before
    trajs = long_chain_trajectories(70, [(19, 12), (32, 20), (33, 5), (60, 6)], seed=2, groups=2)
    forest = build_forest(trajs)
    plan = make_plan(forest, "l1l2", PlanConfig(dp=2, microbatch_tokens=24, chunk_size=8))
    assert "split_trees" not in plan.info
    assert plan.executed_tokens == forest.compact_tokens
    assert np.array_equal(np.unique([m.replica for m in plan.microbatches]), [0, 1])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(split_tree_cases(), st.sampled_from((2, 4)))
def test_an_expert_parallel_group_is_priced_in_lockstep(case, dp):
    # ep = dp: the replicas' passes in joint events, each as long as its longest pass, so
    # the group's step is never shorter than its heaviest replica's passes back to back
    forest, config = case
    config = dataclasses.replace(config, dp=dp, ep=dp, microbatch_floor=50.0, consumer_floor=10.0)
    plan = make_plan(forest, "l1l2", config)
    plan.validate(forest, cost_model=config.cost_model)
    assert step_load(plan, config) == lockstep_load(plan, config)
    assert lockstep_load(plan, config) >= floored_load(plan.microbatches, config) * (1 - 1e-9)
    # the split is kept only where it lightens the lockstep
    unsplit = make_plan(forest, "l1l2", dataclasses.replace(config, split_trees=False))
    assert step_load(plan, config) <= step_load(unsplit, config) * (1 + 1e-9)


def test_ep_must_divide_dp():
    with pytest.raises(ValueError, match="divide dp=4"):
        PlanConfig(dp=4, ep=3)

