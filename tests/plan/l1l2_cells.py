"""Shared helpers of the l1l2 stage tests: the candidates l1l2's first stage builds, the
states its pipeline passes from stage to stage, and what must not change between them."""

from __future__ import annotations

import functools
import math
from collections import Counter

import numpy as np
from hypothesis import strategies as st

from harts.plan.metrics import compute_metrics
from harts.plan.planners import PlanConfig, make_plan
from harts.plan.planners.common import ForestIndex, finalize_tree
from harts.plan.planners.l1l2 import STAGES, Cell, CellSolver, Context, State, run
from harts.plan.planners.l1l2.cells import build, group_options
from harts.plan.planners.l1l2.measure import critical_path, slot_balances
from harts.plan.planners.l1l2.microbatches import to_microbatches
from harts.plan.planners.l1l2.pipeline import start
from harts.tree.workload import generate, preset
from tests.strategies import plan_configs, plan_forests

forest_and_config = plan_forests().flatmap(lambda f: st.tuples(st.just(f), plan_configs(f)))


@functools.cache
def swe64_32k_dp8():
    """(forest, config, plan, metrics) of l1l2 on swe-treestep-64 at a 32k cap and budget,
    DP 8 (the setting of the slot-balance target), built once; the plan validated, every row
    computed exactly once, on no more slots than l1's."""
    # the shape these targets were set on: the generator with its copies at the context cap
    # and last-turn forks (`allow_duplicates`, `last_turn_branching`)
    forest = generate(preset("swe-treestep-64", max_context=32768, allow_duplicates=True, last_turn_branching=True)).forest()
    config = PlanConfig(dp=8, microbatch_tokens=32768)
    plan = make_plan(forest, "l1l2", config)
    plan.validate(forest, cost_model=config.cost_model)
    m = compute_metrics(plan, forest)
    assert m.executed_tokens == forest.compact_tokens
    assert m.slots <= make_plan(forest, "l1", config).num_slots
    return forest, config, plan, m


@functools.cache
def swe64_32k_dp8_states() -> tuple[Context, tuple[State, ...]]:
    """The context and the state after each of `STAGES` on the `swe64_32k_dp8` step."""
    forest, config, _, _ = swe64_32k_dp8()
    return stage_states(forest, config)


def stage_states(forest, config, pin_miss=None) -> tuple[Context, tuple[State, ...]]:
    """The context and the state after each of `STAGES`, in order."""
    ctx = Context.of(forest, config, pin_miss)
    states = []
    state = start(ctx)
    for stage in STAGES:
        state = run(ctx, (stage,), state)
        states.append(state)
    return ctx, tuple(states)


def without(stage) -> tuple:
    """`STAGES` less one stage."""
    assert stage in STAGES
    return tuple(s for s in STAGES if s is not stage)


def build_candidates(forest, config, limit=4, dealings=(False, True)):
    """Some (slots, cells per replica, dealing) candidates l1l2's search would build."""
    idx = ForestIndex(forest, config.cost_model)
    solver = CellSolver(idx, config)
    lower = max(1, math.ceil(forest.compact_tokens / (config.dp * config.microbatch_tokens)))
    out = []
    for slots in range(lower, lower + 3):
        for groups in group_options(slots):
            for by_replica in dealings:
                cells = build(idx, solver, config.dp, slots, groups, by_replica)
                if cells is not None:
                    out.append(cells)
                if len(out) >= limit:
                    return idx, solver, out
    return idx, solver, out


def windows(candidates: list[list[list[Cell]]]):
    """Every window (a cell of >= 2 slots holding trees in each slot) of the candidates."""
    for cells in candidates:
        for row in cells:
            for c in row:
                if c.k >= 2 and c.trees and all(c.bins):
                    yield c


def slot_counts(cells: list[list[Cell]]) -> list[int]:
    return [sum(c.k for c in row) for row in cells]


def trees(cells: list[list[Cell]]) -> Counter:
    return Counter(t for row in cells for c in row for t in c.trees)


def loads(solver, cells) -> list[list[float]]:
    return [[x for c in row for x in solver.loads(c)] for row in cells]


def balances(solver, cells) -> list[float]:
    """Per slot, mean / max load across replicas."""
    return slot_balances(loads(solver, cells))


def layout(solver, cells):
    """What a plan's cells are, for comparing two runs: per replica, each cell's slots,
    trees and slot loads."""
    return [[(c.k, tuple(c.trees), tuple(solver.loads(c))) for c in row] for row in cells]


def same_cells(a, b) -> bool:
    """The same cells (by identity) in the same places."""
    return len(a) == len(b) and all(
        len(x) == len(y) and all(c is d for c, d in zip(x, y, strict=True)) for x, y in zip(a, b, strict=True))


def check_rearranged(idx, forest, config, cells, out) -> None:
    """`out`, a rearrangement of `cells`: same slot counts and trees (each tree in exactly
    one cell), every cell within the budget, a valid plan (every trajectory owned once),
    every row computed exactly once (the forest's own compression)."""
    assert slot_counts(out) == slot_counts(cells)
    assert trees(out) == trees(cells)
    assert all(n == 1 for n in trees(out).values())
    solver = CellSolver(idx, config)
    assert all(solver.fits(c) for row in out for c in row if c.trees)
    plan = finalize_tree(idx, to_microbatches(idx, out), config, "l1l2")
    plan.validate(forest, cost_model=config.cost_model)
    assert plan.executed_tokens == forest.compact_tokens


def check_no_regression(solver, before, after, p5: bool) -> None:
    """`after`, a stage's result from `before`: either `before` itself, or a critical path
    no longer and a slot balance higher (and, when `p5`, the 5th percentile of the
    per-slot balances no lower). A copy of `before` holding the same cells counts as
    `before`."""
    if after is before or same_cells(before, after):
        return
    old, new = balances(solver, before), balances(solver, after)
    assert critical_path(after, solver) <= critical_path(before, solver) * (1 + 1e-9)
    assert sum(new) / len(new) > sum(old) / len(old)
    if p5:
        assert np.percentile(new, 5) >= np.percentile(old, 5) - 1e-12
