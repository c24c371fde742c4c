"""l1l2's search over windows (`anneal.search_windows`, the `anneal_windows` stage, opt-in
by `PlanConfig.search_evaluations`):
trees and slot counts stay, every row is still computed once, the plans validate, the
critical path is no longer and the slot balance and its P5 no lower, the same seed gives
the same plan, and on swe-treestep-64 at a 32k cap (DP 8) it lifts the slot balance above
the default plan's."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from harts.config.costs import TokenPairCost
from harts.plan.metrics import compute_metrics, slot_loads
from harts.plan.planners import PlanConfig, make_plan
from harts.plan.planners.l1l2 import STAGES, CellSolver, plan_with, run
from harts.plan.planners.l1l2.anneal import anneal_windows, search_windows
from harts.plan.planners.l1l2.columns import Columns
from harts.plan.planners.l1l2.measure import critical_path
from harts.plan.planners.l1l2.recut import reach_ranges, window_ranges
from harts.tree.forest import RolloutForest
from tests.plan.l1l2_cells import (
    balances,
    build_candidates,
    check_rearranged,
    forest_and_config,
    swe64_32k_dp8,
    swe64_32k_dp8_states,
    windows,
    without,
)


def _mbs(plan):
    return [dataclasses.replace(m) for m in plan.microbatches]


@settings(max_examples=15, deadline=None)
@given(forest_and_config, st.integers(0, 3))
def test_search_keeps_trees_slots_and_rows_and_never_loses(forest_config, seed):
    forest, config = forest_config
    idx, solver, candidates = build_candidates(forest, config, limit=2, dealings=(True,))
    for cells in candidates:
        snapshot = [list(row) for row in cells]
        out = search_windows(cells, solver, 30, seed)
        assert all(a == b for a, b in zip(cells, snapshot, strict=True))
        check_rearranged(idx, forest, config, cells, out)
        if out is cells:
            continue
        before, after = balances(solver, cells), balances(solver, out)
        assert critical_path(out, solver) <= critical_path(cells, solver) * (1 + 1e-9)
        assert sum(after) / len(after) > sum(before) / len(before)
        assert np.percentile(after, 5) >= np.percentile(before, 5) - 1e-12
        # same seed, same layout
        again = search_windows(cells, solver, 30, seed)
        assert [[(c.k, c.trees, solver.loads(c)) for c in row] for row in again] == [
            [(c.k, c.trees, solver.loads(c)) for c in row] for row in out]


# a draw whose default plan runs the tree under node 3 (230 rows, budget 154) as L1's two
# microbatches, recomputing its 16-row root; the searched layout of windows is lighter and
# computes every row once
_RECOMPUTED = (
    RolloutForest(node_parent=np.array([-1, 0, -1, -1, 3, 3, -1, -1, -1]),
                  node_start=np.array([0, 15, 0, 0, 16, 16, 0, 0, 0]),
                  node_end=np.array([15, 60, 154, 16, 153, 93, 15, 15, 154]),
                  node_group=np.array([0, 0, 0, 0, 0, 0, 1, 2, 3]), groups=("g0", "g1", "g2", "g3"),
                  traj_ids=tuple(f"g{g}/s{i}" for i, g in enumerate((0, 0, 0, 0, 0, 1, 2, 3))),
                  traj_node=np.array([2, 5, 1, 4, 0, 6, 7, 8]), token_ids=None, payload=None),
    PlanConfig(dp=2, microbatch_tokens=154, cost_model=TokenPairCost(pair_weight=1.1531e-05),
               producer_retention=0.0, time_limit=0.05, chunk_size=1),
)


@settings(max_examples=15, deadline=None)
@given(forest_and_config)
@example(forest_config=_RECOMPUTED)
def test_planned_with_search_valid_and_repeatable(forest_config):
    forest, config = forest_config
    config = dataclasses.replace(config, search_evaluations=25)
    plan = make_plan(forest, "l1l2", config)
    plan.validate(forest, cost_model=config.cost_model)
    again = make_plan(forest, "l1l2", config)
    assert _mbs(plan) == _mbs(again)
    # what the search keeps, without the split over replicas that follows it at dp > 1
    # (harts.plan.planners.tree_split: whether a tree is split depends on the finished
    # plan's load, so a searched plan may split where the default one does not)
    config = dataclasses.replace(config, split_trees=False)
    plan = make_plan(forest, "l1l2", config)
    plan.validate(forest, cost_model=config.cost_model)
    base = make_plan(forest, "l1l2", dataclasses.replace(config, search_evaluations=0))
    a, b = compute_metrics(plan, forest), compute_metrics(base, forest)
    # the search adds no recomputation; where the default plan runs a tree as L1's
    # recomputation it may find the windows that make it lighter (_RECOMPUTED)
    assert a.slots == b.slots and forest.compact_tokens <= a.executed_tokens <= b.executed_tokens
    assert a.slot_balance >= b.slot_balance - 1e-12
    assert a.balance_p5 >= b.balance_p5 - 1e-12


def test_a_search_that_finishes_on_more_slots_is_not_taken():
    """A layout the search prefers on its own slot count can repack into more slots than
    the one it started from (`pipeline.finish`'s `take_into_producers`): here the search
    formed a two-consumer window that keeps 3 slots where the default plan finishes on 2.
    The search is judged on the finished layouts (`anneal.finished_no_worse`)."""
    from harts.tree.forest import RolloutForest

    forest = RolloutForest(
        node_parent=np.array([-1, 0, 1, 1, 0, 4, 4, -1, 7, 8, 8, 7, 11, 11, -1, 14, 15, 15, 14, 18, 18, -1, 21, 22,
                              22, 21, 25, 25]),
        node_start=np.array([0, 1297, 1400, 1400, 1297, 1544, 1544, 0, 2367, 2931, 2931, 2367, 3014, 3014, 0,
                             2625, 2811, 2811, 2625, 2886, 2886, 0, 2275, 2398, 2398, 2275, 2450, 2450]),
        node_end=np.array([1297, 1400, 1535, 1565, 1544, 1736, 1733, 2367, 2931, 3126, 3085, 3014, 3308, 3119,
                           2625, 2811, 2944, 2984, 2886, 3002, 2966, 2275, 2398, 2527, 2478, 2450, 3022, 2687]),
        node_group=np.repeat(np.arange(4), 7), groups=("g0", "g1", "g2", "g3"),
        traj_ids=tuple(f"g{g}/l{i}" for g in range(4) for i in range(4)),
        traj_node=np.array([2, 3, 5, 6, 9, 10, 12, 13, 16, 17, 19, 20, 23, 24, 26, 27]))
    config = PlanConfig(dp=2, microbatch_tokens=3574, producer_retention=1.0, seed=0, chunk_size=1,
                        search_evaluations=25)
    plan = make_plan(forest, "l1l2", config)
    plan.validate(forest, cost_model=config.cost_model)
    base = make_plan(forest, "l1l2", dataclasses.replace(config, search_evaluations=0))
    a, b = compute_metrics(plan, forest), compute_metrics(base, forest)
    assert a.slots == b.slots == 2 and a.executed_tokens == b.executed_tokens
    assert a.slot_balance >= b.slot_balance - 1e-12


@settings(max_examples=10, deadline=None)
@given(forest_and_config)
def test_window_ranges_shared_by_recut_copies_are_exact(forest_config):
    """`window_ranges` memoises by what a re-cut starts from (slots, trunk, items per
    slot, load in all), so a re-cut copy of a window reuses its ranges: they must be
    what a solver with no memo computes for the copy itself."""
    forest, config = forest_config
    idx, solver, candidates = build_candidates(forest, config, limit=2, dealings=(True,))
    fresh = CellSolver(idx, config)
    for c in windows(candidates):
        got = window_ranges(solver, c)
        assert got == reach_ranges(CellSolver(idx, config), c, 12)
        ld = solver.loads(c)
        for aim in (ld[::-1], [sum(ld) / c.k] * c.k):
            copy = solver.relevel(c, aim)
            if copy is not None:
                assert window_ranges(solver, copy) == reach_ranges(fresh, copy, 12)


def test_search_off_by_default():
    """No evaluations by default: the search stage hands its state on unchanged, and the
    plan is the one without the stage."""
    assert PlanConfig().search_evaluations == 0
    forest, config, plan, _ = swe64_32k_dp8()
    ctx, states = swe64_32k_dp8_states()
    i = STAGES.index(anneal_windows)
    assert states[i - 1].refine
    assert run(ctx, (anneal_windows,), states[i - 1]) is states[i - 1]
    assert _mbs(plan_with(forest, config, without(anneal_windows))) == _mbs(plan)


def test_search_lifts_the_dp8_balance_at_a_32k_cap():
    """swe-treestep-64 at a 32k cap and budget, DP 8, 400 evaluations (seed 1): slot
    balance above the default plan's (already past 97.5% by the tree swaps), P5 no lower,
    the path no longer, every row once, the same slots."""
    forest, config, plan, m = swe64_32k_dp8()
    config = dataclasses.replace(config, search_evaluations=400, seed=1)
    got = make_plan(forest, "l1l2", config)
    got.validate(forest, cost_model=config.cost_model)
    g = compute_metrics(got, forest)
    assert g.slot_balance > m.slot_balance >= 0.975
    assert g.balance_p5 >= m.balance_p5
    assert g.slots == m.slots
    assert g.executed_tokens == forest.compact_tokens
    assert slot_loads(got).max(axis=1).sum() <= slot_loads(plan).max(axis=1).sum()


@settings(max_examples=10, deadline=None)
@given(forest_and_config)
def test_search_lp_loads_within_ranges_and_cap(forest_config):
    """`Columns.score`'s loads (built as sparse arrays, solved by GLOP): each window's
    within its ranges and summing to its own, the critical path within the cap, and the
    balance returned that of those loads."""
    forest, config = forest_config
    idx, solver, candidates = build_candidates(forest, config, limit=2, dealings=(True,))
    cases = [(solver, cells) for cells in candidates]
    for slv, cells in cases:
        vecs = [[x for c in row for x in slv.loads(c)] for row in cells]
        if len(cells) < 2 or any(len(v) != len(vecs[0]) for v in vecs):
            continue
        crit = sum(map(max, *vecs))
        M = Columns(cells, slv, crit)
        aims: dict = {}
        got = M.score(M.P, aims)
        if got < 0 or not any(M.info[id(c)][2] for c, _ in M.P):
            continue
        cols = [[] for _ in range(M.S)]
        for t, (c, s) in enumerate(M.P):
            _, ld, rg, total = M.info[id(c)]
            a = aims.get(t, ld)
            if rg is not None:
                assert t in aims
                assert abs(sum(a) - total) <= 1e-9 * total
                for x, (lo, hi) in zip(a, rg, strict=True):
                    assert lo - 1e-6 * total <= x <= hi + 1e-6 * total
            for j, x in enumerate(a):
                cols[s + j].append(x)
        assert sum(map(max, cols)) <= crit * (1 + 1e-9)
        assert abs(got - sum(sum(c) / M.dp / max(c) if max(c) > 0 else 1.0 for c in cols) / M.S) <= 1e-12
