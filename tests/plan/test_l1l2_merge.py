"""l1l2's merging of single-tree runs into windows (`merge.merge_runs`, then `arrange` and
the joint re-cut, the `merge_single_trees` stage): trees and slot counts stay, every row is
still computed once, the plans validate, the stage never costs path, balance or P5, and at
a 32k cap (swe-treestep-64, DP 8) the re-cut merged layout wins."""

from __future__ import annotations

from hypothesis import given, settings

from harts.plan.metrics import compute_metrics, slot_loads
from harts.plan.planners import PlanConfig, make_plan
from harts.plan.planners.l1l2 import STAGES, pipeline, plan_with
from harts.plan.planners.l1l2.arrange import arrange
from harts.plan.planners.l1l2.merge import merge_runs, merge_single_trees
from harts.plan.planners.l1l2.recut import recut
from harts.tree.workload import generate, preset
from tests.plan.l1l2_cells import (
    build_candidates,
    check_no_regression,
    check_rearranged,
    forest_and_config,
    swe64_32k_dp8_states,
    trees,
    without,
)


def _single(solver, c) -> bool:
    return c.k == 1 and len(c.trees) == 1 and solver.idx.sub_rows[c.trees[0]] <= solver.budget


def _check_merged(idx, solver, forest, config, cells) -> bool:
    """`merge_runs` on `cells` (left unchanged), its result and that result arranged and
    re-cut checked; False when nothing merged."""
    snapshot = [list(row) for row in cells]
    out = merge_runs(cells, solver, size=3)
    assert all(a == b for a, b in zip(cells, snapshot, strict=True))
    if out is None:
        return False
    check_rearranged(idx, forest, config, cells, out)
    old = {id(c) for row in cells for c in row}
    new = [c for row in out for c in row if id(c) not in old]
    assert new
    was_single = {c.trees[0] for row in cells for c in row if _single(solver, c)}
    for c in new:
        # a window of one tree per slot, each slot used, of trees that ran alone before
        assert 2 <= c.k <= 3 and len(c.trees) == c.k and len(c.bins) == c.k and all(c.bins)
        assert set(c.trees) <= was_single
    # the other cells are kept as they were, in order
    for row_in, row_out in zip(cells, out, strict=True):
        assert [c for c in row_in if not _single(solver, c)] == [
            c for row in [row_out] for c in row if id(c) in old and not _single(solver, c)]
    both = recut(arrange(out, solver), solver)
    check_rearranged(idx, forest, config, cells, both)
    assert trees(both) == trees(cells)
    return True


@settings(max_examples=20, deadline=None)
@given(forest_and_config)
def test_merged_runs_keep_trees_and_slots_and_plans_valid(forest_config):
    forest, config = forest_config
    idx, solver, candidates = build_candidates(forest, config, dealings=(True,))
    for cells in candidates:
        _check_merged(idx, solver, forest, config, cells)


def test_merged_runs_on_a_paper_sized_step():
    """swe-treestep-64 at a 32k cap, DP 8: the search's first candidates have runs of
    single trees, and merging them keeps everything `_check_merged` checks."""
    forest = generate(preset("swe-treestep-64", max_context=32768)).forest()
    config = PlanConfig(dp=8, microbatch_tokens=32768)
    idx, solver, candidates = build_candidates(forest, config, limit=2, dealings=(True,))
    assert len(candidates) == 2
    assert all(_check_merged(idx, solver, forest, config, cells) for cells in candidates)


def test_merged_runs_lift_the_dp8_balance_at_a_32k_cap():
    """swe-treestep-64 at a 32k cap and budget, DP 8: each replica's single trees merged
    into 3-slot windows (remainder first) and re-cut together are taken over the jointly
    re-cut plan: a shorter path, higher slot balance, P5 no lower, every row once.
    (Property form of a test that pinned the path before and after to one measurement.)"""
    ctx, states = swe64_32k_dp8_states()
    i = STAGES.index(merge_single_trees)
    before, after = states[i - 1].best.cells, states[i].best.cells
    assert after is not before
    check_no_regression(ctx.solver, before, after, p5=True)
    assert states[i].best.crit < states[i - 1].best.crit
    forest, config = ctx.idx.forest, ctx.config
    check_rearranged(ctx.idx, forest, config, before, after)


def test_merged_runs_never_cost_balance_p5_or_path(monkeypatch):
    """With and without the merged candidate (swe-treestep-32 at a 32k cap, DP 2/4/16,
    where merging alone would lower P5 at DP 2 and 16): slot balance and P5 no lower,
    the critical path no longer, the slot count and compression the same. Both as the
    stages leave the cells (the repack that `finish` applies after them is
    tests/plan/test_l1l2_absorb.py's)."""
    monkeypatch.setattr(pipeline, "take_into_producers", lambda cells, cfg, solver=None: (cells, 0))
    forest = generate(preset("swe-treestep-32", max_context=32768)).forest()
    for dp in (2, 4, 16):
        config = PlanConfig(dp=dp, microbatch_tokens=32768)
        with_merge = make_plan(forest, "l1l2", config)
        no_merge = plan_with(forest, config, without(merge_single_trees))
        a, b = compute_metrics(with_merge, forest), compute_metrics(no_merge, forest)
        assert a.slot_balance >= b.slot_balance - 1e-12
        assert a.balance_p5 >= b.balance_p5 - 1e-12
        assert a.slots == b.slots and a.compression == b.compression
        assert slot_loads(with_merge).max(axis=1).sum() <= slot_loads(no_merge).max(axis=1).sum() * (1 + 1e-9)
