"""Joint re-cut (pp = 1, off the ideal path). Re-cutting one window at a time cannot move a
slot whose peak sits on another replica; a linear program over every window's slot loads
(each within the range a re-cut reaches, `window_ranges`) lowers
sum_s (peak - mean) / peak with the path capped at today's, and `CellSolver.relevel`
applies it (`recut`). Kept only when the path is no longer and the slot balance higher."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from harts.plan.planners.l1l2.cell import Cell
from harts.plan.planners.l1l2.lp import LinearProgram, LPBackend, solve
from harts.plan.planners.l1l2.measure import critical_path, slot_balance
from harts.plan.planners.l1l2.solver import CellSolver
from harts.plan.planners.l1l2.state import Context, State

# rounds of `recut` (each re-solves the linear program at the new slot peaks)
RECUT_ROUNDS = 2
# `recut`: a window whose re-cut misses the LP's loads by more than this share of its
# load in all is held at what it got while the others are solved again
PIN_MISS = 0.002


def recut_windows(ctx: Context, state: State) -> State:
    """Stage: when `state.refine`, every window of the plan re-cut together (`recut`); the
    cells it started from are kept as `state.before_recut`."""
    if not state.refine:
        return state
    cells = recut(state.best.cells, ctx.solver, pin_miss=ctx.pin_miss)
    return dataclasses.replace(state, best=dataclasses.replace(
        state.best, crit=critical_path(cells, ctx.solver), cells=cells), before_recut=state.best.cells)


def window_ranges(solver: CellSolver, c: Cell, steps: int = 12) -> list[tuple[float, float]] | None:
    """The load each slot of window c can take under a re-cut (`CellSolver.relevel`):
    per slot, the load when it is aimed at everything and at nothing (the others sharing
    the rest evenly). The slots are treated as
    independent (a box), so a load the ranges allow may be missed by the re-cut (which
    then lands nearest to it); the caller checks what it gets. None when a re-cut does not
    fit. `steps`: the re-cuts' bisection steps (`CellSolver.apply_fitting`; fewer give
    ranges a little narrower where the budget binds, never wider). Memoised per cell on
    the solver (a cell never changes once solved), and by what its re-cuts start from
    (slot count, trunk, each slot's item roots and the cell's load in all; not its
    shaves, which `relevel` redoes), so that re-cut copies of one cell share them."""
    got = solver.range_memo.get((id(c), steps))
    if got is None:
        key = (c.k, tuple(c.trunk), tuple(tuple(it.root for it in b) for b in c.bins), sum(solver.loads(c)), steps)
        rg = solver.range_memo_by_start.get(key, False)
        if rg is False:
            rg = solver.range_memo_by_start[key] = reach_ranges(solver, c, steps)
        got = solver.range_memo[(id(c), steps)] = (c, rg)
    return got[1]


def reach_ranges(solver: CellSolver, c: Cell, steps: int) -> list[tuple[float, float]] | None:
    total = sum(solver.loads(c))
    k = c.k

    def reach(aim: list[float], b: int) -> float | None:
        new = solver.relevel(c, aim, steps)
        return None if new is None else solver.loads(new)[b]

    hi = []
    for b in range(k):
        x = reach([total if j == b else 0.0 for j in range(k)], b)
        if x is None:
            return None
        hi.append(x)
    out = []
    for b in range(k):
        # emptied: the others share the rest evenly
        lo = reach([0.0 if j == b else total / (k - 1) for j in range(k)], b)
        if lo is None:
            return None
        out.append((min(lo, hi[b]), max(lo, hi[b])))
    return out


def recut(cells: list[list[Cell]], solver: CellSolver, rounds: int = RECUT_ROUNDS,
           cap: float | None = None, ranges=None, pin_miss: float | None = None) -> list[list[Cell]]:
    """Re-cut all windows at once (pp = 1): each window's slot loads become variables
    within the ranges a re-cut reaches (`window_ranges`; a window's loads sum to its
    own), every other slot load stays, and a linear program minimises
    sum_s w_s (max_r load(s, r) - mean_r load(s, r)) with w_s = 1 / the slot's current
    peak (slot balance, linearised; re-weighted at each round's result), the critical
    path no longer than now. Where the other replicas' peaks keep one window from moving
    alone, many windows moving together can (a slot that every window empties alike).
    The chosen loads are applied with `relevel` (the nearest re-cut that fits); when a
    window misses them (its producer at the budget), it is held at what it got and the
    others are solved again at the same weights (a repair solve, not a round); a result
    is kept only when its critical path is no longer and its slot balance higher, the
    best such one returned. Trees, producers' trunks and slot counts stay. Returns new
    rows (the input is not modified). `pin_miss`: the share of a window's load its re-cut
    may miss the LP's loads by before it is held for a repair solve (None: `PIN_MISS`; inf: no repair)."""
    miss = PIN_MISS if pin_miss is None else pin_miss
    rows = [list(r) for r in cells]
    dp = len(rows)
    if dp < 2 or not any(rows):
        return rows
    wins = []  # (replica, first slot, cell index, ranges, total)
    for r, row in enumerate(rows):
        s0 = 0
        for i, c in enumerate(row):
            if c.k >= 2 and c.trees and all(c.bins):
                rng = window_ranges(solver, c) if ranges is None else ranges(c)
                if rng is not None:
                    wins.append((r, s0, i, rng, sum(solver.loads(c))))
            s0 += c.k
    if not wins:
        return rows
    vecs = [[x for c in row for x in solver.loads(c)] for row in rows]
    n_slots = len(vecs[0])
    if any(len(v) != n_slots for v in vecs):
        return rows
    crit = round(sum(map(max, *vecs)), 6)
    if cap is not None:
        crit = min(crit, round(cap, 6))
    bal = slot_balance(vecs)
    best = rows
    cur = vecs
    # windows whose re-cut missed its aims (the budget binds), by index in `wins`: their
    # re-cut copy and its loads, held fixed by a repair solve at the same weights right
    # after (not counted as a round), so that the others aim at what they really got
    pinned: dict[int, tuple[Cell, list[float]]] = {}
    done, repair = 0, False
    while done < rounds:
        # variables: each window's first k - 1 slot loads (the last is what is left),
        # then one peak per slot
        fixed = np.array(vecs, dtype=np.float64).T  # [slot, replica]; windows' slots below
        lin: list[tuple[int, int, int, float]] = []  # (slot, replica, variable, coefficient)
        bounds: list[tuple[float, float]] = []
        last_rows: list[tuple[list[int], float, float]] = []  # sum of a window's vars within
        for j, (r, s0, _i, rng, total) in enumerate(wins):
            k = len(rng)
            if j in pinned:
                fixed[s0 : s0 + k, r] = pinned[j][1]
                continue
            fixed[s0 : s0 + k, r] = 0.0
            fixed[s0 + k - 1, r] = total
            first = len(bounds)
            for b in range(k - 1):
                bounds.append(rng[b])
                lin.append((s0 + b, r, first + b, 1.0))
                lin.append((s0 + k - 1, r, first + b, -1.0))
            lo, hi = rng[-1]
            last_rows.append((list(range(first, first + k - 1)), total - hi, total - lo))
        nv = len(bounds)
        n = nv + n_slots
        if not repair:
            w = 1.0 / np.maximum(np.array([max(col) for col in zip(*cur, strict=True)]), 1e-9)
        cost = np.zeros(n)
        cost[nv:] = w
        a_ub = np.zeros((n_slots * dp + 2 * len(last_rows) + 1, n))
        b_ub = np.zeros(a_ub.shape[0])
        for s in range(n_slots):
            for r in range(dp):
                a_ub[s * dp + r, nv + s] = -1.0
                b_ub[s * dp + r] = -fixed[s, r]
        for s, r, v, co in lin:
            a_ub[s * dp + r, v] += co
            cost[v] -= w[s] * co / dp
        base = n_slots * dp
        for j, (vs, lo, hi) in enumerate(last_rows):
            a_ub[base + 2 * j, vs] = 1.0
            b_ub[base + 2 * j] = hi
            a_ub[base + 2 * j + 1, vs] = -1.0
            b_ub[base + 2 * j + 1] = -lo
        a_ub[-1, nv:] = 1.0
        b_ub[-1] = crit
        lower = np.array([lo for lo, _ in bounds] + [0.0] * n_slots)
        upper = np.array([hi for _, hi in bounds] + [math.inf] * n_slots)
        lp = LinearProgram(cost, lower, upper, a_ub, np.full(len(b_ub), -math.inf), b_ub)
        sol = solve(lp, LPBackend.HIGHS)
        if sol is None:
            break
        cand = [list(r) for r in rows]
        at = 0
        missed: dict[int, tuple[Cell, list[float]]] = {}
        for j, (r, _s0, i, rng, total) in enumerate(wins):
            if j in pinned:
                cand[r][i] = pinned[j][0]
                continue
            k = len(rng)
            aim = [float(sol[at + b]) for b in range(k - 1)]
            aim.append(total - sum(aim))
            at += k - 1
            new = solver.relevel(rows[r][i], aim)
            if new is not None:
                cand[r][i] = new
                got = solver.loads(new)
                if sum(abs(x - y) for x, y in zip(got, aim, strict=True)) > miss * total:
                    missed[j] = (new, got)
        pinned.update(missed)
        cur = [[x for c in row for x in solver.loads(c)] for row in cand]
        # kept only when the path is no longer and the slots are better balanced; the
        # next round re-weights at this candidate's peaks either way
        cbal = slot_balance(cur)
        if round(sum(map(max, *cur)), 6) <= crit and cbal > bal + 1e-12:
            best, bal = cand, cbal
        if missed and not repair:
            repair = True
        else:
            repair = False
            done += 1
            pinned.clear()
    return best
