"""Windows repacked into fewer slots, the producer computing some items whole.

A cell's producer holds its trunk and shaved prefixes, often far less than the budget,
and a cell's slots are filled to the budget less `producer_retention` x the producer's
rows, so a window plan often has one microbatch more than the forest's compact rows
need. The producer can also compute items whole and own their trajectories: no consumer
reads those rows, so the memory rule (`Plan.memory_tokens`, which charges consumers for
the producer rows they read) charges nobody for them, and on CUDA the producer's saved
tensors for them wait in host memory with the rest of its own (`harts.exec.offload`,
copies on a stream of their own). `take_into_producers` repacks each window's items into
as few slots as fit: first-fit decreasing by rows into k - 1, k - 2, ... consumer slots of
`budget - producer_retention x producer rows` each, an item that fits no slot taken whole
by the producer while the producer stays within the budget (or first one slot's items
taken whole, the smallest slot first, and the rest packed so). Every row is still computed
once and the shaved prefixes stay where they were; what it buys is one microbatch's
launches, weight reads and gradient accumulation per slot saved; what it costs is a
producer whose forward and backward hold more rows.

Without a pipeline (`PlanConfig.pp == 1`). On one replica the slots run one after
another and fewer of them only shortens the step; there a cell of several trees is also
tried as one cell per tree (`split_trees`), kept where it makes fewer microbatches and
its summed path is no longer. With several replicas the slots line up across them (a
slot's collectives run together), so a replica's slot saved is only a slot saved when
every replica saves one: each replica saves as many as the one that saves fewest, kept
where the critical path (the sum over slots of the heaviest replica's load) is no
longer.
"""

from __future__ import annotations

from harts.plan.planners.common import PlanConfig
from harts.plan.planners.l1l2.cell import Cell, Item
from harts.plan.planners.l1l2.measure import critical_path
from harts.plan.planners.l1l2.solver import CellSolver


def take_into_producers(cells: list[list[Cell]], config: PlanConfig,
                        solver: CellSolver | None = None) -> tuple[list[list[Cell]], int]:
    """`cells` with windows repacked into fewer slots (`repack`), and the number of
    microbatches saved per replica; the cells themselves when nothing is saved (cells
    are shared between candidates and never changed: a repacked cell is a new one).
    `solver` prices the paths compared (without it, only `repack` on one replica)."""
    if config.pp != 1:
        return cells, 0
    budget, rho = config.microbatch_tokens, config.producer_retention
    if len(cells) == 1:
        out, saved = [], 0
        for c in cells[0]:
            r = repack(c, budget, rho)
            best = [c if r is None else r]
            if solver is not None and (parts := split_trees(c, solver, budget, rho)) is not None:
                # fewer microbatches, and no longer a path (the load model may price no
                # microbatch overhead)
                if (microbatches(parts) < microbatches(best)
                        and critical_path([parts], solver) <= critical_path([best], solver) * (1 + 1e-9)):
                    best = parts
            saved += microbatches([c]) - microbatches(best)
            out.extend(best)
        return ([out], saved) if saved else (cells, 0)
    # several replicas: each saves what the replica saving fewest saves
    full = [[repack(c, budget, rho) for c in row] for row in cells]
    saved = min(sum(c.k - r.k for c, r in zip(row, rs, strict=True) if r is not None)
                for row, rs in zip(cells, full, strict=True))
    if saved == 0 or solver is None:
        return cells, 0
    out = []
    for row, rs in zip(cells, full, strict=True):
        need, new_row = saved, []
        for c, r in zip(row, rs, strict=True):
            if r is not None and need and c.k - r.k > need:
                r = repack(c, budget, rho, fewest=c.k - need)  # fewer slots than needed saved
            if r is not None and need:
                need -= c.k - r.k
                c = r
            new_row.append(c)
        if need:
            return cells, 0
        out.append(new_row)
    # fewer microbatches on no longer a path (the load model may price no overhead)
    if critical_path(out, solver, 1) > critical_path(cells, solver, 1) * (1 + 1e-9):
        return cells, 0
    return out, saved


