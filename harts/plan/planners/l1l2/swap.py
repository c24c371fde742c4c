"""Tree swaps (pp = 1, off the ideal path). A window's loads move only inside it, so a
cell heavier over its slots than the other replicas' slots there (trees near the budget
leave it little room) keeps those slots' peaks whatever the re-cut does. Per round, each
placement's excess (its load minus the slots' mean loads over its span), the single-tree
swaps between two cells that most lower the summed |excess| shortlisted, each scored by
the re-cut LP (`Columns.score`, path capped) with the new cells' ranges taken as the old
cells' moved by the change in their slot loads, the best few scored again with their own
ranges, the best taken when it raises the LP's balance; then `recut`, kept when the path
is no longer, the balance higher and its 5th percentile no lower. Deterministic."""

from __future__ import annotations

import dataclasses

import numpy as np

from harts.plan.planners.l1l2.cell import Cell
from harts.plan.planners.l1l2.columns import Columns
from harts.plan.planners.l1l2.measure import critical_path, slot_balances
from harts.plan.planners.l1l2.recut import recut
from harts.plan.planners.l1l2.solver import CellSolver
from harts.plan.planners.l1l2.state import Context, State


def swap_cells_trees(ctx: Context, state: State) -> State:
    """Stage: when `state.refine`, `swap_trees` on the plan's cells."""
    if not state.refine:
        return state
    cells = swap_trees(state.best.cells, ctx.solver, pin_miss=ctx.pin_miss)
    return dataclasses.replace(state, best=dataclasses.replace(
        state.best, crit=critical_path(cells, ctx.solver), cells=cells))


# `swap_trees`: rounds of single-tree swaps; per round the `SWAP_SHORTLIST` swaps that
# most even the placements' loads against the slots' means are scored by the re-cut LP
# with the old cells' ranges moved to the new cells' loads, the best `SWAP_EXACT` of
# them again with the new cells' own ranges
SWAP_ROUNDS = 2
SWAP_SHORTLIST = 6
SWAP_EXACT = 2


class Shifted:
    """Stand-in for a cell in `Columns.score`: a solved cell's loads with the ranges of
    the cell it replaces, moved by the difference in each slot's load (no re-cuts)."""

    def __init__(self, k: int):
        self.k = k


def swap_trees(rows: list[list[Cell]], solver: CellSolver, rounds: int = SWAP_ROUNDS,
                shortlist: int = SWAP_SHORTLIST, exact: int = SWAP_EXACT,
                pin_miss: float | None = None) -> list[list[Cell]]:
    """Swap one tree between two cells of the step (pp = 1), shapes and slots kept: the
    joint re-cut can only move load inside a window, so a cell that is heavier over its
    slots than the other replicas' slots there (trees near the budget leave a window
    little room) keeps those slots' peaks; a tree of it traded for a lighter tree of a
    cell that is light over its own slots evens both. Per round, the swaps that most
    lower the placements' summed |load - the slots' mean loads over their span| are
    scored by the re-cut LP (`Columns.score`, the critical path capped at today's),
    first with each new cell's ranges taken as the old cell's moved by the change in its
    slot loads (`shortlist` of them), then the best `exact` with their own ranges; the
    best swap is taken when it raises the LP's balance. The result is re-cut (`recut`)
    and returned when its critical path is no longer, its slot balance higher and the
    5th percentile of its per-slot balances no lower; else `rows`. Every tree stays in
    one cell and each cell solves on all its slots, so every row is computed once.
    Deterministic."""
    vecs = [[x for c in row for x in solver.loads(c)] for row in rows]
    dp = len(rows)
    if dp < 2 or rounds <= 0 or any(len(v) != len(vecs[0]) for v in vecs):
        return rows
    idx = solver.idx
    cost = idx.sub_cost
    crit = sum(map(max, *vecs))
    M = Columns(rows, solver, crit)
    P = list(M.P)
    where = [(r, i) for r, row in enumerate(rows) for i in range(len(row))]
    cur = M.score(P)
    if cur < 0:
        return rows

    def solved(k: int, trees: list[int]) -> Cell | None:
        c = solver.solved(k, sorted(trees, key=lambda t: (-cost[t], t)))
        return c if c is not None and len(c.bins) == k and all(c.bins) else None

    def shifted(old: Cell, new: Cell) -> Shifted:
        _, ld, rg, _ = M.info[id(old)]
        nl = solver.loads(new)
        if rg is not None:
            rg = [(lo + b - a, hi + b - a) for (lo, hi), a, b in zip(rg, ld, nl, strict=True)]
        proxy = Shifted(new.k)
        M.info[id(proxy)] = (proxy, nl, rg, sum(nl))
        return proxy

    swapped = False
    for _ in range(rounds):
        mean = [0.0] * M.S
        for c, s in P:
            for j, x in enumerate(M.info[id(c)][1]):
                mean[s + j] += x / dp
        excess = [M.info[id(c)][3] - sum(mean[s : s + c.k]) for c, s in P]
        cands = []
        for t1 in range(len(P)):
            (a, sa), e1 = P[t1], excess[t1]
            for t2 in range(t1 + 1, len(P)):
                (b, sb), e2 = P[t2], excess[t2]
                # two single-tree cells on the same slots: a swap only relabels them
                same = sa == sb and a.k == b.k and len(a.trees) == len(b.trees) == 1
                if same:
                    continue
                for x in a.trees:
                    for y in b.trees:
                        d = cost[x] - cost[y]
                        gain = abs(e1) + abs(e2) - abs(e1 - d) - abs(e2 + d)
                        if gain > 1e-9:
                            cands.append((-gain, t1, t2, x, y))
        cands.sort()
        scored = []
        for _, t1, t2, x, y in cands:
            if len(scored) >= shortlist:
                break
            (a, sa), (b, sb) = P[t1], P[t2]
            na = solved(a.k, [t for t in a.trees if t != x] + [y])
            nb = na and solved(b.k, [t for t in b.trees if t != y] + [x])
            if nb is None:
                continue
            Q = list(P)
            Q[t1], Q[t2] = (shifted(a, na), sa), (shifted(b, nb), sb)
            got = M.score(Q)
            if got > cur:
                scored.append((-got, t1, t2, x, y))
        best = None
        for _, t1, t2, x, y in sorted(scored)[:exact]:
            (a, sa), (b, sb) = P[t1], P[t2]
            na = solved(a.k, [t for t in a.trees if t != x] + [y])
            nb = solved(b.k, [t for t in b.trees if t != y] + [x])
            if any(M.reg(n) and n.k >= 2 and M.info[id(n)][2] is None for n in (na, nb)):
                continue  # a window whose re-cuts do not fit
            Q = list(P)
            Q[t1], Q[t2] = (na, sa), (nb, sb)
            got = M.score(Q)
            if got > cur + 1e-12 and (best is None or got > best[0]):
                best = (got, Q)
        if best is None:
            break
        cur, P = best
        swapped = True
    if not swapped:
        return rows
    new_rows = [list(r) for r in rows]
    for (r, i), (c, _) in zip(where, P, strict=True):
        new_rows[r][i] = c
    cand = recut(new_rows, solver, cap=crit, ranges=lambda c: M.info[id(c)][2], pin_miss=pin_miss)
    now = slot_balances(vecs)
    new = slot_balances([[x for c in row for x in solver.loads(c)] for row in cand])
    if (critical_path(cand, solver) <= crit * (1 + 1e-12)
            and sum(new) / len(new) > sum(now) / len(now) + 1e-12
            and np.percentile(new, 5) >= np.percentile(now, 5) - 1e-12):
        return cand
    return rows
