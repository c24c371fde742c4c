"""Shared helpers of the l1l2 cell tests (arrangement, re-cutting, 1-slot windows): the
candidates l1l2's search builds, and what must not change between them."""

from __future__ import annotations

import functools
import math
from collections import Counter

from hypothesis import strategies as st

from harts.plan.metrics import compute_metrics
from harts.plan.planners import PlanConfig, make_plan
from harts.plan.planners.common import ForestIndex, finalize_tree
from harts.plan.planners.l1l2 import Cell, _build, _CellSolver, _group_options, _to_microbatches
from harts.tree.workload import generate, preset
from tests.strategies import plan_configs, plan_forests

forest_and_config = plan_forests().flatmap(lambda f: st.tuples(st.just(f), plan_configs(f)))


@functools.cache
def swe64_32k_dp8():
    """(forest, config, plan, metrics) of l1l2 on swe-treestep-64 at a 32k cap and budget,
    DP 8 (the issue's slot-balance setting), built once; the plan validated, every row
    computed exactly once, on 10 slots."""
    forest = generate(preset("swe-treestep-64", max_context=32768)).forest()
    config = PlanConfig(dp=8, microbatch_tokens=32768)
    plan = make_plan(forest, "l1l2", config)
    plan.validate(forest, cost_model=config.cost_model)
    m = compute_metrics(plan, forest)
    assert m.executed_tokens == forest.compact_tokens
    assert m.slots == 10
    return forest, config, plan, m


def build_candidates(forest, config, limit=4, dealings=(False, True)):
    """Some (slots, cells per replica, dealing) candidates l1l2's search would build."""
    idx = ForestIndex(forest, config.cost_model)
    solver = _CellSolver(idx, config)
    lower = max(1, math.ceil(forest.compact_tokens / (config.dp * config.microbatch_tokens)))
    out = []
    for slots in range(lower, lower + 3):
        for groups in _group_options(slots):
            for by_replica in dealings:
                cells = _build(idx, solver, config.dp, slots, groups, by_replica)
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


def check_rearranged(idx, forest, config, cells, out) -> None:
    """`out`, a rearrangement of `cells`: same slot counts and trees, a valid plan, every
    row computed exactly once (the forest's own compression)."""
    assert slot_counts(out) == slot_counts(cells)
    assert trees(out) == trees(cells)
    plan = finalize_tree(idx, _to_microbatches(idx, out), config, "l1l2")
    plan.validate(forest, cost_model=config.cost_model)
    assert plan.executed_tokens == forest.compact_tokens
