"""What the stages share: a `Context` (read only: the forest's index, the cell solver, the
config, L1's plan and the bounds the slot-count search starts from) and a `State` (frozen;
each stage returns a new one). A stage is `fn(ctx, state) -> state`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from harts.plan.planners.common import ForestIndex, PlanConfig, TreeMB
from harts.plan.planners.l1 import l1_microbatches
from harts.plan.planners.l1l2.cell import Cell
from harts.plan.planners.l1l2.solver import CellSolver
from harts.tree.forest import RolloutForest

# per replica, its cells in slot order
Rows = list[list[Cell]]


@dataclass(frozen=True, eq=False)
class Context:
    """`l1_mbs`: L1's microbatches on `l1_slots` slots (l1l2 never uses more; they compete
    at the end, when `finish` places them). `lower`: the compact-token lower bound on the
    slot count. `ideal`: the critical path of an even split of all the step's work.
    `pin_miss`: the joint re-cut's repair threshold (`recut`; None: its default, inf:
    no repair)."""

    idx: ForestIndex
    solver: CellSolver
    config: PlanConfig
    l1_mbs: list[TreeMB]
    l1_slots: int
    lower: int
    ideal: float
    pin_miss: float | None = None

    @classmethod
    def of(cls, forest: RolloutForest, config: PlanConfig, pin_miss: float | None = None) -> Context:
        idx = ForestIndex(forest, config.cost_model)
        budget = config.microbatch_tokens
        l1_mbs, _ = l1_microbatches(idx, config)
        l1_slots = math.ceil(len(l1_mbs) / config.dp)
        lower = max(1, math.ceil(forest.compact_tokens / (config.dp * budget)))
        # the critical path can be no shorter than an even split of all the step's work
        ideal = (sum(idx.sub_cost[r] for r in idx.roots) + config.cost_model.microbatch_overhead) / config.dp
        if config.pp > 1:
            # as pipelined: fill and drain are (pp - 1) passes of 1/pp of an even slot's load
            ideal = ideal * (1 + (config.pp - 1) / max(lower, config.target_microbatches)) / config.pp
        return cls(idx, CellSolver(idx, config), config, l1_mbs, l1_slots, lower, ideal, pin_miss)


@dataclass(frozen=True, eq=False)
class Candidate:
    """A windowed plan: its critical path, slots per replica, cells per replica it was
    built with, and its cells."""

    crit: float
    slots: int
    groups: int
    cells: Rows


@dataclass(frozen=True, eq=False)
class State:
    """`best`: the windowed plan so far (None: none found, L1's plan is used).
    `searched`: the slot counts the search considered. `refine`: the plan is off the
    ideal critical path with pp = 1, so the re-cutting stages run. `before_recut`: the
    cells the joint re-cut started from (where the merged candidate starts)."""

    searched: range
    best: Candidate | None = None
    refine: bool = False
    before_recut: Rows | None = None


Stage = Callable[[Context, State], State]
