"""l1l2's window re-cutting (`relevel.relevel_windows`) and slot hand-over between windows (`_reshape`,
1-slot windows): neither lengthens the slot-aligned critical path, every replica keeps its
slot count, every row is still computed once and the plans validate; at a 32k context cap
a tree a little over the budget becomes a 1-slot window (producer and consumer in one
slot)."""

from __future__ import annotations

import math

from hypothesis import given, settings

from harts.plan.metrics import compute_metrics
from harts.plan.planners import PlanConfig, make_plan
from harts.plan.planners.common import ForestIndex
from harts.plan.planners.l1l2 import STAGES, Cell, CellSolver
from harts.plan.planners.l1l2.arrange import arrange
from harts.plan.planners.l1l2.measure import critical_path
from harts.plan.planners.l1l2.relevel import line_up, relevel_windows, reshape
from harts.tree.workload import generate, preset
from tests.plan.l1l2_cells import (
    build_candidates,
    check_no_regression,
    check_rearranged,
    forest_and_config,
    swe64_32k_dp8,
    swe64_32k_dp8_states,
)


@settings(max_examples=20, deadline=None)
@given(forest_and_config)
def test_relevel_and_reshape_never_lengthen_the_critical_path_and_keep_plans_valid(forest_config):
    forest, config = forest_config
    idx, solver, candidates = build_candidates(forest, config, dealings=(True,))
    for cells in candidates:
        before = critical_path(cells, solver)
        snapshot = [list(row) for row in cells]
        loads = [[tuple(solver.loads(c)) for c in row] for row in cells]
        relevelled = relevel_windows(cells, solver)
        reshaped = reshape(cells, solver)
        # the input is left as it was (cells are copied, never re-cut in place)
        assert all(a == b for a, b in zip(cells, snapshot, strict=True))
        assert [[tuple(solver.loads(c)) for c in row] for row in cells] == loads
        for out in (relevelled, reshaped):
            assert critical_path(out, solver) <= before * (1 + 1e-9)
            check_rearranged(idx, forest, config, cells, out)
        both = relevel_windows(arrange(reshaped, solver), solver)
        assert critical_path(both, solver) <= before * (1 + 1e-9)
        check_rearranged(idx, forest, config, cells, both)


@settings(max_examples=15, deadline=None)
@given(forest_and_config)
def test_relevel_copies_keep_the_cells_work_and_fit_the_budget(forest_config):
    """A re-cut copy holds the same trees and the same total load; its producer and every
    microbatch of its window fit the budget, whatever the per-slot aim."""
    forest, config = forest_config
    idx, solver, candidates = build_candidates(forest, config, limit=2, dealings=(True,))
    for cells in candidates:
        for row in cells:
            for c in row:
                if c.k < 2 or not c.trees:
                    continue
                total = sum(solver.loads(c))
                for skew in (0.0, 0.3, -0.3):
                    aim = [total / c.k * (1 + skew * (1 if b == 0 else -1 / (c.k - 1))) for b in range(c.k)]
                    new = solver.relevel(c, aim)
                    if new is None:
                        continue
                    assert new is not c and new.trees == c.trees and new.k == c.k
                    assert math.isclose(sum(solver.loads(new)), total, rel_tol=1e-9)
                    assert solver.fits(new)


def test_one_slot_windows_at_a_32k_cap():
    """swe-treestep-64 at a 32k cap and budget, DP 8: a tree over the budget can run as a
    1-slot window (its producer and its one consumer in the same slot, each within the
    budget), the plan validates with every row computed once, and the line-up (cells
    arranged, windows re-cut, slots handed over) shortens the first stage's critical path
    and lifts its slot balance. (Property form of a test that pinned the balance to one
    measurement.)"""
    # the shape these targets were set on: the generator with its copies at the context cap
    # and last-turn forks (`allow_duplicates`, `last_turn_branching`)
    forest = generate(preset("swe-treestep-64", max_context=32768, allow_duplicates=True, last_turn_branching=True)).forest()
    config = PlanConfig(dp=8, microbatch_tokens=32768)
    idx = ForestIndex(forest, config.cost_model)
    solver = CellSolver(idx, config)
    big = [r for r in idx.roots if config.microbatch_tokens < idx.sub_rows[r] <= 1.2 * config.microbatch_tokens]
    assert big
    for t in big:
        c = Cell(k=1, trees=[t])
        assert solver.solve(c)
        assert c.trunk and math.isclose(solver.loads(c)[0], idx.sub_cost[t], rel_tol=1e-9)
    _, _, plan, m = swe64_32k_dp8()
    assert m.executed_tokens == forest.compact_tokens
    assert m.slots <= compute_metrics(make_plan(forest, "l1", config), forest).slots
    cons = plan.consumers()
    one_slot = [p for p, cs in cons.items() if len(cs) == 1 and plan.microbatches[cs[0]].slot == plan.microbatches[p].slot]
    assert one_slot
    ctx, states = swe64_32k_dp8_states()
    i = STAGES.index(line_up)
    before, after = states[i - 1].best.cells, states[i].best.cells
    check_no_regression(ctx.solver, before, after, p5=False)
    assert states[i].best.crit < states[i - 1].best.crit
    check_rearranged(ctx.idx, forest, config, before, after)
