"""l1l2's joint re-cut of all windows (`recut.recut`, a linear program over every window's
slot loads, applied with `CellSolver.relevel`; the `recut_windows` stage): never a longer
slot-aligned critical path, never a lower slot balance, every replica keeps its slot
count and trees, every row is still computed once and the plans validate."""

from __future__ import annotations

import math

from hypothesis import given, settings

from harts.plan.metrics import compute_metrics
from harts.plan.planners.l1l2 import STAGES, plan_with
from harts.plan.planners.l1l2.measure import critical_path, slot_balance
from harts.plan.planners.l1l2.recut import recut, recut_windows, window_ranges
from tests.plan.l1l2_cells import (
    build_candidates,
    check_no_regression,
    check_rearranged,
    forest_and_config,
    layout,
    loads,
    swe64_32k_dp8,
    swe64_32k_dp8_states,
    windows,
)


@settings(max_examples=20, deadline=None)
@given(forest_and_config)
def test_recut_never_lengthens_the_path_nor_lowers_the_balance(forest_config):
    forest, config = forest_config
    idx, solver, candidates = build_candidates(forest, config, dealings=(True,))
    for cells in candidates:
        snapshot = [list(row) for row in cells]
        before_loads = [[tuple(solver.loads(c)) for c in row] for row in cells]
        before = critical_path(cells, solver)
        out = recut(cells, solver)
        # the input is left as it was
        assert all(a == b for a, b in zip(cells, snapshot, strict=True))
        assert [[tuple(solver.loads(c)) for c in row] for row in cells] == before_loads
        assert critical_path(out, solver) <= before * (1 + 1e-9)
        if len({len(v) for v in loads(solver, cells)}) == 1:
            assert slot_balance(loads(solver, out)) >= slot_balance(loads(solver, cells)) - 1e-12
        for row_in, row_out in zip(cells, out, strict=True):
            for a, b in zip(row_in, row_out, strict=True):
                assert a.k == b.k and a.trees == b.trees and a.trunk == b.trunk
        check_rearranged(idx, forest, config, cells, out)
        # deterministic, and so without the repair solve
        assert layout(solver, recut(cells, solver)) == layout(solver, out)
        no_repair = recut(cells, solver, pin_miss=math.inf)
        assert critical_path(no_repair, solver) <= before * (1 + 1e-9)
        check_rearranged(idx, forest, config, cells, no_repair)


@settings(max_examples=10, deadline=None)
@given(forest_and_config)
def test_window_ranges_are_ordered_and_within_the_windows_load(forest_config):
    """One range per slot of a window, each ordered, non-negative and within the window's
    own load (a re-cut moves load between its slots, never adds any)."""
    forest, config = forest_config
    _, solver, candidates = build_candidates(forest, config, limit=2, dealings=(True,))
    for c in windows(candidates):
        rng = window_ranges(solver, c)
        if rng is None:
            continue
        total = sum(solver.loads(c))
        assert len(rng) == c.k
        assert all(0.0 <= lo <= hi <= total * (1 + 1e-9) for lo, hi in rng)


def test_recut_at_a_32k_cap_lifts_dp8_balance_with_a_shorter_path():
    """swe-treestep-64 at a 32k cap and budget, DP 8: re-cutting every window together
    (a slot that all windows empty alike) shortens the line-up's critical path and lifts
    its slot balance, the plan valid with every row once. (Property form of a test that
    pinned the path before the re-cut to one measurement.)"""
    ctx, states = swe64_32k_dp8_states()
    i = STAGES.index(recut_windows)
    assert states[i - 1].refine
    before, after = states[i - 1].best.cells, states[i].best.cells
    check_no_regression(ctx.solver, before, after, p5=False)
    assert states[i].best.crit < states[i - 1].best.crit
    check_rearranged(ctx.idx, ctx.idx.forest, ctx.config, before, after)
    assert states[i].before_recut is before


def test_recut_repair_solve_lifts_the_dp8_balance_at_a_32k_cap():
    """swe-treestep-64 at a 32k cap and budget, DP 8: a window whose re-cut misses the
    LP's loads (its producer at the budget) is held at what it got while the others are
    solved again; the plan validates, computes every row once, keeps its slot count and a
    P5 above 93%, and balances its slots better than without the repair solve."""
    forest, config, plan, a = swe64_32k_dp8()
    no_repair = plan_with(forest, config, pin_miss=math.inf)
    no_repair.validate(forest, cost_model=config.cost_model)
    b = compute_metrics(no_repair, forest)
    assert a.executed_tokens == b.executed_tokens == forest.compact_tokens
    assert a.slots == b.slots
    assert a.balance_p5 >= 0.93
    assert a.slot_balance > b.slot_balance + 1e-4
