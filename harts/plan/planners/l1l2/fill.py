"""The two ways a cell's items are laid on its slots (`CellSolver.solve` tries both and
keeps the better).

Levelled (`fill_levelled`, cell of k slots, target L = the cell's load / k): items are
subtrees; a tree too large for a microbatch is split (its top node goes to the producer,
its children become items). k - 2 slots are *covered*: filled just past L by the subset
of items with the least overshoot within the token room (a min-token knapsack over
rounded costs), either anchored on the largest item or splitting an item at a fork when
nothing covers; the two cheapest slots become the window's ends. The overshoot of every
covered slot is then shaved into the producer (`CellSolver.shave_plan`), as far as the
budget allows.

Unlevelled (`fill_unlevelled`, when the covering does not pack): whole items
largest-cost-first into the least-loaded slot with token room, or first-fit-decreasing by
tokens followed by load-evening moves; slots heaviest first."""

from __future__ import annotations

from typing import Protocol

from harts.plan.planners.common import ForestIndex, first_fit_decreasing, lpt_balanced
from harts.plan.planners.l1l2.cell import Cell, Item
from harts.plan.planners.l1l2.knapsack import balance_bins, subset_near


class CellSolver(Protocol):
    """What the fills use of `solver.CellSolver` (which calls them): a protocol, so that this
    module does not import the solver back."""

    idx: ForestIndex
    budget: int
    rho: float
    ff: float

    def split_item(self, c: Cell, items: list[Item], it: Item) -> bool: ...
    def mandatory_splits(self, c: Cell, items: list[Item]) -> bool: ...
    def split_to_count(self, c: Cell, items: list[Item], k: int) -> bool: ...
    def shave_plan(self, c: Cell, target: float | list[float]) -> list[tuple[int, float]]: ...
    def apply_fitting(self, c: Cell, plan: list[tuple[int, float]], whole: int = 0, steps: int = 12) -> bool: ...
    def fits(self, c: Cell) -> bool: ...


def fill_unlevelled(solver: CellSolver, c: Cell, out: Cell, ffd: bool) -> bool:
    """No levelling: whole items largest-cost-first into the least-loaded slot with
    token room, or (`ffd`, for tight budgets) first-fit-decreasing by tokens followed
    by load-lowering moves and swaps; slots ordered by load, heaviest first."""
    idx = solver.idx
    items = [Item(t, idx.sub_cost[t], idx.sub_rows[t]) for t in c.trees]
    if not solver.mandatory_splits(c, items) or not solver.split_to_count(c, items, c.k):
        return False
    room = int(solver.budget - solver.rho * c.trunk_tokens)
    cost = [it.cost for it in items]
    tokens = [it.tokens for it in items]
    ids = list(range(len(items)))
    if not ffd:
        bins = lpt_balanced(ids, cost, tokens, c.k, room)
    else:
        bins = first_fit_decreasing(ids, tokens, room)
        if len(bins) > c.k:
            return False
        while len(bins) < c.k:
            donor = max((b for b in bins if len(b) > 1), key=len, default=None)
            if donor is None:
                return False
            small = min(donor, key=lambda i: (cost[i], i))
            donor.remove(small)
            bins.append([small])
        balance_bins(bins, cost, tokens, room)
    if bins is None or any(not b for b in bins):
        return False
    bins.sort(key=lambda b: (-sum(cost[i] for i in b), min(b)))
    out.trunk, out.trunk_cost, out.trunk_tokens = c.trunk, c.trunk_cost, c.trunk_tokens
    out.hanging = c.hanging
    out.bins = [[items[i] for i in b] for b in bins]
    return solver.fits(out)



