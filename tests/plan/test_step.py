"""Plan -> StepWork: token, pair and KDA-round counts against the forest and the planners."""

from __future__ import annotations

import numpy as np
import pytest

from harts.config.plan import PlanConfig
from harts.plan.kda_calls import plan_kda_calls_for
from harts.plan.plan import Microbatch, Piece
from harts.plan.planners import known_planners, make_plan
from harts.plan.step import plan_kda_calls_of, step_from_plan, tree_microbatch_work
from harts.plan.work import segment_pairs
from harts.tree.workload import generate, preset


@pytest.fixture(scope="module")
def forest():
    return generate(preset("small-treestep")).forest()


@pytest.mark.parametrize("planner", ["expanded-ffd", "l1"] + (["l1l2"] if "l1l2" in known_planners() else []))
def test_totals_match_the_plan(forest, planner):
    plan = make_plan(forest, planner, PlanConfig(dp=2, microbatch_tokens=8192))
    step = step_from_plan(plan, forest)
    assert step.num_replicas == 2
    assert step.total_tokens() == plan.executed_tokens
    assert step.expanded_tokens == forest.expanded_tokens
    assert sum(w.expanded_tokens for w in step.microbatches) == forest.expanded_tokens
    for mb, w in zip(plan.microbatches, step.microbatches, strict=True):
        assert (w.mb, w.replica, w.slot, w.order, w.producer) == (mb.id, mb.replica, mb.slot, mb.order, mb.producer)
        assert w.kda_tokens >= w.tokens
        assert all(r.tokens > 0 and r.max_chunks >= 1 for r in w.kda_rounds)
        # a consumer reads its context rows from its producers' stashes
        assert w.context_rows == sum(p.end - p.start for p in mb.context)
        assert (w.context_rows > 0) == (mb.producer is not None)
    if planner == "expanded-ffd":
        lengths = forest.traj_length
        for mb, w in zip(plan.microbatches, step.microbatches, strict=True):
            ls = lengths[list(mb.trajectories)]
            assert w.attn_pairs_causal == int((ls * (ls + 1) // 2).sum()) and w.attn_pairs_tree == 0
            assert len(w.kda_rounds) == 1 and w.kda_tokens == w.tokens


def test_whole_forest_microbatch_matches_the_kda_planner(forest):
    pieces = tuple(Piece(v, 0, int(forest.node_length[v])) for v in range(forest.num_nodes))
    mb = Microbatch(id=0, replica=0, slot=0, order=0, trajectories=tuple(range(forest.num_trajectories)),
                    pieces=pieces, executed_tokens=forest.compact_tokens, expanded_tokens=forest.expanded_tokens)
    w = tree_microbatch_work(mb, forest)
    kp = plan_kda_calls_for(forest)
    assert len(w.kda_rounds) == kp.num_rounds
    assert w.kda_tokens == forest.compact_tokens + kp.replay_tokens
    want_pairs = int(segment_pairs(forest.node_start, forest.node_end).sum())
    assert w.attn_pairs == want_pairs
    # trees with forks need the ancestor mask
    assert w.attn_pairs_tree > 0


def test_entry_pieces_start_from_handed_off_states(forest):
    # a consumer computing only one deep leaf node: one round, replay = start mod 64
    leaf = int(np.flatnonzero(forest.node_num_children == 0)[0])
    s, e = int(forest.node_start[leaf]), int(forest.node_end[leaf])
    mb = Microbatch(id=1, replica=0, slot=0, order=1, trajectories=(), pieces=(Piece(leaf, 0, e - s),),
                    producer=0, executed_tokens=e - s)
    w = tree_microbatch_work(mb, forest)
    assert len(w.kda_rounds) == 1
    assert w.kda_tokens == (e - s) + s % 64
    assert w.kda_rounds[0].max_chunks == -(-(e - s + s % 64) // 64)
    assert w.attn_pairs_causal == segment_pairs(s, e) and w.attn_pairs_tree == 0


def test_a_plans_kda_calls_are_made_once(forest):
    import gc

    import harts.plan.step as plan_step

    plan = make_plan(forest, "l1", PlanConfig(dp=2, microbatch_tokens=8192))
    calls = plan_kda_calls_of(plan, forest, 64)
    assert set(calls) == {m.id for m in plan.microbatches}
    assert plan_kda_calls_of(plan, forest, 64) is calls  # made once per plan ...
    assert plan_kda_calls_of(plan, forest, 16) is not calls  # ... and chunk size
    # the simulator's counts from the shared plans are those of each microbatch planned alone
    step = step_from_plan(plan, forest, 64)
    assert step.microbatches == tuple(tree_microbatch_work(m, forest, 64) for m in plan.microbatches)
    # forgotten with the plan
    assert id(plan) in plan_step._PLAN_KDA_CALLS
    key = id(plan)
    del plan
    gc.collect()
    assert key not in plan_step._PLAN_KDA_CALLS
