"""Step planners: every plan validates on drawn forests, l1l2 compresses at least as well
as l1 and never needs more slots, the same seed gives the same plan, the registry fails
loudly."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.config.costs import TokenCost
from harts.config.plan import PlanConfig
from harts.plan.metrics import compute_metrics
from harts.plan.plan import PlanMode
from harts.plan.planners import PlannerName, get_planner, known_planners, make_plan
from harts.plan.planners.chains import step_load
from harts.plan.planners.common import ForestIndex, first_fit_decreasing, lpt_balanced, tree_units
from harts.plan.planners.registry import register_planner
from harts.tree.workload import generate, preset
from tests.strategies import plan_configs, plan_forests

forest_and_config = plan_forests().flatmap(lambda f: st.tuples(st.just(f), plan_configs(f)))


def _check(plan, forest, config):
    plan.validate(forest, cost_model=config.cost_model)
    assert plan.dp == config.dp
    assert plan.expanded_tokens == forest.expanded_tokens
    # every row of the forest is computed somewhere (tree mode), at most once per window
    if plan.mode == PlanMode.TREE:
        assert plan.executed_tokens >= forest.compact_tokens


@given(forest_and_config, st.sampled_from(list(PlannerName)))
def test_every_planner_validates(forest_config, name):
    forest, config = forest_config
    _check(make_plan(forest, name, config), forest, config)


@given(forest_and_config)
def test_l1l2_compresses_at_least_like_l1(forest_config):
    forest, config = forest_config
    # every tree on one replica: a tree split over replicas computes its groups' shared
    # rows once per group (harts.plan.planners.tree_split), trading compression for balance
    split, config = config, dataclasses.replace(config, split_trees=False)
    l1 = make_plan(forest, "l1", config)
    l1l2 = make_plan(forest, "l1l2", config)
    # the split is kept only where it lightens the step
    assert step_load(make_plan(forest, "l1l2", split), split) <= step_load(l1l2, split) * (1 + 1e-9)
    assert l1l2.executed_tokens <= l1.executed_tokens
    if l1l2.info.get("nested_trees"):
        # trees no one-window cell holds ran as nested windows: chosen for a lighter step
        # than the planner's own plan, even where their windows take more slots
        priced = l1l2.info["nested_load"]
        assert priced["nested"] < priced["own"]
    else:
        assert l1l2.num_slots <= l1.num_slots
    # never below the compact size, never above the expanded one
    assert forest.compact_tokens <= l1l2.executed_tokens <= forest.expanded_tokens


@settings(max_examples=10)
@given(forest_and_config, st.sampled_from(list(PlannerName)))
def test_same_seed_same_plan(forest_config, name):
    forest, config = forest_config
    a = dataclasses.replace(make_plan(forest, name, config), plan_seconds=0.0)
    b = dataclasses.replace(make_plan(forest, name, config), plan_seconds=0.0)
    assert a.to_json() == b.to_json()


@given(forest_and_config)
def test_expanded_plan_holds_copies(forest_config):
    forest, config = forest_config
    plan = make_plan(forest, "expanded-ffd", config)
    assert plan.mode == PlanMode.EXPANDED
    assert compute_metrics(plan, forest).compression == 1.0
    held = sorted(t for mb in plan.microbatches for t in mb.trajectories)
    assert held == list(range(forest.num_trajectories))


def test_tree_units_cover_every_trajectory_once():
    forest = generate(preset("small-stepwise", seed=3)).forest()
    idx = ForestIndex(forest, TokenCost())
    budget = int(forest.traj_length.max())
    units = tree_units(idx, budget)
    owned = sorted(t for u in units for t in u.trajs)
    assert owned == list(range(forest.num_trajectories))
    assert all(u.tokens <= budget for u in units)
    # trees larger than the budget were split: some unit carries a recomputed path
    assert any(u.path for u in units)


def test_packing_helpers():
    size = [5, 4, 3, 3, 2, 1]
    bins = first_fit_decreasing(list(range(6)), size, 6)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(sum(size[i] for i in b) <= 6 for b in bins) and len(bins) == 3
    spread = lpt_balanced(list(range(6)), [float(s) for s in size], size, 3, 7)
    assert sorted(sum(size[i] for i in b) for b in spread) == [6, 6, 6]
    assert lpt_balanced([0], [1.0], [9], 2, 8) is None


def test_l1l2_on_a_tree_step_shares_and_balances():
    """A scaled-down SWE tree-step: l1l2 computes every row once and evens the slots."""
    forest = generate(preset("swe-treestep-8")).forest()
    config = PlanConfig(dp=2)
    l1 = compute_metrics(make_plan(forest, "l1", config), forest)
    plan = make_plan(forest, "l1l2", config)
    m = compute_metrics(plan, forest)
    assert m.executed_tokens == forest.compact_tokens
    assert m.slots <= l1.slots
    assert m.slot_balance > l1.slot_balance
    assert any(mb.producer is not None for mb in plan.microbatches)


def test_a_trajectory_over_the_budget_is_chained_and_below_two_chunks_refused():
    # every planner cuts trajectories longer than the budget into chains of windows
    # (harts.plan.planners.chains); a budget below two KDA chunks is refused in one line
    forest = generate(preset("tiny-treestep")).forest()
    too_small = int(forest.traj_length.max()) - 1
    for name in known_planners():
        plan = make_plan(forest, name, PlanConfig(microbatch_tokens=too_small, chunk_size=8))
        assert plan.info["chains"] >= 1 and max(plan.memory_tokens()) <= too_small
        with pytest.raises(ValueError, match="below two KDA chunks"):
            make_plan(forest, name, PlanConfig(microbatch_tokens=15, chunk_size=8))


def test_registry_fails_loudly():
    assert known_planners() == ["expanded-ffd", "ortools-ffd", "l1", "l1l2"]
    with pytest.raises(ValueError, match="unknown planner 'l3'; known planners: expanded-ffd, "
                                         "ortools-ffd, l1, l1l2"):
        get_planner("l3")
    with pytest.raises(ValueError, match="registered twice"):
        register_planner(PlannerName.L1)(lambda forest, config: None)
    with pytest.raises(TypeError, match="PlannerName members"):
        register_planner("l9")(lambda forest, config: None)


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"dp": 0}, "dp"), ({"microbatch_tokens": 0}, "microbatch_tokens"),
     ({"producer_retention": -1.0}, "producer_retention"), ({"time_limit": 0.0}, "time_limit"),
     ({"chunk_size": 0}, "chunk_size")],
)
def test_config_is_checked(changes, message):
    forest = generate(preset("tiny-treestep")).forest()
    with pytest.raises(ValueError, match=message):
        make_plan(forest, "l1", PlanConfig(**changes))


def test_ortools_returns_a_plan_under_a_tiny_limit():
    forest = generate(preset("small-treestep", seed=5)).forest()
    config = PlanConfig(dp=3, microbatch_tokens=int(forest.traj_length.max()), time_limit=1e-3)
    plan = make_plan(forest, "ortools-ffd", config)
    assert plan.info["cp_sat_status"] in ("OPTIMAL", "FEASIBLE", "UNKNOWN")
    _check(plan, forest, config)


def test_shaved_prefixes_end_on_the_chunk_grid():
    forest = generate(preset("swe-treestep-8")).forest()
    config = PlanConfig(dp=2)
    plan = make_plan(forest, "l1l2", config)
    start = forest.node_start
    cuts = [start[p.node] + p.start for mb in plan.microbatches for p in mb.pieces if p.start > 0]
    assert cuts, "expected l1l2 to cut some node into pieces"
    assert np.all(np.asarray(cuts) % config.chunk_size == 0)
