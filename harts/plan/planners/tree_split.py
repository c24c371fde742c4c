"""A window tree split over data-parallel replicas: its trajectories in groups, each group's
paths a window tree of its own on the replica it goes to.

A window tree (`chains.chain_windows`) runs on one replica: its pieces hand each other
their stashes. When one such tree holds more of the step than a replica's share (a long
prompt under a group of long responses, one long agent tree at dp = 2), the other
replicas wait for it. Splitting its trajectories into groups, each group's root paths a
window tree of its own, puts the tree's work on several replicas at the price of
computing the rows the groups share once per group (each copy an independent
computation weighted by its own group's trajectories, as L1's recomputed paths are).
`plan_with_chains` builds the split for 2 .. dp groups and keeps it where the finished
plan's step load (`common.step_load`) is lower.

Groups are drawn two ways (`group_trajectories`): contiguous in the tree's depth-first
order of trajectory ends, so a group's paths share as much as they can, cut where the rows
each group computes (a trajectory's rows beyond its common prefix with the one before it)
are most even; or the subtrees below the tree's first fork dealt largest first to the
lightest group.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from harts.config.plan import PlanConfig
from harts.plan.planners.common import ForestIndex, TreeMB, sub_forest

__all__ = ["group_trajectories", "split_window_trees"]


def _lca_depth(idx: ForestIndex, a: int, b: int) -> int:
    """Rows of the common root path of the trajectories ending at nodes a <= b (preorder)."""
    u = b
    while not (u <= a <= idx.sub_end[u]):
        u = idx.parent[u]
    return int(idx.end[u])


def group_trajectories(idx: ForestIndex, root: int, k: int, how: str = "contiguous") -> list[list[int]]:
    """The trajectories of the tree at `root` in k groups (fewer where it has fewer
    trajectories; empty groups dropped). `contiguous`: contiguous in depth-first order of
    their end nodes, cut where the rows the groups compute are most even. `fork`: the
    subtrees below the tree's first fork (and the trajectories ending above it, each on its
    own), largest first, each to the group that computes the fewest rows so far."""
    trajs = sorted(idx.trajs_in_subtree(root), key=lambda t: (idx.traj_node[t], t))
    if not trajs:
        return []
    k = max(1, min(k, len(trajs)))
    if how == "fork":
        v = root
        while len(idx.children[v]) == 1 and not idx.ends_here[v]:
            v = idx.children[v][0]
        items = [([t], int(idx.traj_length[t]) - int(idx.start[v])) for t in idx.ends_here[v]]
        items += [(idx.trajs_in_subtree(c), int(idx.sub_rows[c])) for c in idx.children[v]]
        groups: list[list[int]] = [[] for _ in range(k)]
        load = [0] * k
        for ts, rows in sorted(items, key=lambda it: (-it[1], it[0])):
            g = min(range(k), key=lambda g: (load[g], g))
            groups[g] += ts
            load[g] += rows
        return [sorted(g) for g in groups if g]
    marginal = [int(idx.traj_length[trajs[0]])]
    for p, t in zip(trajs, trajs[1:], strict=False):
        marginal.append(int(idx.traj_length[t]) - _lca_depth(idx, idx.traj_node[p], idx.traj_node[t]))
    cum = np.cumsum(marginal)
    total = float(cum[-1])
    cuts = [0]
    for j in range(1, k):
        c = int(np.searchsorted(cum, j * total / k, side="left")) + 1
        cuts.append(min(max(c, cuts[-1] + 1), len(trajs) - (k - j)))
    cuts.append(len(trajs))
    return [trajs[a:b] for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def split_window_trees(idx: ForestIndex, root: int, k: int, config: PlanConfig,
                       build: Callable[[ForestIndex, int], tuple[list[TreeMB], list[int | None]]],
                       how: str = "contiguous") -> list[tuple[list[TreeMB], list[int | None]]]:
    """The window trees of the tree at `root` of `idx`'s forest split into k trajectory groups
    (`group_trajectories` with `how`): each group's root paths as a forest of their own,
    built into a window tree by `build(index, root)` (`plan_with_chains` passes
    `chains.fewest_windows`), its microbatches in the
    original forest's node and trajectory ids."""
    out = []
    for group in group_trajectories(idx, root, k, how):
        sub, nodes, tmap = sub_forest(idx.forest, [root], group, prune=True)
        mbs, producer_of = build(ForestIndex(sub, config.cost_model), 0)
        mapped = []
        for b in mbs:
            m = TreeMB()
            m.rows = {int(nodes[v]): r for v, r in b.rows.items()}
            m.context = {int(nodes[v]): r for v, r in b.context.items()}
            m.trajs = [int(tmap[t]) for t in b.trajs]
            m.tokens, m.cost = b.tokens, b.cost
            mapped.append(m)
        out.append((mapped, list(producer_of)))
    return out
