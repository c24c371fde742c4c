"""The toy planner of docs/ARCHITECTURE.md ("Add a planner"), followed step by step: one
microbatch per tree. It keeps that walkthrough honest: the planner below is built only from
what the walkthrough names, and its plans validate on drawn forests. (That a valid plan
trains exactly like the expanded baseline is tests/exec/test_window.py's job, over the
registered planners.)

The walkthrough registers a planner by adding a `PlannerName` member; a test cannot extend
that StrEnum, so here the same `Registry` mechanism runs on a local one-member StrEnum, and
`make_plan`'s steps (config check, planner call, `Plan.validate`) are called directly
(tests/test_walkthroughs.py runs it through `harts plan compare`).
"""

from __future__ import annotations

from enum import StrEnum

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.plan.plan import Plan, PlanMode
from harts.plan.planners import PlanConfig
from harts.plan.planners.common import ForestIndex, TreeMB, finalize_tree, place_sorted
from harts.plan.planners.registry import PlannerFn
from harts.registry import Registry
from harts.tree.forest import RolloutForest
from tests.strategies import plan_configs, plan_forests


class ToyName(StrEnum):
    ONE_TREE_EACH = "one-tree-each"


_TOY: Registry[ToyName, PlannerFn] = Registry("planner", ToyName, ValueError, "known planners")


def plan_one_tree_each(forest: RolloutForest, config: PlanConfig) -> Plan:
    """Each tree (one group's radix tree) computed whole in a microbatch of its own."""
    idx = ForestIndex(forest, config.cost_model)
    mbs = []
    for root in idx.roots:
        mb = TreeMB()
        for v in range(root, idx.sub_end[root] + 1):  # a subtree is a DFS range of nodes
            mb.add_node(idx, v)
        mb.trajs.extend(idx.trajs_in_subtree(root))
        if mb.tokens > config.microbatch_tokens:
            raise ValueError(
                f"tree at node {root} has {mb.tokens} rows, more than the microbatch budget "
                f"{config.microbatch_tokens}"
            )
        mbs.append(mb)
    for mb, (replica, slot) in zip(mbs, place_sorted([m.cost for m in mbs], config.dp), strict=True):
        mb.replica, mb.slot = replica, slot
    for r in range(config.dp):
        for order, mb in enumerate(sorted((m for m in mbs if m.replica == r), key=lambda m: m.slot)):
            mb.order = order
    return finalize_tree(idx, mbs, config, ToyName.ONE_TREE_EACH.value, {"trees": len(mbs)})


_TOY.register(ToyName.ONE_TREE_EACH, plan_one_tree_each)


def _make(forest: RolloutForest, config: PlanConfig) -> Plan:
    # what harts.plan.planners.registry.make_plan does, on the local registry
    config.validate()
    plan = _TOY.get("one-tree-each")(forest, config)
    plan.validate(forest, cost_model=config.cost_model)
    return plan


def _fits_whole_trees(forest: RolloutForest, config: PlanConfig) -> bool:
    idx = ForestIndex(forest, config.cost_model)
    return all(idx.sub_rows[r] <= config.microbatch_tokens for r in idx.roots)


@settings(max_examples=30, deadline=None)
@given(plan_forests().flatmap(lambda f: st.tuples(st.just(f), plan_configs(f))))
def test_toy_plans_validate_and_hold_one_tree_each(forest_config):
    forest, config = forest_config
    if not _fits_whole_trees(forest, config):
        with pytest.raises(ValueError, match="more than the microbatch budget"):
            _make(forest, config)
        return
    plan = _make(forest, config)
    assert plan.mode == PlanMode.TREE and plan.dp == config.dp
    assert plan.num_microbatches == forest.roots.size
    # no row is computed twice: the compression is the forest's own
    assert plan.executed_tokens == forest.compact_tokens
    assert plan.expanded_tokens == forest.expanded_tokens
    owned = sorted(t for mb in plan.microbatches for t in mb.trajectories)
    assert owned == list(range(forest.num_trajectories))


def test_unknown_toy_name_fails_loudly():
    with pytest.raises(ValueError, match="known planners: one-tree-each"):
        _TOY.get("one-tree")
    with pytest.raises(ValueError, match="registered twice"):
        _TOY.register(ToyName.ONE_TREE_EACH, plan_one_tree_each)

