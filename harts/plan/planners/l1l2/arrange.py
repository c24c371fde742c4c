"""Arrangement (pp = 1): cells are independent, so whole cells may change places within a
replica or move between replicas (one for one of as many slots, or one for two whose slots
add up to its own). Each replica's cells start in falling order of their mean slot load
when that is shorter, then the best strictly improving move per pair of replicas is
taken, a few rounds. Where most trees need windows of their own, cells of one size hold
trees of very different cost, and lining alike loads up across replicas is what evens the
slots; the critical path never rises and no cell changes."""

from __future__ import annotations

from harts.plan.planners.l1l2.cell import Cell
from harts.plan.planners.l1l2.solver import CellSolver

# improvement rounds of `arrange` (each tries every pair of replicas once)
ARRANGE_ROUNDS = 8


def arrange(cells: list[list[Cell]], solver: CellSolver, rounds: int = ARRANGE_ROUNDS) -> list[list[Cell]]:
    """Line the replicas' slots up by moving whole cells: a cell swaps places with another
    cell of its replica, with a cell of as many slots on another replica, or with two
    cells of another replica whose slot counts add up to its own. Each replica keeps its
    slot count. Cells are unchanged (trees, windows, budgets), so the plan stays valid
    and every row is still computed once; only strictly improving moves are taken (per
    replica pair, the one that shortens the critical path sum_s max_r load(s, r) most),
    so the critical path never rises. Returns new rows (the input is not modified)."""
    rows = [list(r) for r in cells]
    dp = len(rows)
    if not any(rows):
        return rows
    loads = {c: list(solver.loads(c)) for row in rows for c in row}

    def vec(row: list[Cell]) -> list[float]:
        return [x for c in row for x in loads[c]]

    def crit(row_vecs: list[list[float]]) -> float:
        return sum(map(max, *row_vecs)) if len(row_vecs) > 1 else sum(row_vecs[0])

    vecs = [vec(r) for r in rows]
    current = crit(vecs)
    # start from each replica's cells in falling order of their mean slot load (alike
    # loads line up) when that is shorter already
    ranked = [sorted(r, key=lambda c: -sum(loads[c]) / c.k) for r in rows]
    ranked_vecs = [vec(r) for r in ranked]
    if crit(ranked_vecs) < current:
        rows, vecs, current = ranked, ranked_vecs, crit(ranked_vecs)
    for _ in range(rounds):
        improved = False
        for r1 in range(dp):
            for r2 in range(r1, dp):
                keep = [vecs[r] for r in range(dp) if r not in (r1, r2)]
                others = list(map(max, *keep)) if len(keep) > 1 else (keep[0] if keep else None)
                best = None
                bar = current * (1 - 1e-9)
                for wa, wb, build in moves(rows[r1], rows[r2], r1 == r2, loads, vecs[r1], vecs[r2]):
                    cand = [wa] if wb is None else [wa, wb]
                    if others is not None:
                        cand.append(others)
                    v = crit(cand)
                    if v < bar and (best is None or v < best[0]):
                        best = (v, build)
                if best is not None:
                    current, build = best
                    na, nb = build()
                    rows[r1], vecs[r1] = na, vec(na)
                    if nb is not None:
                        rows[r2], vecs[r2] = nb, vec(nb)
                    improved = True
        if not improved:
            break
    return rows


def moves(a: list[Cell], b: list[Cell], same: bool, loads: dict | None = None,
           va: list[float] | None = None, vb: list[float] | None = None):
    """The rearrangements `arrange` tries between two replicas' cell lists (or within one
    when `same`): (new a, new b or None). Given `loads` (each cell's slot loads, a list)
    and the two rows' load vectors `va`, `vb`, yields (new a's vector, new b's vector or
    None, a function that builds (new a, new b or None)) instead, in the same order, so
    that a move is priced without building its rows."""
    vec = loads is not None
    if vec:
        oa = [0]
        for c in a:
            oa.append(oa[-1] + c.k)
        ob = [0]
        for c in b:
            ob.append(ob[-1] + c.k)
    if same:
        for i in range(len(a)):
            for j in range(i + 1, len(a)):
                if a[i].trees or a[j].trees:
                    if vec:
                        v = va[: oa[i]] + loads[a[j]] + va[oa[i + 1] : oa[j]] + loads[a[i]] + va[oa[j + 1] :]

                        def build(i=i, j=j):
                            n = list(a)
                            n[i], n[j] = n[j], n[i]
                            return n, None

                        yield v, None, build
                        continue
                    n = list(a)
                    n[i], n[j] = n[j], n[i]
                    yield n, None
        return
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            if x.k == y.k:
                if vec:

                    def build(i=i, j=j, x=x, y=y):
                        na, nb = list(a), list(b)
                        na[i], nb[j] = y, x
                        return na, nb

                    yield (va[: oa[i]] + loads[y] + va[oa[i + 1] :], vb[: ob[j]] + loads[x] + vb[ob[j + 1] :], build)
                    continue
                na, nb = list(a), list(b)
                na[i], nb[j] = y, x
                yield na, nb
    for flip in (False, True):
        xs, ys = (b, a) if flip else (a, b)
        for i, x in enumerate(xs):
            if x.k < 2:
                continue
            for j1, y1 in enumerate(ys):
                if y1.k >= x.k:
                    continue
                for j2, y2 in enumerate(ys):
                    if j2 == j1 or y1.k + y2.k != x.k:
                        continue
                    if vec:
                        vxs, ox, vys, oy = (vb, ob, va, oa) if flip else (va, oa, vb, ob)
                        vx = vxs[: ox[i]] + loads[y1] + loads[y2] + vxs[ox[i + 1] :]
                        if j1 < j2:
                            vy = vys[: oy[j1]] + loads[x] + vys[oy[j1 + 1] : oy[j2]] + vys[oy[j2 + 1] :]
                        else:
                            vy = vys[: oy[j2]] + vys[oy[j2 + 1] : oy[j1]] + loads[x] + vys[oy[j1 + 1] :]

                        def build(i=i, x=x, y1=y1, y2=y2, j1=j1, j2=j2, xs=xs, ys=ys, flip=flip):
                            nx = xs[:i] + [y1, y2] + xs[i + 1 :]
                            ny = [x if t == j1 else c for t, c in enumerate(ys) if t != j2]
                            return (ny, nx) if flip else (nx, ny)

                        yield (vy, vx, build) if flip else (vx, vy, build)
                        continue
                    nx = xs[:i] + [y1, y2] + xs[i + 1 :]
                    ny = [x if t == j1 else c for t, c in enumerate(ys) if t != j2]
                    yield (ny, nx) if flip else (nx, ny)
