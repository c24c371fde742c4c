"""Checks of `harts.plan.plan.Plan.validate` beside the row cover: an expanded plan's chains
of windows (trajectories longer than its budget, each its own copy cut along its path) and
the stored costs. `plan` is a `Plan` (not imported: the plan module imports this one)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from harts.tree.forest import RolloutForest


def chain_roots(plan: Any) -> dict[int, int]:
    """Expanded mode: microbatch id -> the first piece of its chain, for the microbatches
    that compute pieces of one trajectory's copy (a chain of windows along its path)."""
    mbs = plan.microbatches
    out: dict[int, int] = {}
    for mb in mbs:
        if mb.pieces or mb.producer is not None:
            root = mb.id
            seen = 0
            while mbs[root].producer is not None and seen <= len(mbs):
                root = mbs[root].producer
                seen += 1
            out[mb.id] = root
    return out


def validate_expanded_chains(plan: Any, forest: RolloutForest, chain_of: dict[int, int], bad) -> None:
    """Expanded mode: each chain computes pieces of one trajectory's path (its own copy)
    and owns that trajectory and nothing else."""
    mbs = plan.microbatches
    owned: dict[int, list[int]] = defaultdict(list)
    for m, root in chain_of.items():
        if not mbs[m].pieces:
            bad(f"microbatch {m}: a chain piece of an expanded plan computes no rows")
        owned[root].extend(mbs[m].trajectories)
    node_of_path: dict[int, set[int]] = {}
    for root, ts in owned.items():
        if len(ts) != 1:
            bad(f"microbatch {root}: a chain of an expanded plan owns {len(ts)} trajectories, not one")
        t = ts[0]
        path: set[int] = set()
        v = int(forest.traj_node[t])
        while v >= 0:
            path.add(v)
            v = int(forest.node_parent[v])
        node_of_path[root] = path
    for m, root in chain_of.items():
        for v, _, _ in mbs[m].pieces:
            if v not in node_of_path[root]:
                bad(f"microbatch {m}: chain piece of node {v} is not on its trajectory's path")


def check_costs(plan: Any, forest: RolloutForest, cost_model: Any, bad) -> None:
    start = forest.node_start
    for mb in plan.microbatches:
        if plan.mode.value == "expanded" and not mb.pieces:
            ends = forest.traj_length[list(mb.trajectories)]
            s = np.zeros_like(ends)
        else:
            arr = np.asarray(mb.pieces, dtype=np.int64).reshape(-1, 3)
            s = start[arr[:, 0]] + arr[:, 1]
            ends = start[arr[:, 0]] + arr[:, 2]
        cost = cost_model.microbatch_overhead + float(cost_model.segment_cost(s, ends).sum())
        if not abs(cost - mb.cost) <= 1e-9 * max(1.0, abs(cost)):
            bad(f"microbatch {mb.id}: cost {mb.cost!r} != {cost!r} under {cost_model.name}")
