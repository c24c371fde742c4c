"""Short trees beside long ones: the planner's plain microbatches (whole short trees, no
window) move into the window trees' leaves that have room for them
(`harts.plan.planners.leaves.fill_leaves`), so the same rows run in fewer microbatches."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings

from harts.config.plan import PlanConfig
from harts.plan.memory import continues
from harts.plan.planners import make_plan
from harts.tree import build_forest, shapes
from tests.strategies import long_family_plan_cases


def _plain_and_leaves(plan):
    producers = {m.producer for m in plan.microbatches if m.producer is not None}
    plain = [m for m in plan.microbatches if m.producer is None and m.id not in producers]
    leaves = [m for m in plan.microbatches if m.producer is not None and m.id not in producers]
    return plain, leaves


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(long_family_plan_cases())
def test_no_short_tree_is_left_in_a_microbatch_of_its_own_where_a_leaf_has_room(case):
    forest, config = case
    plan = make_plan(forest, "l1l2", config)
    plan.validate(forest, cost_model=config.cost_model)
    # every row computed once, unless a tree was split over replicas (its groups' shared
    # rows once per group: harts.plan.planners.tree_split)
    assert (plan.executed_tokens > forest.compact_tokens) == bool(plan.info.get("split_trees"))
    assert max(m.executed_tokens for m in plan.microbatches) <= config.microbatch_tokens
    plain, leaves = _plain_and_leaves(plan)
    rows = {m.id: m.executed_tokens for m in plan.microbatches}
    for m in plain:
        for leaf in leaves:
            if leaf.replica != m.replica:
                continue
            charge = config.producer_retention * rows[leaf.producer]
            if plan.chain_retention is not None and continues(leaf.pieces, plan.microbatches[leaf.producer].pieces):
                # a chain piece: the smaller of that and the chain charge over its context
                charge = min(charge, plan.chain_retention * sum(e - a for _, a, e in leaf.context))
            room = config.microbatch_tokens - charge - leaf.executed_tokens
            assert room < m.executed_tokens, (m.id, leaf.id, room)


def test_long_agent_short_trajectories_ride_in_a_consumer():
    # long-agent/1 at 16k: 1-3 short trajectories (8,052 rows) beside a long agent tree;
    # they fill one of its leaves
    forest = build_forest(shapes.draw("long-agent", 1, 16384, vocab_size=1024))
    plan = make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=16384, chunk_size=64, chain_retention=None))
    # every microbatch left is the window tree's: the short trees' own one is gone
    assert plan.info["filled_leaves"] == 1 and len(plan.microbatches) == plan.info["chain_microbatches"]
    plain, _ = _plain_and_leaves(plan)
    assert not plain
    assert plan.executed_tokens == forest.compact_tokens
