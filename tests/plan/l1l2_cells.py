"""Shared helpers of the l1l2 cell tests (arrangement, re-cutting, 1-slot windows): the
candidates l1l2's search builds, and what must not change between them."""

from __future__ import annotations

import math
from collections import Counter

from hypothesis import strategies as st

from harts.plan.planners.common import ForestIndex, finalize_tree
from harts.plan.planners.l1l2 import Cell, _build, _CellSolver, _group_options, _to_microbatches
from tests.strategies import plan_configs, plan_forests

forest_and_config = plan_forests().flatmap(lambda f: st.tuples(st.just(f), plan_configs(f)))


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
