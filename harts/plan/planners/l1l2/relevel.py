"""Line-up (pp = 1): cells arranged (`arrange`), and where the critical path is not near
ideal, windows re-cut toward the other replicas' slots and slots handed over between
windows.

A window (cell of k >= 2 slots) is re-shaved toward the other replicas' peak (or mean)
load in each of its slots instead of its own mean, with its items kept or its two ends
swapped (`relevel_windows`). A window may hand one slot to another window of its replica
(`reshape`): k - 1 and k + 1 slots, re-solved; a 1-slot window holds its producer and its
one consumer in the same slot, so a tree a little over the budget loads one slot like the
single trees next to it. Both are taken only when they shorten the critical path (then, at
equal path, raise the slots' mean / max); trees, rows and slot counts stay."""

from __future__ import annotations

import dataclasses

from harts.plan.planners.l1l2.arrange import arrange
from harts.plan.planners.l1l2.cell import Cell
from harts.plan.planners.l1l2.measure import critical_path
from harts.plan.planners.l1l2.solver import CellSolver
from harts.plan.planners.l1l2.state import Context, State

# rounds of `relevel_windows` (each re-cuts every window once)
RELEVEL_ROUNDS = 3


def line_up(ctx: Context, state: State) -> State:
    """Stage: with pp = 1, `arrange` the chosen cells, or when `state.refine`, up to two
    passes of `reshape`, `arrange` and `relevel_windows`; each pass kept only when it
    shortens the critical path."""
    best = state.best
    if best is None or ctx.config.pp > 1:
        return state
    solver = ctx.solver
    cells = best.cells
    passes = 2 if state.refine else 1
    for _ in range(passes):
        if passes > 1:
            cells = relevel_windows(arrange(reshape(cells, solver), solver), solver)
        else:
            cells = arrange(cells, solver)
        crit = critical_path(cells, solver)
        if not crit < best.crit * (1 - 1e-9):
            break
        best = dataclasses.replace(best, crit=crit, cells=cells)
    return dataclasses.replace(state, best=best)


def relevel_windows(cells: list[list[Cell]], solver: CellSolver, rounds: int = RELEVEL_ROUNDS) -> list[list[Cell]]:
    """Re-cut windows toward the other replicas' slots: each cell of two or more slots is
    re-shaved (`CellSolver.relevel`) toward the others' peak load in each of its slots,
    shifted evenly so the cell's own load is kept; the copy replaces the cell when it
    shortens the critical path. Trees, producers' trunks and every cell's slots stay, so
    the plan stays valid with every row computed once. Returns new rows."""
    rows = [list(r) for r in cells]
    dp = len(rows)
    if dp < 2:
        return rows
    vecs = [[x for c in row for x in solver.loads(c)] for row in rows]
    for _ in range(rounds):
        improved = False
        for r in range(dp):
            s0 = 0
            for i, c in enumerate(rows[r]):
                k = c.k
                if k >= 2 and c.trees:
                    span = range(s0, s0 + k)
                    peak = [max(vecs[q][s] for q in range(dp) if q != r) for s in span]
                    rest = [sum(vecs[q][s] for q in range(dp) if q != r) for s in span]
                    old = vecs[r][s0 : s0 + k]
                    score = window_score(old, peak, rest, dp)
                    for aim in (peak, [x / (dp - 1) for x in rest]):
                        shift = (sum(old) - sum(aim)) / k
                        cand = solver.relevel(c, [a + shift for a in aim])
                        if cand is None:
                            continue
                        new = solver.loads(cand)
                        got = window_score(new, peak, rest, dp)
                        if got < score:
                            rows[r][i], old, score = cand, new, got
                            vecs[r][s0 : s0 + k] = new
                            improved = True
                s0 += k
        if not improved:
            break
    return rows


def window_score(mine: list[float], peak: list[float], rest: list[float], dp: int) -> tuple[float, float]:
    """How a replica's loads over some slots fare against the other replicas' (their peak
    and their sum per slot): (critical path over those slots, minus their summed slot
    balance mean / max), rounded so that float noise never counts as a gain."""
    crit = sum(max(a, p) for a, p in zip(mine, peak, strict=True))
    bal = sum((a + s) / dp / max(a, p) for a, p, s in zip(mine, peak, rest, strict=True) if max(a, p) > 0)
    return round(crit, 6), -round(bal, 9)


def order_row(row: list[Cell], vec_of, peak: list[float], moving: tuple[Cell, ...]) -> tuple[float, list[Cell]]:
    """Cells of one replica reordered (the best swap of a `moving` cell with another
    while it helps) to minimise sum_s max(load(s), peak(s)); returns (that sum, the
    order)."""

    def cost(r: list[Cell]) -> float:
        v = [x for c in r for x in vec_of(c)]
        return sum(max(a, p) for a, p in zip(v, peak, strict=True))

    row = list(row)
    cur = cost(row)
    while True:
        best = None
        for i in range(len(row)):
            for j in range(i + 1, len(row)):
                if not (any(row[i] is m for m in moving) or any(row[j] is m for m in moving)):
                    continue
                n = list(row)
                n[i], n[j] = n[j], n[i]
                v = cost(n)
                if v < cur * (1 - 1e-9) and (best is None or v < best[0]):
                    best = (v, n)
        if best is None:
            return cur, row
        cur, row = best


def reshape(cells: list[list[Cell]], solver: CellSolver) -> list[list[Cell]]:
    """Give one window's slot to another window of the same replica: X (k >= 2 slots)
    re-solved with k - 1 (a 1-slot window holds its producer and its consumer in one
    slot: a tree a little over the budget then loads one slot like a tree just under it),
    Y with k + 1; the replica's cells reordered and re-cut against the other replicas'
    peaks. Taken when that shortens the critical path; slot counts stay. Returns new
    rows."""
    rows = [list(r) for r in cells]
    dp = len(rows)
    if dp < 2:
        return rows
    cache: dict[int, tuple[float, ...]] = {}

    def vec_of(c: Cell) -> tuple[float, ...]:
        if id(c) not in cache:
            cache[id(c)] = tuple(solver.loads(c))
        return cache[id(c)]

    solved: dict[tuple[int, tuple[int, ...]], Cell | None] = {}

    def resolve(c: Cell, k: int) -> Cell | None:
        key = (k, tuple(c.trees))
        if key not in solved:
            n = Cell(k=k, trees=list(c.trees))
            solved[key] = n if solver.solve(n) else None
        return solved[key]

    vecs = [[x for c in row for x in vec_of(c)] for row in rows]
    for r in range(dp):
        peak = [max(vecs[q][s] for q in range(dp) if q != r) for s in range(len(vecs[r]))]
        cur = sum(max(a, p) for a, p in zip(vecs[r], peak, strict=True))
        best = None
        wins = [i for i, c in enumerate(rows[r]) if c.trees and c.k >= 2]
        grow = wins
        for i in wins:
            x = resolve(rows[r][i], rows[r][i].k - 1)
            if x is None:
                continue
            for j in grow:
                if j == i:
                    continue
                y = resolve(rows[r][j], rows[r][j].k + 1)
                if y is None:
                    continue
                row = [x if t == i else y if t == j else c for t, c in enumerate(rows[r])]
                v, row = order_row(row, vec_of, peak, (x, y))
                if v < cur * (1 - 1e-9) and (best is None or v < best[0]):
                    best = (v, row)
        if best is not None:
            rows[r] = best[1]
            vecs[r] = [x for c in rows[r] for x in vec_of(c)]
    return rows