def split_trees(c: Cell, solver: CellSolver, budget: int, rho: float) -> list[Cell] | None:
    """A cell of several trees as one cell per tree, each on the fewest slots the solver
    fits it in and repacked, or None (one tree, or a tree that fits no cell of at most
    c.k slots). One window under several trees' shared rows makes one producer hold them
    all, and the consumers' room is the budget less `rho` x all of them; on one replica,
    where the cells' paths add up, a window per tree may take fewer slots."""
    if len(c.trees) < 2:
        return None
    parts = []
    for t in c.trees:
        cell = next((x for k in range(1, c.k + 1) if (x := solver.solved(k, [t])) is not None), None)
        if cell is None:
            return None
        parts.append(repack(cell, budget, rho) or cell)
    return parts


def microbatches(cells: list[Cell]) -> int:
    """The microbatches `cells` make: one per non-empty slot, and a producer per cell whose
    slots read one (`microbatches.to_microbatches`)."""
    return sum(sum(1 for b in c.bins if b) + any(c.reads_producer(b) for b in range(c.k)) for c in cells)


def repack(c: Cell, budget: int, rho: float, fewest: int = 1) -> Cell | None:
    """Cell `c` on the fewest slots (< c.k, >= `fewest`) its items fit, or None: each consumer slot
    holds at most `budget - rho x (trunk + every shaved prefix)` rows, the producer
    `budget` rows with the items it takes whole; every slot keeps an item and at least one
    reads the producer (which otherwise would not run before its consumers)."""
    items = [it for b in c.bins for it in b]
    shaved = sum(it.shaved_tokens for it in items)
    if c.k < 2 or not (c.trunk or shaved):
        return None
    room = budget - rho * (c.trunk_tokens + shaved)
    producer_room = budget - c.trunk_tokens - shaved
    # what the producer takes first: nothing (first fit decides), or one slot's items whole
    # (the smallest slots first: the whole consumer run inside the producer)
    firsts = [[]] + [c.bins[b] for b in sorted(range(c.k), key=lambda b: (c.bin_tokens(b), b))]
    best = None
    for k in range(c.k - 1, max(fewest, 1) - 1, -1):
        packed = next((p for first in firsts if (p := _pack(items, k, room, producer_room, first)) is not None),
                      None)
        if packed is None:
            break
        bins, taken = packed
        trial = Cell(k=k, trees=list(c.trees), trunk=list(c.trunk), trunk_cost=c.trunk_cost,
                     trunk_tokens=c.trunk_tokens, bins=bins, hanging=set(c.hanging), taken=taken)
        if not any(trial.reads_producer(b) for b in range(k)):
            break
        best = trial
    return best


def _pack(items: list[Item], k: int, room: float, producer_room: int,
          first: list[Item]) -> tuple[list[list[Item]], list[Item]] | None:
    """The items of `first` taken whole into the producer's `producer_room` rows, then
    first-fit decreasing of the rest (their rows left after shaving) into k slots of `room`
    rows, the ones that fit none taken whole too; None if one fits neither, `first` does
    not fit the producer or a slot stays empty."""
    taken = list(first)
    producer_room -= sum(it.left_tokens for it in first)
    if producer_room < 0:
        return None
    bins: list[list[Item]] = [[] for _ in range(k)]
    load = [0] * k
    rest = [it for it in items if all(it is not t for t in taken)]
    for it in sorted(rest, key=lambda x: (-x.left_tokens, x.root)):
        j = next((j for j in range(k) if load[j] + it.left_tokens <= room), None)
        if j is not None:
            bins[j].append(it)
            load[j] += it.left_tokens
        elif it.left_tokens <= producer_room:
            taken.append(it)
            producer_room -= it.left_tokens
        else:
            return None
    if not all(bins):
        return None
    return bins, taken
