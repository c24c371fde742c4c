"""Cells for one (slot count S, cells per replica m): each replica's S slots cut into runs
of consecutive slots (`group_sizes`; a tree larger than the budget gets a cell of its own),
whole trees dealt to cells (`assign_trees`), each cell solved (`solve_cell`).

Trees are dealt largest-cost-first into the cell least loaded relative to its slot count
(token room capped near the step's average fill), then the best move or swap out of the
heaviest cell is applied while it helps. A tree over the budget that runs as a 1-slot
window (`CellSolver.alone`) may sit alone in a cell of one slot whatever that cell's token
room. A cell that does not solve on all its slots (a one-node tree cannot be split over
two) runs on as many as solve, the rest left empty. A tree never leaves its cell and each
cell has at most one producer, so every row of the step is computed exactly once."""

from __future__ import annotations

import math

from harts.plan.planners.common import ForestIndex
from harts.plan.planners.l1l2.cell import Cell
from harts.plan.planners.l1l2.solver import CellSolver

# improvement rounds of `assign_trees` (each applies the best move out of the heaviest cell)
MAX_SWAP_ROUNDS = 400


def assign_trees(
    idx: ForestIndex,
    sizes: list[int],
    cap: list[float],
    fixed: dict[int, int],
    replica_of: list[int] | None = None,
    alone: frozenset[int] = frozenset(),
) -> list[list[int]] | None:
    """Trees to cells: largest cost first into the cell least loaded relative to its size
    (with token room), then the best single move or swap between the heaviest cell and
    any other while it lowers the heaviest relative load. `fixed` pins trees to cells.

    `replica_of` (each cell's replica), when given, breaks ties between equally loaded
    cells toward the least loaded replica; without it the lowest-numbered cell wins, which
    puts the largest trees on the first replica's cells while they are all empty. l1l2
    passes it with a pipeline (several cells per replica are then the rule) and, without
    one, tries both dealings (`choose.search_slots`).

    `alone`: trees a 1-slot cell may hold by themselves whatever its token room (a tree a
    little over the budget that runs as a 1-slot window, `CellSolver.alone`)."""
    n = len(sizes)

    def fits(i: int, tok: int, out: int | None, into: int | None) -> bool:
        # cell i with `tok` tokens after tree `out` leaves it and `into` joins it
        if tok <= cap[i]:
            return True
        if sizes[i] != 1 or not alone:
            return False
        left = [t for t in cells[i] if t != out] + ([into] if into is not None else [])
        return len(left) == 1 and left[0] in alone

    load = [0.0] * n
    tokens = [0] * n
    cells: list[list[int]] = [[] for _ in range(n)]
    replica_of = replica_of if replica_of is not None else [0] * n
    rep_load = [0.0] * (max(replica_of, default=0) + 1)
    cost, rows = idx.sub_cost, idx.sub_rows
    for t, i in fixed.items():
        cells[i].append(t)
        load[i] += cost[t]
        tokens[i] += rows[t]
        rep_load[replica_of[i]] += cost[t]
    for t in sorted(idx.roots, key=lambda r: (-cost[r], r)):
        if t in fixed:
            continue
        best, best_key = -1, None
        for i in range(n):
            if fits(i, tokens[i] + rows[t], None, t):
                key = (load[i] / sizes[i], rep_load[replica_of[i]])
                if best_key is None or key < best_key:
                    best, best_key = i, key
        if best < 0:
            return None
        cells[best].append(t)
        load[best] += cost[t]
        tokens[best] += rows[t]
        rep_load[replica_of[best]] += cost[t]
    for _ in range(MAX_SWAP_ROUNDS):
        rel = [load[i] / sizes[i] for i in range(n)]
        hi = max(range(n), key=lambda i: (rel[i], -i))
        best_val, best_move = rel[hi], None
        for lo in range(n):
            if lo == hi:
                continue
            for a in cells[hi]:
                if a in fixed:
                    continue
                for b in [None, *cells[lo]]:
                    if b in fixed:
                        continue
                    delta = cost[a] - (cost[b] if b is not None else 0.0)
                    dt = rows[a] - (rows[b] if b is not None else 0)
                    if delta <= 0 or not fits(lo, tokens[lo] + dt, b, a) or not fits(hi, tokens[hi] - dt, a, b):
                        continue
                    new = max((load[hi] - delta) / sizes[hi], (load[lo] + delta) / sizes[lo])
                    if new < best_val - 1e-9:
                        best_val, best_move = new, (lo, a, b, delta, dt)
        if best_move is None:
            break
        lo, a, b, delta, dt = best_move
        cells[hi].remove(a)
        cells[lo].append(a)
        if b is not None:
            cells[lo].remove(b)
            cells[hi].append(b)
        load[hi] -= delta
        load[lo] += delta
        tokens[hi] -= dt
        tokens[lo] += dt
    return cells


