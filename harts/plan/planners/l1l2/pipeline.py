"""The planner's stages in their order, and the end that turns the state into a plan.

`STAGES` runs left to right over a `State`; each stage is a no-op where it does not apply
(the re-cutting stages run with pp = 1 off the ideal path, the window search only when
asked for). `finish` lets L1's own plan compete on the same measure and builds the plan.
`plan_with` runs any sequence of stages (a test runs the planner without one of them)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from harts.plan.plan import Plan
from harts.plan.planners.common import (
    ForestIndex,
    PlanConfig,
    finalize_tree,
    floored_load,
    pipeline_ends,
    pipelined_critical_path,
)
from harts.plan.planners.l1 import l1_microbatches, place
from harts.plan.planners.l1l2.absorb import take_into_producers
from harts.plan.planners.l1l2.anneal import anneal_windows
from harts.plan.planners.l1l2.cells import fewest_microbatches, first_slots
from harts.plan.planners.l1l2.choose import choose_cells
from harts.plan.planners.l1l2.measure import critical_path
from harts.plan.planners.l1l2.merge import merge_single_trees
from harts.plan.planners.l1l2.microbatches import to_microbatches
from harts.plan.planners.l1l2.recut import recut_windows
from harts.plan.planners.l1l2.relevel import line_up
from harts.plan.planners.l1l2.solver import CellSolver
from harts.plan.planners.l1l2.state import Context, Stage, State
from harts.plan.planners.l1l2.swap import swap_cells_trees
from harts.plan.planners.registry import PlannerName, register_planner
from harts.tree.forest import RolloutForest

STAGES: tuple[Stage, ...] = (
    choose_cells,  # slot count, cells, each cell solved and levelled
    line_up,  # cells arranged; off ideal: windows re-cut, slots handed over
    recut_windows,  # off ideal: every window re-cut together (one LP)
    merge_single_trees,  # off ideal: single trees merged into windows, kept if better
    swap_cells_trees,  # off ideal: single trees swapped between cells
    anneal_windows,  # off ideal, opt-in: cells re-formed by a seeded search
)


def start(ctx: Context) -> State:
    """The state before the first stage: no plan yet, L1's slot range."""
    return State(searched=range(ctx.lower, ctx.l1_slots + 1))


def run(ctx: Context, stages: Sequence[Stage] = STAGES, state: State | None = None) -> State:
    """`stages` in order from `state` (default: the start state)."""
    state = start(ctx) if state is None else state
    for stage in stages:
        state = stage(ctx, state)
    return state


def finish(ctx: Context, state: State) -> Plan:
    """The plan: L1's microbatches (recomputed paths, no windows) when they have a shorter
    critical path, or when there is no windowed plan; else the windowed plan's. A plan
    that meets a pipeline's floor is only displaced by an L1 plan that does too. With
    microbatch floors or a consumer row cost (`PlanConfig.microbatch_floor`,
    `consumer_floor`, `consumer_row_cost`; pp = 1) the two finished plans are compared by
    `floored_load` instead: windows only where they pay."""
    config, idx = ctx.config, ctx.idx
    target = config.target_microbatches
    best = state.best
    l1_mbs, l1_slots = ctx.l1_mbs, ctx.l1_slots
    place(l1_mbs, config.dp)
    l1_loads = [[0.0] * l1_slots for _ in range(config.dp)]
    for m in l1_mbs:
        l1_loads[m.replica][m.slot] += config.cost_model.microbatch_overhead + m.cost
    l1_ends = [pipeline_ends(row, config.cost_model.forward_fraction) for row in l1_loads]
    l1_crit = pipelined_critical_path(l1_loads, config.pp, l1_ends)
    pipe = {"pp": config.pp, "target_microbatches": target} if config.pp > 1 else {}
    l1_floor = min(sum(1 for x in row if x > 0) for row in l1_loads) >= target
    floor_met = best is not None and target > ctx.lower and fewest_microbatches(best.cells) >= target
    floors = config.pp == 1 and (config.microbatch_floor > 0 or config.consumer_floor > 0
                                 or config.consumer_row_cost > 0)
    cells, saved = take_into_producers(best.cells, config, ctx.solver) if best is not None else (None, 0)
    # (repacked only without a pipeline: the path is the slots' sum of the heaviest
    # replica's loads)
    crit = None if best is None else critical_path(cells, ctx.solver, 1) if saved else best.crit
    if best is None or (not floors and (l1_floor or not floor_met) and l1_crit < crit * (1 - 1e-9)):
        return finalize_tree(idx, l1_mbs, config, PlannerName.L1L2.value, {"chosen": "l1", **pipe})
    mbs = to_microbatches(idx, cells)
    producers = {m.producer for m in mbs if m.producer is not None}
    info = {
        "slots_considered": [state.searched.start, state.searched.stop - 1],
        "cells_per_replica": best.groups,
        "producers": len(producers),
        "producer_tokens": sum(mbs[p].tokens for p in producers),
        "microbatches_saved": saved,
        **pipe,
    }
    windowed = finalize_tree(idx, mbs, config, PlannerName.L1L2.value, info)
    if floors:
        # L1's microbatches have no consumers; the windowed plan is priced finished
        priced = {"l1": floored_load(l1_mbs, config), "windows": floored_load(windowed.microbatches, config)}
        if priced["l1"] < priced["windows"] * (1 - 1e-9):
            return finalize_tree(idx, l1_mbs, config, PlannerName.L1L2.value,
                                 {"chosen": "l1", "floored_load": priced, **pipe})
        info["floored_load"] = priced
    return windowed


