"""The measures every stage optimises or guards: the step's critical path (the sum over
slots of the heaviest replica's load, pipelined when pp > 1) and the slot balance (per
slot, mean / max load across replicas)."""

from __future__ import annotations

from harts.plan.planners.common import pipelined_critical_path
from harts.plan.planners.l1l2.cell import Cell
from harts.plan.planners.l1l2.solver import CellSolver


def critical_path(cells: list[list[Cell]], solver: CellSolver, pp: int = 1) -> float:
    """sum over slots of the max load across replicas, pipelined over `pp` stages
    (`pipelined_critical_path`; the plain sum when pp = 1)."""
    rows = [[x for c in row for x in solver.loads(c)] for row in cells]
    if pp <= 1:
        return pipelined_critical_path(rows, 1)
    return pipelined_critical_path(rows, pp, [solver.ends(row) for row in cells])


def slot_balances(vecs: list[list[float]]) -> list[float]:
    """Per slot, mean / max load across replicas."""
    out = []
    for col in zip(*vecs, strict=True):
        peak = max(col)
        out.append(sum(col) / len(col) / peak if peak > 0 else 1.0)
    return out


def slot_balance(vecs: list[list[float]]) -> float:
    """Mean over slots of mean / max load across replicas (the plan's slot balance)."""
    out = slot_balances(vecs)
    return sum(out) / len(out) if out else 1.0
