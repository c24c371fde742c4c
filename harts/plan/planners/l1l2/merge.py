"""Merged candidate (pp = 1, off the ideal path): each replica's runs of single trees
(1-slot cells within the budget) merged into windows of `MERGE_RUN` slots (`merge_runs`),
arranged and re-cut together: a window's slot loads move under the re-cut, a single
tree's cannot. Kept over the re-cut plan when its path is no longer, its slots better
balanced and its least balanced slots (5th percentile) no worse."""

from __future__ import annotations

import dataclasses

import numpy as np

from harts.plan.planners.l1l2.arrange import arrange
from harts.plan.planners.l1l2.cell import Cell
from harts.plan.planners.l1l2.measure import critical_path, slot_balances
from harts.plan.planners.l1l2.recut import recut
from harts.plan.planners.l1l2.solver import CellSolver
from harts.plan.planners.l1l2.state import Context, State

# `merge_runs`: runs of 1-slot single-tree cells become windows of this many slots
MERGE_RUN = 3


def merge_single_trees(ctx: Context, state: State) -> State:
    """Stage: when `state.refine`, the merged candidate, built from the cells the joint
    re-cut started from (`state.before_recut`, else the plan's), replaces the plan when it
    is no worse on path and P5 and better balanced."""
    if not state.refine:
        return state
    solver = ctx.solver
    cells = state.best.cells
    merged = merge_runs(cells if state.before_recut is None else state.before_recut, solver)
    if merged is None:
        return state
    alt = recut(arrange(merged, solver), solver, pin_miss=ctx.pin_miss)
    now, new = (slot_balances([[x for c in row for x in solver.loads(c)] for row in r]) for r in (cells, alt))
    if (critical_path(alt, solver) <= critical_path(cells, solver) * (1 + 1e-12)
            and sum(new) / len(new) > sum(now) / len(now) + 1e-12
            and np.percentile(new, 5) >= np.percentile(now, 5) - 1e-12):
        return dataclasses.replace(state, best=dataclasses.replace(
            state.best, crit=critical_path(alt, solver), cells=alt))
    return state


def merge_runs(cells: list[list[Cell]], solver: CellSolver, size: int = MERGE_RUN) -> list[list[Cell]] | None:
    """Each replica's runs of consecutive 1-slot cells of one tree within the budget
    become windows of `size` slots (one tree per slot; the remainder of a run first, a
    remainder of one left as it is): a slot load that sits in a window can move under
    `recut`, a single tree's cannot. A group whose window does not solve on all its slots
    keeps its cells. Trees and slot counts stay, and every row is still computed once.
    Returns new rows, or None when no window formed."""
    idx = solver.idx

    def single(c: Cell) -> bool:
        return c.k == 1 and len(c.trees) == 1 and idx.sub_rows[c.trees[0]] <= solver.budget

    out: list[list[Cell]] = []
    formed = False
    for row in cells:
        new: list[Cell] = []
        i = 0
        while i < len(row):
            j = i
            while j < len(row) and single(row[j]):
                j += 1
            if j == i:
                new.append(row[i])
                i += 1
                continue
            n = j - i
            for k in ([n % size] if n % size else []) + [size] * (n // size):
                group = row[i : i + k]
                i += k
                c = None
                if k > 1:
                    c = solver.solved(k, sorted((x.trees[0] for x in group), key=lambda t: (-idx.sub_cost[t], t)))
                if c is not None and len(c.bins) == k and all(c.bins):
                    new.append(c)
                    formed = True
                else:
                    new.extend(group)
        out.append(new)
    return out if formed else None
