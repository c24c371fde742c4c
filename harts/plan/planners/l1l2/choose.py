"""Slot count and cells, the planner's first stage: (S, m) is chosen to minimise the
step's critical path sum_s max_r load(s, r). S rises from the compact-token lower bound,
never past L1's slot count (so `l1l2` never uses more slots than `l1`), and the search
stops at a near-ideal critical path or after two slot counts that work. Without a
pipeline one slot fewer than the bound is tried too (a producer is a microbatch of its
own) and kept where its critical path is no longer.

With a pipeline (pp > 1) S starts at `PlanConfig.target_microbatches` (at least that many
microbatches per replica, so 1F1B can fill its stages); only when no plan with that many
slots exists does the search fall back to fewer. A cell with fewer items than slots then
splits its largest trees at their top nodes (into the producer) until it has enough, so a
few large trees become windows of several consumers without recomputing a row.
Candidates are scored by the pipelined critical path (slot loads plus the fill and drain,
`CellSolver.ends`). A 1-slot window counts as one microbatch toward the floor: its
producer's forward runs just before its consumer's and adds no warm-up depth."""

from __future__ import annotations

import dataclasses

from harts.plan.planners.common import ForestIndex, PlanConfig
from harts.plan.planners.l1l2.cell import Cell
from harts.plan.planners.l1l2.cells import build, fewest_microbatches, group_options
from harts.plan.planners.l1l2.measure import critical_path
from harts.plan.planners.l1l2.solver import CellSolver
from harts.plan.planners.l1l2.state import Candidate, Context, State

# stop searching slot counts once the critical path is this close to the ideal
GOOD_ENOUGH = 0.002


def choose_cells(ctx: Context, state: State) -> State:
    """Stage: the best candidate over the slot counts searched (first those meeting a
    pipeline's floor, when it is above the lower bound), and whether the later stages
    refine it (pp = 1 and its path not near ideal)."""
    config = ctx.config
    target = config.target_microbatches
    best = None
    searched = range(ctx.lower, ctx.l1_slots + 1)
    if target > ctx.lower:
        # slot counts from the floor up, as far as twice it (a few cells of a few slots
        # per replica), or L1's count when that is larger
        searched = range(target, max(ctx.l1_slots, 2 * target) + 1)
        best = search_slots(ctx.idx, ctx.solver, config, searched, ctx.ideal, target)
    if best is None:
        searched = range(ctx.lower, ctx.l1_slots + 1)
        best = search_slots(ctx.idx, ctx.solver, config, searched, ctx.ideal)
        if config.pp <= 1 and ctx.lower > 1:
            # a window's producer is a microbatch beside its cell's slots, so the slots may
            # hold one compact-token budget less than the step: one slot fewer than the
            # bound, kept where its critical path is no longer (one microbatch fewer, whose
            # launches and weight passes every microbatch pays)
            fewer = search_slots(ctx.idx, ctx.solver, config, range(ctx.lower - 1, ctx.lower), ctx.ideal)
            if fewer is not None and (best is None or fewer[0] <= best[0] * (1 + 1e-9)):
                best = fewer
            searched = range(ctx.lower - 1, ctx.l1_slots + 1)
    if best is None:
        return dataclasses.replace(state, searched=searched, best=None, refine=False)
    refine = config.pp <= 1 and best[0] > ctx.ideal * (1 + GOOD_ENOUGH)
    return dataclasses.replace(state, searched=searched, best=Candidate(*best), refine=refine)


def search_slots(
    idx: ForestIndex,
    solver: CellSolver,
    config: PlanConfig,
    slot_range: range,
    ideal: float,
    min_microbatches: int = 1,
) -> tuple[float, int, int, list[list[Cell]]] | None:
    """The best (critical path, slots, cells per replica, cells) over `slot_range` among
    plans with at least `min_microbatches` non-producer microbatches on every replica;
    stops at a near-ideal critical path or after two slot counts that work."""
    best = None
    feasible_slots = 0
    for slots in slot_range:
        found = 0
        for groups in group_options(slots):
            # trees dealt cell by cell, and with replica-aware ties (which spreads large
            # trees over replicas when cells tie, as when most trees need windows): the
            # shorter critical path wins (with a pipeline both are replica-aware)
            for by_replica in ((False, True) if config.pp <= 1 else (False,)):
                cells = build(idx, solver, config.dp, slots, groups, by_replica)
                if cells is None or (min_microbatches > 1 and fewest_microbatches(cells) < min_microbatches):
                    continue
                found += 1
                crit = critical_path(cells, solver, config.pp)
                if best is None or crit < best[0] * (1 - 1e-9):
                    best = (crit, slots, groups, cells)
        feasible_slots += bool(found)
        # a near-ideal plan, or two slot counts that work, ends the search
        if best is not None and (best[0] <= ideal * (1 + GOOD_ENOUGH) or feasible_slots >= 2):
            break
    return best