def group_sizes(slots: int, groups: int) -> list[int]:
    base, extra = divmod(slots, groups)
    return [base + (1 if g < extra else 0) for g in range(groups) if base + (1 if g < extra else 0)]


def build(
    idx: ForestIndex, solver: CellSolver, dp: int, slots: int, groups: int, by_replica: bool = False
) -> list[list[Cell]] | None:
    """Cells per replica. A tree larger than the budget gets a cell of its own on its
    replica (its trunk then only weighs on that cell's microbatches' budget; other trees
    join it where the cell still solves).
    `by_replica`: trees dealt with ties broken toward the least loaded replica (always so
    with a pipeline)."""
    alone = solver.alone()
    giants = sorted((r for r in idx.roots if idx.sub_rows[r] > solver.budget),
                    key=lambda r: (-idx.sub_rows[r], r))
    # only a few giants get cells of their own (when every tree is a giant, as with
    # step-wise sampling, the cells' own producers take them)
    if len(giants) > dp:
        giants = []
    layout: list[list[int]] = []
    fixed: dict[int, int] = {}
    n = 0
    for r in range(dp):
        own = own_slots(idx, solver, giants[r], slots) if r < len(giants) else 0
        if own and slots > own:
            sizes = [own, *group_sizes(slots - own, min(groups, slots - own))]
            fixed[giants[r]] = n
        else:
            sizes = group_sizes(slots, groups)
        layout.append(sizes)
        n += len(sizes)
    flat = [k for sizes in layout for k in sizes]
    replica_of = [r for r, sizes in enumerate(layout) for _ in sizes]
    # token room per cell: near the step's average fill first (so no cell is left with
    # more tokens than its slots can pack), looser if that cannot be met
    fill = idx.forest.compact_tokens / (dp * slots * solver.budget)
    # a giant's cell takes other trees too, and, where it then does not solve, none
    tries = [(slack, False) for slack in (0.01, 0.03, 0.1, None)] + ([(None, True)] if fixed else [])
    for slack, exclusive in tries:
        share = 1.0 if slack is None else min(1.0, fill + slack)
        cap = [k * solver.budget * share for k in flat]
        for t, i in fixed.items() if exclusive else ():
            cap[i] = idx.sub_rows[t]
        trees = assign_trees(idx, flat, cap, fixed, replica_of if solver.pp > 1 or by_replica else None, alone)
        if trees is None:
            continue
        out: list[list[Cell]] = []
        i = 0
        ok = True
        for sizes in layout:
            row = []
            for k in sizes:
                cell = solve_cell(solver, k, trees[i])
                i += 1
                if cell is None:
                    ok = False
                    break
                row += cell
            if not ok:
                break
            out.append(row)
        if ok:
            return out
    return None


def first_slots(idx: ForestIndex, budget: int, tree: int) -> int:
    """A giant tree's slots at 90% of the budget per slot: where its own cell starts."""
    return math.ceil(idx.sub_rows[tree] / (0.9 * budget))


def own_slots(idx: ForestIndex, solver: CellSolver, tree: int, slots: int) -> int:
    """The slots of a giant tree's own cell: from `first_slots` up to the fewest on which
    it solves alone (a long shared prompt held by every consumer can need more slots than
    its rows alone ask for), at most `slots`."""
    k = first_slots(idx, solver.budget, tree)
    while k < slots and solver.solved(k, [tree]) is None:
        k += 1
    return k


def solve_cell(solver: CellSolver, k: int, trees: list[int]) -> list[Cell] | None:
    """The cells that run `trees` on k consecutive slots: one cell of k slots, or when that
    does not solve (a tree of one node cannot be split over two slots, say), the trees on
    as many of the k slots as solve (down to a 1-slot window) followed by an empty cell of
    the slots left over; None when not even one slot holds them."""
    if not trees:
        return [Cell(k=k, trees=[], bins=[[] for _ in range(k)])]
    for j in range(k, 0, -1):
        c = solver.solved(j, trees)
        if c is None:
            continue
        if j == k:
            return [c]
        return [c, Cell(k=k - j, trees=[], bins=[[] for _ in range(k - j)])]
    return None



def group_options(slots: int) -> list[int]:
    """Cells per replica tried for `slots` slots: 1 to 4, then doubling."""
    out, m = [], 1
    while m <= slots:
        out.append(m)
        m = m + 1 if m < 4 else m * 2
    return out


def fewest_microbatches(cells: list[list[Cell]]) -> int:
    """The fewest non-producer microbatches on any replica."""
    return min(sum(1 for c in row for b in c.bins if b) for row in cells)