def fill_levelled(solver: CellSolver, c: Cell, anchored: bool) -> bool:
    idx = solver.idx
    k = c.k
    items = [Item(t, idx.sub_cost[t], idx.sub_rows[t]) for t in c.trees]
    if not solver.mandatory_splits(c, items):
        return False
    total = sum(it.cost for it in items) + c.trunk_cost
    target = total / k
    # items above the target go one per middle slot (their excess is shaved); any
    # more than that are split at their top node, and (with a pipeline) so is the
    # largest item while the cell has fewer items than slots (a few large trees over
    # many slots)
    while True:
        huge = [it for it in items if it.cost > target]
        if len(huge) > max(0, k - 2):
            it = max(huge, key=lambda x: (x.cost, -x.root))
        elif len(items) < k:
            if not solver.split_to_count(c, items, len(items) + 1):
                return False
            continue
        else:
            break
        if not solver.split_item(c, items, it):
            return False
    todo = sorted(items, key=lambda x: (-x.cost, x.root))
    unit = max(target / 1000.0, 1e-9)
    room = solver.budget - solver.rho * c.trunk_tokens
    # k - 2 covering slots: the largest remaining item, completed by the subset of
    # the others that reaches the target with the least overshoot within the token
    # room; the two end slots share what is left
    bins: list[list[Item]] = []
    overshoot = 0.0
    for _ in range(k - 2):
        # a covering slot needs an item besides one per end: with a pipeline, split
        # the largest item with children while there are not enough
        if len(todo) < 3 and solver.split_to_count(c, todo, 3):
            todo.sort(key=lambda x: (-x.cost, x.root))
            room = solver.budget - solver.rho * c.trunk_tokens
        if len(todo) < 3:
            break
        if anchored:
            anchor = todo[0]
            pick = [anchor]
            if anchor.cost < target:
                pick += subset_near(
                    todo[1:-2], target - anchor.cost, unit, cover=True, room=room - anchor.tokens
                )
        else:
            while True:
                if todo[0].cost > target:
                    pick = [todo[0]]
                else:
                    pick = subset_near(todo, target, unit, cover=True, room=room)
                short = sum(it.cost for it in pick) < target
                if pick and not short and len(todo) - len(pick) >= 2:
                    break
                # the rest cannot cover the target and leave an item per end:
                # split the largest remaining item at a fork and try again
                fork = next((it for it in todo if len(idx.children[it.root]) > 1), None)
                if fork is None or not solver.split_item(c, todo, fork):
                    break
                todo.sort(key=lambda x: (-x.cost, x.root))
                room = solver.budget - solver.rho * c.trunk_tokens
            if not pick or len(todo) - len(pick) < 2:
                return False
        for it in pick:
            todo.remove(it)
        bins.append(pick)
        overshoot += max(0.0, sum(it.cost for it in pick) - target)
    if k == 1:
        bins.append(todo)
    else:
        x = c.trunk_cost + overshoot
        rest_tokens = sum(it.tokens for it in todo)
        pick = subset_near(todo, target - solver.ff * x, unit, cover=False, room=room)
        if pick and len(pick) < len(todo) and rest_tokens - sum(it.tokens for it in pick) > room:
            last = subset_near(todo, target - (1.0 - solver.ff) * x, unit, cover=False, room=room)
            if last and len(last) < len(todo):
                pick = [it for it in todo if it not in last]
        bins += [pick, [it for it in todo if it not in pick]]
    bins = [b for b in bins if b]
    if len(bins) < k:
        return False
    # the two cheapest slots are the window's ends: they absorb the producer's
    # forward (first slot) and backward (last slot); the others are levelled down
    order = sorted(range(k), key=lambda b: (sum(it.cost for it in bins[b]), b))
    last, first = order[0], order[1] if k > 1 else order[0]
    middle = [b for b in range(k) if b not in (first, last)]
    c.bins = [bins[first], *(bins[b] for b in middle)] + ([bins[last]] if k > 1 else [])
    if k > 1:
        # the largest share of the levelling shaves the budget allows
        return solver.apply_fitting(c, solver.shave_plan(c, target))
    return solver.fits(c)

