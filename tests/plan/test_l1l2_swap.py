"""l1l2's tree swaps between cells (`swap.swap_trees`, the `swap_cells_trees` stage, on by
default with pp = 1): trees, cell
shapes and slot counts stay, every row is still computed once, the plans validate, the
critical path is no longer and the slot balance and its P5 no lower, the result is
deterministic, and on swe-treestep-64 at a 32k cap (DP 8) the default plan reaches 97.5%."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.plan.metrics import compute_metrics, slot_loads
from harts.plan.planners import PlanConfig, make_plan
from harts.plan.planners.l1l2 import STAGES, plan_with
from harts.plan.planners.l1l2.measure import critical_path
from harts.plan.planners.l1l2.recut import recut
from harts.plan.planners.l1l2.swap import SWAP_ROUNDS, swap_cells_trees, swap_trees
from harts.tree.workload import generate, preset
from tests.plan.l1l2_cells import (
    balances,
    build_candidates,
    check_rearranged,
    forest_and_config,
    layout,
    swe64_32k_dp8,
    swe64_32k_dp8_states,
    without,
)
from tests.strategies import plan_forests, tight_plan_configs

# budgets between the longest trajectory and the largest tree (1-slot windows, trees near
# the budget): where swaps are taken most often on small forests
forest_and_tight = plan_forests().flatmap(lambda f: st.tuples(st.just(f), tight_plan_configs(f)))


def _where(cells):
    """Each tree's (replica, cell index)."""
    return {t: (r, i) for r, row in enumerate(cells) for i, c in enumerate(row) for t in c.trees}


def _check_swapped(idx, solver, forest, config, cells) -> bool:
    """`swap_trees` on `cells` (left unchanged) checked; False when it kept them."""
    snapshot = [list(row) for row in cells]
    out = swap_trees(cells, solver)
    assert all(a == b for a, b in zip(cells, snapshot, strict=True))
    check_rearranged(idx, forest, config, cells, out)
    # every cell keeps its place and slot count; at most two trees a round change cells
    assert [[c.k for c in row] for row in out] == [[c.k for c in row] for row in cells]
    before, after = _where(cells), _where(out)
    assert sum(before[t] != after[t] for t in before) <= 2 * SWAP_ROUNDS
    assert layout(solver, swap_trees(cells, solver)) == layout(solver, out)
    if out is cells:
        return False
    old, new = balances(solver, cells), balances(solver, out)
    assert critical_path(out, solver) <= critical_path(cells, solver) * (1 + 1e-9)
    assert sum(new) / len(new) > sum(old) / len(old)
    assert np.percentile(new, 5) >= np.percentile(old, 5) - 1e-12
    return True


@settings(max_examples=30, deadline=None)
@given(st.one_of(forest_and_config, forest_and_tight))
def test_swaps_keep_trees_shapes_and_rows_and_never_lose(forest_config):
    forest, config = forest_config
    config = dataclasses.replace(config, pp=1)
    idx, solver, candidates = build_candidates(forest, config, limit=2, dealings=(True,))
    for cells in candidates:
        _check_swapped(idx, solver, forest, config, cells)
        _check_swapped(idx, solver, forest, config, recut(cells, solver))


def test_swaps_on_a_paper_sized_step():
    """swe-treestep-64 at a 32k cap, DP 8: the cells l1l2 hands to the swap stage (after
    the joint re-cut and the merged candidate) take swaps, and they keep everything
    `_check_swapped` checks."""
    ctx, states = swe64_32k_dp8_states()
    i = STAGES.index(swap_cells_trees)
    cells = states[i - 1].best.cells
    assert _check_swapped(ctx.idx, ctx.solver, ctx.idx.forest, ctx.config, cells)


def test_swaps_lift_the_dp8_balance_past_target_at_a_32k_cap():
    """swe-treestep-64 at a 32k cap and budget, DP 8, default config: slot balance below
    97.5% without the swaps, at or above it with them, P5 no lower, the path shorter,
    every row once, the same slots."""
    forest, config, plan, m = swe64_32k_dp8()
    no_swaps = plan_with(forest, config, without(swap_cells_trees))
    w = compute_metrics(no_swaps, forest)
    assert m.slot_balance >= 0.975 > w.slot_balance
    assert m.balance_p5 >= w.balance_p5 - 1e-12
    assert m.slots == w.slots
    assert m.executed_tokens == w.executed_tokens == forest.compact_tokens
    assert slot_loads(plan).max(axis=1).sum() < slot_loads(no_swaps).max(axis=1).sum()


def test_swaps_never_cost_balance_p5_or_path():
    """With and without the swaps (swe-treestep-16 at DP 2 and DP 4; swe-treestep-32 at
    DP 8): slot balance and P5 no lower, the critical path no longer, the slot count and
    compression the same."""
    for name, dps in (("swe-treestep-16", (2, 4)), ("swe-treestep-32", (8,))):
        forest = generate(preset(name, max_context=32768)).forest()
        for dp in dps:
            config = PlanConfig(dp=dp, microbatch_tokens=32768)
            with_swaps = make_plan(forest, "l1l2", config)
            no_swaps = plan_with(forest, config, without(swap_cells_trees))
            with_swaps.validate(forest, cost_model=config.cost_model)
            a, b = compute_metrics(with_swaps, forest), compute_metrics(no_swaps, forest)
            assert a.slot_balance >= b.slot_balance - 1e-12
            assert a.balance_p5 >= b.balance_p5 - 1e-12
            assert a.slots == b.slots and a.compression == b.compression
            assert (slot_loads(with_swaps).max(axis=1).sum()
                    <= slot_loads(no_swaps).max(axis=1).sum() * (1 + 1e-9))
