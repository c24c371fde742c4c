"""l1l2 on one replica computes every row of a forest once, on the shape families at any
budget around their longest path: a tree over the budget gets a cell of as many slots as
it needs to solve (`cells.own_slots`), and a tree no one-window cell holds (a trunk whose
branches do not fit beside its retained rows) runs as nested windows
(`pipeline.nested_trees`, chained by `make_plan`) instead of leaving the forest to L1's
recomputation; with microbatch floors the nested plan competes with the planner's own."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, example, given, settings

from harts.config.plan import PlanConfig
from harts.plan.planners import make_plan
from harts.plan.planners.chains import step_load
from harts.plan.planners.l1l2 import nested_trees, plan_with
from harts.tree import build_forest, shapes
from tests.strategies import family_plan_cases


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family_plan_cases())
# a tree whose one-window cell solves only on more slots than L1 takes (6 against 5), which
# the planner's search never reaches: nested, not recomputed
@example((build_forest(shapes.draw("bushy", 11, 512, vocab_size=256)),
          PlanConfig(microbatch_tokens=384, chunk_size=8, producer_retention=0.5)))
def test_one_replica_computes_every_row_once(case):
    forest, config = case
    plan = make_plan(forest, "l1l2", config)
    assert plan.executed_tokens == forest.compact_tokens
    assert max(plan.memory_tokens()) <= config.microbatch_tokens * (1 + 1e-9)


def test_a_long_prompt_tree_shares_at_a_budget_just_over_its_longest_path():
    # a 10.5k prompt with 92 short responses: its rows ask for 5 cells of 11,147 rows, but
    # every consumer holds 0.35 of the prompt, so the cell solves on 6 (before, no slot
    # count had a windowed plan and each response recomputed the prompt: 15x the rows)
    forest = build_forest(shapes.draw("fanout", 1, 16384, vocab_size=1024))
    budget = int(forest.traj_length.max())
    plan = make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=budget, chunk_size=64))
    assert plan.executed_tokens == forest.compact_tokens
    assert any(m.producer is not None for m in plan.microbatches)
    assert not plan.info.get("nested_trees")


def test_a_deep_tree_runs_as_nested_windows():
    # an SWE-agent tree at 0.7 of the budget it was drawn at: every trajectory fits, but
    # no one-window cell holds the tree
    forest = build_forest(shapes.draw("swe-tree", 4, 16384, vocab_size=1024))
    config = PlanConfig(microbatch_tokens=11468, chunk_size=64)
    assert int(forest.traj_length.max()) <= config.microbatch_tokens
    assert nested_trees(forest, config) == [0]
    own = plan_with(forest, config)
    assert own.executed_tokens > 2 * forest.compact_tokens  # L1's recomputation
    plan = make_plan(forest, "l1l2", config)
    assert plan.info["nested_trees"] == 1 and plan.executed_tokens == forest.compact_tokens
    depth = {}
    for m in plan.microbatches:
        depth[m.id] = 0 if m.producer is None else depth[m.producer] + 1
    assert max(depth.values()) >= 2
    assert plan.info["nested_load"]["nested"] < plan.info["nested_load"]["own"]


def test_with_floors_the_lighter_of_nested_and_own_is_kept():
    forest = build_forest(shapes.draw("swe-tree", 4, 16384, vocab_size=1024))
    base = PlanConfig(microbatch_tokens=11468, chunk_size=64)
    chose = []
    for floor, consumer in ((0.0, 0.0), (2e4, 5e3), (2e5, 5e4), (0.0, 1e7)):
        config = dataclasses.replace(base, microbatch_floor=floor, consumer_floor=consumer)
        plan = make_plan(forest, "l1l2", config)
        priced = plan.info["nested_load"]
        assert step_load(plan, config) == min(priced.values())
        assert bool(plan.info.get("nested_trees")) == (priced["nested"] < priced["own"])
        chose.append(bool(plan.info.get("nested_trees")))
    # a consumer floor far above every microbatch's load: L1's plan, which has no
    # consumers, is the lighter
    assert chose == [True, True, True, False]


def test_trees_that_solve_alone_but_not_together_are_nested():
    # three trees of a drawn forest need 2 + 3 slots with windows beside one more
    # microbatch of the third's rows: six, where L1 takes five and the search stops.
    # Each alone solves, so no single tree was named and l1l2 fell to L1's recomputation
    forest = build_forest(shapes.draw("stepwise", 22, 512, vocab_size=256))
    config = PlanConfig(microbatch_tokens=480, chunk_size=8, producer_retention=0.5)
    assert plan_with(forest, config).executed_tokens > forest.compact_tokens
    assert nested_trees(forest, config) == [0, 26]
    plan = make_plan(forest, "l1l2", config)
    assert plan.executed_tokens == forest.compact_tokens
    assert plan.info["nested_trees"] == 2
