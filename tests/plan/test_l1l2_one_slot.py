"""l1l2's 1-slot windows as first-class cells: a tree over the budget whose producer and
one consumer fit the budget (the consumer paying the producer's retention) is dealt to a
cell of one slot by itself (`CellSolver.alone`, `cells.assign_trees`), and a cell that cannot
use all its slots (a one-node tree cannot be split over two) runs on fewer, the rest left
empty (`cells.solve_cell`). Candidate plans keep every replica's slot count, validate and
compute every row once; l1l2 still never compresses worse than l1. On swe-treestep-64 at
a 32k cap (most trees a little over the budget), DP 16 and DP 32 get windows: the
forest's compression with fewer slots than l1 and a shorter (pipelined) critical path."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.plan.planners import PlanConfig, make_plan
from harts.plan.planners.common import (
    ForestIndex,
    finalize_tree,
    pipelined_critical_path,
    step_load,
)
from harts.plan.planners.l1l2 import CellSolver
from harts.plan.planners.l1l2.cells import assign_trees, build, group_options
from harts.plan.planners.l1l2.microbatches import to_microbatches
from harts.tree.workload import generate, preset
from tests.strategies import plan_forests, tight_plan_configs

forest_and_tight = plan_forests().flatmap(lambda f: st.tuples(st.just(f), tight_plan_configs(f)))


@given(forest_and_tight)
def test_alone_trees_fit_one_slot_with_every_row_once(forest_config):
    forest, config = forest_config
    idx = ForestIndex(forest, config.cost_model)
    solver = CellSolver(idx, config)
    budget, rho = config.microbatch_tokens, config.producer_retention
    for t in idx.roots:
        c = solver.solved(1, [t])
        if idx.sub_rows[t] <= budget or c is None:
            assert t not in solver.alone()
            continue
        assert t in solver.alone()
        # producer and consumer each within the budget, the consumer paying the retention
        assert c.k == 1 and c.trees == [t]
        assert 0 < c.p_tokens() <= budget
        assert c.bin_tokens(0) + rho * c.p_tokens() <= budget
        # every row of the tree once: producer rows + consumer rows, the whole cost in one slot
        assert c.p_tokens() + c.bin_tokens(0) == idx.sub_rows[t]
        oh = config.cost_model.microbatch_overhead
        assert math.isclose(solver.loads(c)[0], idx.sub_cost[t] + 2 * oh, rel_tol=1e-9)


@given(forest_and_tight)
def test_assigned_one_slot_cells_over_their_room_hold_one_alone_tree(forest_config):
    forest, config = forest_config
    idx = ForestIndex(forest, config.cost_model)
    solver = CellSolver(idx, config)
    alone = solver.alone()
    sizes = [1, 2, 1, 1] * config.dp
    cap = [0.9 * k * config.microbatch_tokens for k in sizes]
    cells = assign_trees(idx, sizes, cap, {}, None, alone)
    if cells is None:
        return
    assert sorted(t for c in cells for t in c) == sorted(idx.roots)
    for k, room, trees in zip(sizes, cap, cells, strict=True):
        if sum(idx.sub_rows[t] for t in trees) > room:
            assert k == 1 and len(trees) == 1 and trees[0] in alone


@settings(max_examples=20, deadline=None)
@given(forest_and_tight)
def test_candidates_keep_slot_counts_and_compute_every_row_once(forest_config):
    forest, config = forest_config
    idx = ForestIndex(forest, config.cost_model)
    solver = CellSolver(idx, config)
    lower = max(1, math.ceil(forest.compact_tokens / (config.dp * config.microbatch_tokens)))
    for slots in range(lower, lower + 3):
        for groups in group_options(slots)[:4]:
            cells = build(idx, solver, config.dp, slots, groups, True)
            if cells is None:
                continue
            assert [sum(c.k for c in row) for row in cells] == [slots] * config.dp
            assert sorted(t for row in cells for c in row for t in c.trees) == sorted(idx.roots)
            for row in cells:
                for c in row:
                    assert len(c.bins) == c.k
                    if c.trees:
                        assert solver.fits(c)
            plan = finalize_tree(idx, to_microbatches(idx, cells), config, "l1l2")
            plan.validate(forest, cost_model=config.cost_model)
            assert plan.executed_tokens == forest.compact_tokens
    if not solver.alone():
        return
    # a 1-slot window is a cell of one slot whose one consumer reads a producer
    for slots in range(lower, lower + 3):
        cells = build(idx, solver, config.dp, slots, slots, True)
        if cells is not None:
            for row in cells:
                for c in row:
                    if c.k == 1 and c.trees and c.trees[0] in solver.alone():
                        assert c.reads_producer(0) and c.p_tokens() > 0


@given(forest_and_tight)
def test_l1l2_with_tight_budgets(forest_config):
    forest, config = forest_config
    # every tree on one replica (a tree split over replicas recomputes its groups' shared rows)
    config = dataclasses.replace(config, split_trees=False)
    l1 = make_plan(forest, "l1", config)
    l1l2 = make_plan(forest, "l1l2", config)
    l1l2.validate(forest, cost_model=config.cost_model)
    assert forest.compact_tokens <= l1l2.executed_tokens <= l1.executed_tokens
    if config.pp == 1:
        priced = l1l2.info.get("nested_load")
        if priced and priced["nested"] < priced["own"]:
            # nested window trees, kept for a lighter step than l1l2's own slots: they may
            # take more slots (a tree's chain of windows is several), never a heavier step
            assert step_load(l1l2, config) == pytest.approx(priced["nested"])
        else:
            assert l1l2.num_slots <= l1.num_slots


def _pipelined_critical_path(plan, config) -> float:
    """The measure l1l2 scores plans by, from a plan: slot loads with each producer's
    forward share on its first consumer's slot and its backward share on its last's, plus
    the fill and drain of every replica's first and last consumer passes."""
    cm = config.cost_model
    ff, oh = cm.forward_fraction, cm.microbatch_overhead
    cons = plan.consumers()
    mbs = plan.microbatches
    loads = [[0.0] * plan.num_slots for _ in range(plan.dp)]
    for m in mbs:
        if m.id in cons:
            loads[m.replica][mbs[cons[m.id][0]].slot] += ff * (oh + m.cost)
            loads[m.replica][mbs[cons[m.id][-1]].slot] += (1 - ff) * (oh + m.cost)
        else:
            loads[m.replica][m.slot] += oh + m.cost
    ends = []
    for r in range(plan.dp):
        run = sorted((m for m in mbs if m.replica == r and m.id not in cons), key=lambda m: m.order)
        x = 0.0
        for m, frac, which in ((run[0], ff, 0), (run[-1], 1 - ff, -1)):
            x += frac * (oh + m.cost)
            if m.producer is not None and cons[m.producer][which] == m.id:
                x += frac * (oh + mbs[m.producer].cost)
        ends.append(x)
    return pipelined_critical_path(loads, config.pp, ends)


@pytest.mark.parametrize(("dp", "pp"), [(16, 1), (16, 2), (16, 4), (32, 2)])
def test_swe_treestep_64_at_32k_gets_windows_at_high_dp(dp, pp):
    """Four (DP 16) or two (DP 32) trees per replica, most a little over the 32k budget:
    with 1-slot windows l1l2 computes every row once on no more slots than l1 and with a
    shorter (pipelined) critical path than l1's plan."""
    forest = generate(preset("swe-treestep-64", max_context=32768)).forest()
    config = PlanConfig(dp=dp, pp=pp, microbatch_tokens=32768)
    l1 = make_plan(forest, "l1", config)
    plan = make_plan(forest, "l1l2", config)
    plan.validate(forest, cost_model=config.cost_model)
    assert plan.executed_tokens == forest.compact_tokens < l1.executed_tokens
    assert plan.num_slots <= l1.num_slots
    assert _pipelined_critical_path(plan, config) < _pipelined_critical_path(l1, config)
    if dp == 16:
        # one tree per slot: trees over the budget run as 1-slot windows
        cons = plan.consumers()
        mbs = plan.microbatches
        assert any(len(cs) == 1 and mbs[cs[0]].slot == mbs[p].slot for p, cs in cons.items())
