"""Search over windows (pp = 1, off the ideal path, opt-in: `PlanConfig.search_evaluations`
> 0, seeded by `PlanConfig.seed`). The final cells become placements (cell, first slot);
simulated annealing swaps or moves a tree between two cells or re-splits two cells' trees
into one or two new cells on the slots they free (`propose`), each neighbour scored by the
joint re-cut's LP (`Columns.score`, path capped); the best few layouts are re-cut
(`recut`) and the best kept when its path is no longer, its balance higher and its 5th
percentile no lower (`search_windows`), and again once repacked as the plan will run
(`finished_no_worse`). Deterministic for a seed."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np

from harts.plan.planners.l1l2.cell import Cell
from harts.plan.planners.l1l2.columns import SA_MAX_K, Columns
from harts.plan.planners.l1l2.measure import critical_path, slot_balances
from harts.plan.planners.l1l2.recut import recut
from harts.plan.planners.l1l2.solver import CellSolver
from harts.plan.planners.l1l2.state import Context, State

# simulated annealing temperature (in slot-balance units), its decay per evaluation and
# its floor; move mix (swap a tree, move a tree, re-form two cells)
SA_T0 = 0.0001
SA_DECAY = 0.99
SA_TMIN = 1e-5
SA_MOVES = (0.4, 0.25, 0.35)
# tries per re-forming move before another move is drawn
SA_TRIES = 4
# the best this many layouts met are re-cut and the best result kept
SA_REALISE = 3


def anneal_windows(ctx: Context, state: State) -> State:
    """Stage: when `state.refine` and `search_evaluations` > 0, `search_windows`, kept
    only where it still wins once both layouts are finished (`finished_no_worse`)."""
    config = ctx.config
    if not state.refine or config.search_evaluations <= 0:
        return state
    cells = search_windows(state.best.cells, ctx.solver, config.search_evaluations, config.seed,
                           pin_miss=ctx.pin_miss)
    if cells is state.best.cells or not finished_no_worse(cells, state.best.cells, ctx):
        return state
    return dataclasses.replace(state, best=dataclasses.replace(
        state.best, crit=critical_path(cells, ctx.solver), cells=cells))


def finished_no_worse(cells: list[list[Cell]], before: list[list[Cell]], ctx: Context) -> bool:
    """Whether `cells` is no worse than `before` as the plan will run: both repacked as
    `pipeline.finish` repacks them (`absorb.take_into_producers`), `cells` saving as many
    slots, on no longer a critical path, at a slot balance no lower and a 5th percentile
    of per-slot balances no lower. The search compares layouts before that repacking,
    where two layouts of one slot count may repack to different counts."""
    from harts.plan.planners.l1l2.absorb import take_into_producers

    solver = ctx.solver
    (a, saved_a), (b, saved_b) = (take_into_producers(x, ctx.config, solver) for x in (cells, before))
    if saved_a != saved_b or critical_path(a, solver) > critical_path(b, solver) * (1 + 1e-12):
        return False
    bal_a, bal_b = (slot_balances([[x for c in row for x in solver.loads(c)] for row in x]) for x in (a, b))
    return (sum(bal_a) / len(bal_a) >= sum(bal_b) / len(bal_b) - 1e-12
            and np.percentile(bal_a, 5) >= np.percentile(bal_b, 5) - 1e-12)


def place_on(S: int, freed: list[int], new: list[Cell], rng: random.Random) -> list[int] | None:
    """First slots for cells `new` on exactly the slots `freed` (a multiset: two cells
    may have freed one slot on two replicas), in random order, each on consecutive
    freed slots; None when they do not tile them."""
    left = [0] * S
    for s in freed:
        left[s] += 1
    order = list(range(len(new)))
    rng.shuffle(order)
    at: list[int] = [0] * len(new)
    for o in order:
        k = new[o].k
        starts = [s for s in range(S - k + 1) if all(left[s + q] > 0 for q in range(k))]
        if not starts:
            return None
        s = rng.choice(starts)
        at[o] = s
        for q in range(k):
            left[s + q] -= 1
    return at if not any(left) else None


def propose(M: Columns, P: list[tuple[Cell, int]], live: list[int], rng: random.Random):
    """One random neighbour of placements P (None when the draw does not give one): a tree
    swapped between two cells, a tree moved from one cell into another (shapes and slots
    kept), or the trees of two cells re-split into one or two new cells of at most
    `SA_MAX_K` slots laid on the slots they free."""
    i, j = rng.sample(live, 2)
    (a, sa), (b, sb) = P[i], P[j]
    u = rng.random()
    if u < SA_MOVES[0]:
        x, y = rng.choice(a.trees), rng.choice(b.trees)
        ca = M.cell_for(a.k, [t for t in a.trees if t != x] + [y])
        cb = ca and M.cell_for(b.k, [t for t in b.trees if t != y] + [x])
        if cb is None:
            return None
        Q = list(P)
        Q[i], Q[j] = (ca, sa), (cb, sb)
        return Q
    if u < SA_MOVES[0] + SA_MOVES[1]:
        if len(a.trees) < 2:
            return None
        x = rng.choice(a.trees)
        ca = M.cell_for(a.k, [t for t in a.trees if t != x])
        cb = ca and M.cell_for(b.k, [*b.trees, x])
        if cb is None:
            return None
        Q = list(P)
        Q[i], Q[j] = (ca, sa), (cb, sb)
        return Q
    pool = a.trees + b.trees
    n = a.k + b.k
    freed = [*range(sa, sa + a.k), *range(sb, sb + b.k)]
    for _ in range(SA_TRIES):
        g = [t for t in pool if rng.random() < 0.5]
        h = [t for t in pool if t not in g]
        groups = [x for x in (g, h) if x]
        if len(groups) == 1:
            ks = [n]
        else:
            k1 = rng.randint(1, n - 1)
            ks = [k1, n - k1]
        if any(k > SA_MAX_K for k in ks):
            continue
        new = []
        for grp, k in zip(groups, ks, strict=True):
            c = M.cell_for(k, grp)
            if c is None:
                break
            new.append(c)
        if len(new) != len(groups):
            continue
        at = place_on(M.S, freed, new, rng)
        if at is not None:
            return [p for t, p in enumerate(P) if t not in (i, j)] + list(zip(new, at, strict=True))
    return None


def search_windows(rows: list[list[Cell]], solver: CellSolver, evaluations: int,
                    seed: int, pin_miss: float | None = None) -> list[list[Cell]]:
    """Re-form the step's cells by simulated annealing (pp = 1): placements (cell, first
    slot) change by swapping or moving a tree between two cells or re-splitting two cells'
    trees into new cells on the slots they free (`propose`), each neighbour scored by
    the joint re-cut's linear program (`Columns.score`, the critical path capped at
    today's), `evaluations` of them (deterministic for a seed). The best layout is
    realised with `recut` and returned when its critical path is no longer, its slot
    balance higher and the 5th percentile of its per-slot balances no lower; else `rows`.
    Every tree stays in exactly one cell, so every row is still computed once."""
    vecs = [[x for c in row for x in solver.loads(c)] for row in rows]
    if len(rows) < 2 or evaluations <= 0 or any(len(v) != len(vecs[0]) for v in vecs):
        return rows
    crit = sum(map(max, *vecs))
    M = Columns(rows, solver, crit)
    P = M.P
    live = [t for t, (c, _) in enumerate(P) if c.trees]
    if len(live) < 2:
        return rows
    rng = random.Random(seed)
    cur = best = M.score(P)
    top: list[tuple[float, int, list[tuple[Cell, int]]]] = []  # the best layouts met
    temp = SA_T0
    n = tries = 0
    while n < evaluations and tries < 20 * evaluations:
        tries += 1
        Q = propose(M, P, live, rng)
        if Q is None:
            continue
        n += 1
        got = M.score(Q)
        if got >= 0 and (got > cur or rng.random() < math.exp((got - cur) / temp)):
            P, cur = Q, got
            live = [t for t, (c, _) in enumerate(P) if c.trees]
            if got > best:
                best = got
                top = sorted([*top, (-got, n, Q)], key=lambda x: x[:2])[:SA_REALISE]
        temp = max(temp * SA_DECAY, SA_TMIN)
    # the re-cut may miss the model (windows at the budget): the best few layouts are
    # realised, the best that passes kept
    now = slot_balances(vecs)
    out, out_bal = rows, sum(now) / len(now) + 1e-12
    for _, _, Q in top:
        cand = M.rows(Q)
        if cand is None:
            continue
        cand = recut(cand, solver, cap=crit, ranges=lambda c: M.info[id(c)][2], pin_miss=pin_miss)
        new = slot_balances([[x for c in row for x in solver.loads(c)] for row in cand])
        if (critical_path(cand, solver) <= crit * (1 + 1e-12)
                and sum(new) / len(new) > out_bal
                and np.percentile(new, 5) >= np.percentile(now, 5) - 1e-12):
            out, out_bal = cand, sum(new) / len(new)
    return out