def plan_with(forest: RolloutForest, config: PlanConfig, stages: Sequence[Stage] = STAGES,
              pin_miss: float | None = None) -> Plan:
    """The l1l2 plan of `forest` with `stages` (default: all of them) and the joint
    re-cut's repair threshold `pin_miss` (None: its default)."""
    ctx = Context.of(forest, config, pin_miss)
    return finish(ctx, run(ctx, stages))


def nested_trees(forest: RolloutForest, config: PlanConfig) -> list[int]:
    """Roots of the trees over the budget that no one-window cell holds on its own slots
    (`cells.first_slots` up to twice it, and no more than the slots the planner searches:
    L1's slot count per replica): a trunk whose branches do not fit beside its retained
    rows, say. A window per cell would leave them to L1's recomputation; `make_plan` runs
    them as nested windows (`chains.chain_windows`), every row computed once. Where each
    tree solves alone but their slots beside the other trees' rows need more than the
    searched slots and the planner's own plan recomputes rows, the forest has no windowed
    plan there: every over-budget tree is named, and the nested plan competes with the
    planner's own by `step_load`."""
    idx = ForestIndex(forest, config.cost_model)
    budget = config.microbatch_tokens
    over = [r for r in idx.roots if idx.sub_rows[r] > budget]
    if not over:
        return []
    solver = CellSolver(idx, config)
    # the slots the planner searches (as `Context.of`); with a trajectory over the budget
    # its trees are chained anyway and the rest planned on their own, so only the first bound
    searched = math.inf if int(forest.traj_length.max()) > budget else \
        math.ceil(len(l1_microbatches(idx, config)[0]) / config.dp)
    out, need = [], 0
    for r in over:
        first = first_slots(idx, budget, r)
        own = next((k for k in range(first, int(min(2 * first + 1, searched)) + 1)
                    if solver.solved(k, [r]) is not None), None)
        if own is None:
            out.append(r)
        else:
            need += own
    # each tree solves alone, but their slots beside the other trees' rows pass the
    # searched slots: where the planner's own plan then recomputes rows, the forest had
    # no windowed plan there, and every over-budget tree is named
    rest = sum(idx.sub_rows[r] for r in idx.roots if idx.sub_rows[r] <= budget)
    if (not out and need + math.ceil(rest / budget) > searched * config.dp
            and plan_with(forest, config).executed_tokens > forest.compact_tokens):
        return over
    return out


@register_planner(PlannerName.L1L2, nest=nested_trees)
def plan_l1l2(forest: RolloutForest, config: PlanConfig) -> Plan:
    return plan_with(forest, config)
