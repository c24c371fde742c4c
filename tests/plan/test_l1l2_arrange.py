"""l1l2's cell arrangement (`arrange.arrange`, within the line-up stage): moving whole
cells within and between replicas never lengthens the slot-aligned critical path, keeps
every replica's slot count and every cell, and the plans it yields validate; where most
trees exceed the budget it evens the slots."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings

from harts.plan.metrics import compute_metrics
from harts.plan.planners import PlanConfig, make_plan
from harts.plan.planners.l1l2.arrange import arrange
from harts.plan.planners.l1l2.measure import critical_path
from harts.tree.workload import generate, preset
from tests.plan.l1l2_cells import build_candidates, check_rearranged, forest_and_config, layout


@settings(max_examples=25)
@given(forest_and_config)
def test_arrange_never_lengthens_the_critical_path_and_keeps_plans_valid(forest_config):
    forest, config = forest_config
    idx, solver, candidates = build_candidates(forest, config)
    for cells in candidates:
        before = critical_path(cells, solver)
        snapshot = [list(row) for row in cells]
        out = arrange(cells, solver)
        # the input is left as it was
        assert all(a == b for a, b in zip(cells, snapshot, strict=True))
        assert critical_path(out, solver) <= before * (1 + 1e-12)
        # the same cells (by identity), only moved
        assert Counter(id(c) for row in out for c in row) == Counter(id(c) for row in cells for c in row)
        check_rearranged(idx, forest, config, cells, out)
        # deterministic
        assert layout(solver, arrange(cells, solver)) == layout(solver, out)


def test_arrange_lines_up_windows_where_trees_exceed_the_budget():
    """swe-treestep-16 at a 32k context cap and budget: most trees need a window of their
    own, cells of one size hold trees of different cost, and arranging whole cells lowers
    the critical path of the plan's own candidates (and the plan's slot balance with it)."""
    forest = generate(preset("swe-treestep-16", max_context=32768)).forest()
    config = PlanConfig(dp=4, microbatch_tokens=32768)
    idx, solver, candidates = build_candidates(forest, config, limit=8)
    assert candidates
    gains = [critical_path(c, solver) - critical_path(arrange(c, solver), solver) for c in candidates]
    assert all(g >= 0 for g in gains)
    assert max(gains) > 0
    plan = make_plan(forest, "l1l2", config)
    plan.validate(forest, cost_model=config.cost_model)
    m = compute_metrics(plan, forest)
    assert m.executed_tokens == forest.compact_tokens
    assert m.slots <= compute_metrics(make_plan(forest, "l1", config), forest).slots
