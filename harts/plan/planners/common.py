"""Shared machinery of the step planners: a list-based forest index, tree
partitioning into units, microbatch builders and replica/slot placement.

Planners work on whole nodes and node pieces, never on tokens, so a 64-GPU step (hundreds
of nodes, tens of millions of expanded tokens) plans in milliseconds. Hot loops run over
Python lists built once per forest (`ForestIndex`), which beats numpy at these sizes.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from harts.config.costs import LoadModel
from harts.config.plan import PlanConfig  # noqa: F401  (planner modules import it from here)
from harts.plan.plan import (
    Microbatch,
    Piece,
    Plan,
    PlanMode,
    forest_digest,
)
from harts.tree.forest import RolloutForest


class ForestIndex:
    """Per-node lists and per-subtree aggregates of a forest under a cost model."""

    def __init__(self, forest: RolloutForest, cost: LoadModel):
        self.forest = forest
        self.cost_model = cost
        self.n = forest.num_nodes
        self.parent: list[int] = forest.node_parent.tolist()
        self.start: list[int] = forest.node_start.tolist()
        self.end: list[int] = forest.node_end.tolist()
        self.length: list[int] = forest.node_length.tolist()
        self.sub_end: list[int] = forest.node_subtree_end.tolist()
        rs = forest.node_row_start
        self.sub_rows: list[int] = (rs[forest.node_subtree_end + 1] - rs[:-1]).tolist()
        node_cost = cost.segment_cost(forest.node_start, forest.node_end)
        self.node_cost: list[float] = node_cost.tolist()
        csum = np.concatenate(([0.0], np.cumsum(node_cost)))
        self.sub_cost: list[float] = (csum[forest.node_subtree_end + 1] - csum[:-1]).tolist()
        # cost of the rows above a node (depths [0, start)): the path it hangs from
        self.above_cost: list[float] = cost.segment_cost(
            np.zeros(self.n), forest.node_start
        ).tolist()
        self.children: list[list[int]] = [c.tolist() for c in forest.node_children]
        self.roots: list[int] = forest.roots.tolist()
        self.traj_node: list[int] = forest.traj_node.tolist()
        self.traj_length: list[int] = forest.traj_length.tolist()
        order = np.argsort(forest.traj_node, kind="stable")
        self._traj_sorted = order
        self._traj_sorted_node = forest.traj_node[order]
        ends_here: list[list[int]] = [[] for _ in range(self.n)]
        for t, v in enumerate(self.traj_node):
            ends_here[v].append(t)
        self.ends_here = ends_here

    def trajs_in_subtree(self, v: int) -> list[int]:
        lo, hi = np.searchsorted(self._traj_sorted_node, [v, self.sub_end[v] + 1])
        return self._traj_sorted[lo:hi].tolist()

    @cached_property
    def sub_expanded(self) -> list[int]:
        """Expanded tokens of the trajectories ending in each subtree."""
        exp = np.zeros(self.n + 1, dtype=np.int64)
        np.add.at(exp, np.asarray(self.traj_node, dtype=np.int64) + 1, self.traj_length)
        csum = np.cumsum(exp)
        sub_end = np.asarray(self.sub_end, dtype=np.int64)
        return (csum[sub_end + 1] - csum[np.arange(self.n)]).tolist()

    def path(self, v: int) -> list[int]:
        """Nodes from the root down to v (inclusive)."""
        out = []
        while v >= 0:
            out.append(v)
            v = self.parent[v]
        return out[::-1]

    def segment_cost(self, s: int, e: int) -> float:
        return float(self.cost_model.segment_cost(np.array([s]), np.array([e]))[0])

    def check_fits(self, budget: int) -> None:
        longest = int(np.argmax(self.traj_length)) if self.traj_length else 0
        if self.traj_length and self.traj_length[longest] > budget:
            raise ValueError(
                f"trajectory {self.forest.traj_ids[longest]!r} has {self.traj_length[longest]} "
                f"tokens, more than the microbatch budget {budget}: raise --microbatch-tokens"
            )


# ---- tree partitioning into units ---------------------------------------------------------


@dataclass
class Unit:
    """Whole subtrees hanging from a path: `path` (root .. split node, empty for a whole
    tree) is recomputed by every unit that carries it; `subtrees` are computed in full."""

    tree: int
    path: tuple[int, ...]
    subtrees: tuple[int, ...]
    trajs: list[int]
    tokens: int
    cost: float
    path_tokens: int
    path_cost: float

    def nodes(self, idx: ForestIndex) -> list[int]:
        out = list(self.path)
        for r in self.subtrees:
            out.extend(range(r, idx.sub_end[r] + 1))
        return out


def _ffd_groups(items: list[int], size: list[int], cap: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for it in sorted(items, key=lambda c: -size[c]):
        for b, r in enumerate(room):
            if size[it] <= r:
                bins[b].append(it)
                room[b] -= size[it]
                break
        else:
            bins.append([it])
            room.append(cap - size[it])
    return bins


def tree_units(idx: ForestIndex, budget: int) -> list[Unit]:
    """Tree Training's partitioning: a tree that fits the budget is one unit; a larger one
    is split at the highest node whose child subtrees fit beside its path, siblings packed
    together first-fit-decreasing (they share the path) and oversized children split the
    same way. Trajectories ending on a split node ride with the smallest unit below it."""
    units: list[Unit] = []

    def make(tree: int, path: tuple[int, ...], subs: tuple[int, ...], extra: list[int]) -> Unit:
        pt = idx.start[subs[0]] if subs else 0
        pc = idx.above_cost[subs[0]] if subs else 0.0
        trajs = list(extra)
        for s in subs:
            trajs.extend(idx.trajs_in_subtree(s))
        return Unit(
            tree=tree,
            path=path,
            subtrees=subs,
            trajs=trajs,
            tokens=pt + sum(idx.sub_rows[s] for s in subs),
            cost=pc + sum(idx.sub_cost[s] for s in subs),
            path_tokens=pt,
            path_cost=pc,
        )

    def split(tree: int, v: int, path: tuple[int, ...]) -> list[Unit]:
        if idx.start[v] + idx.sub_rows[v] <= budget:
            return [make(tree, path, (v,), [])]
        path = path + (v,)
        cap = budget - idx.end[v]
        kids = idx.children[v]
        fit = [c for c in kids if idx.sub_rows[c] <= cap]
        out = [make(tree, path, tuple(g), []) for g in _ffd_groups(fit, idx.sub_rows, cap)]
        for c in kids:
            if idx.sub_rows[c] > cap:
                out.extend(split(tree, c, path))
        here = idx.ends_here[v]
        if here:
            if not out:
                raise ValueError(f"node {v} ends trajectories longer than the budget {budget}")
            smallest = min(out, key=lambda u: u.tokens)
            smallest.trajs.extend(here)
        return out

    for r in idx.roots:
        units.extend(split(r, r, ()))
    return units


# ---- microbatch building --------------------------------------------------------------------


class TreeMB:
    """A tree-mode microbatch under construction: computed intervals per node, owned
    trajectories, producer link and context."""

    __slots__ = ("rows", "trajs", "producer", "context", "replica", "slot", "order", "tokens", "cost")

    def __init__(self) -> None:
        self.rows: dict[int, tuple[int, int]] = {}
        self.trajs: list[int] = []
        self.producer: int | None = None
        self.context: dict[int, tuple[int, int]] = {}
        self.replica = 0
        self.slot = 0
        self.order = 0
        self.tokens = 0
        self.cost = 0.0

    def add_node(self, idx: ForestIndex, v: int) -> None:
        if v not in self.rows:
            self.rows[v] = (0, idx.length[v])
            self.tokens += idx.length[v]
            self.cost += idx.node_cost[v]

    def add_unit(self, idx: ForestIndex, u: Unit) -> None:
        for v in u.path:
            self.add_node(idx, v)
        for s in u.subtrees:
            for v in range(s, idx.sub_end[s] + 1):
                self.rows[v] = (0, idx.length[v])
            self.tokens += idx.sub_rows[s]
            self.cost += idx.sub_cost[s]
        self.trajs.extend(u.trajs)

    def union_tokens(self, idx: ForestIndex, u: Unit) -> int:
        """Rows this microbatch would compute after adding unit u."""
        shared = sum(idx.length[v] for v in u.path if v in self.rows)
        return self.tokens + u.tokens - shared


def finalize_tree(
    idx: ForestIndex,
    mbs: list[TreeMB],
    config: PlanConfig,
    planner: str,
    info: dict | None = None,
) -> Plan:
    """Freeze builders into a Plan: pieces in preorder, exact costs, ids by (replica, order)."""
    cm = config.cost_model
    start = idx.forest.node_start
    ranked = sorted(range(len(mbs)), key=lambda i: (mbs[i].replica, mbs[i].order))
    new_id = {old: new for new, old in enumerate(ranked)}
    out = []
    for old in ranked:
        b = mbs[old]
        pieces = tuple(Piece(v, a, e) for v, (a, e) in sorted(b.rows.items()))
        ctx = tuple(Piece(v, a, e) for v, (a, e) in sorted(b.context.items()))
        arr = np.asarray(pieces, dtype=np.int64).reshape(-1, 3)
        s = start[arr[:, 0]] + arr[:, 1]
        e = start[arr[:, 0]] + arr[:, 2]
        cost = cm.microbatch_overhead + float(cm.segment_cost(s, e).sum())
        out.append(
            Microbatch(
                id=new_id[old],
                replica=b.replica,
                slot=b.slot,
                order=b.order,
                trajectories=tuple(sorted(b.trajs)),
                pieces=pieces,
                context=ctx,
                producer=None if b.producer is None else new_id[b.producer],
                executed_tokens=int((arr[:, 2] - arr[:, 1]).sum()),
                expanded_tokens=sum(idx.traj_length[t] for t in b.trajs),
                cost=cost,
            )
        )
    return Plan(
        mode=PlanMode.TREE,
        planner=planner,
        dp=config.dp,
        microbatch_tokens=config.microbatch_tokens,
        microbatches=tuple(out),
        producer_retention=config.producer_retention,
        chain_retention=config.chain_retention,
        cost_model=cm.spec(),
        seed=config.seed,
        forest=forest_digest(idx.forest),
        info=info or {},
    )


def ffd_units(idx: ForestIndex, units: list[Unit], budget: int) -> list[int]:
    """Bin of each unit under first-fit-decreasing by tokens (shared paths counted once)."""
    bins: list[TreeMB] = []
    where = [0] * len(units)
    for i in sorted(range(len(units)), key=lambda i: (-units[i].tokens, i)):
        u = units[i]
        b = next((j for j, mb in enumerate(bins) if mb.union_tokens(idx, u) <= budget), len(bins))
        if b == len(bins):
            bins.append(TreeMB())
        bins[b].add_unit(idx, u)
        where[i] = b
    return where


# ---- placement ------------------------------------------------------------------------------


def floored_load(mbs: Sequence[Microbatch | TreeMB], config: PlanConfig) -> float:
    """The largest replica's sum of max(load, floor) over its microbatches: a
    microbatch's load (overhead + cost, + `config.consumer_row_cost` x its producer's rows
    for a window consumer) or `config.microbatch_floor` (+ `consumer_floor` for a
    consumer), whichever is larger. Producers are named by position (a finished plan's
    ids)."""
    per: dict[int, float] = {}
    for m, load in zip(mbs, floored_loads(mbs, config), strict=True):
        per[m.replica] = per.get(m.replica, 0.0) + load
    return max(per.values(), default=0.0)


def floored_loads(mbs: Sequence[Microbatch | TreeMB], config: PlanConfig) -> list[float]:
    """Each microbatch's max(load, floor), as `floored_load` sums them."""
    over = config.cost_model.microbatch_overhead
    rows = [m.executed_tokens if isinstance(m, Microbatch) else m.tokens for m in mbs]
    out = []
    for m in mbs:
        floor, load = config.microbatch_floor, over + m.cost
        if m.producer is not None:
            floor += config.consumer_floor
            load += config.consumer_row_cost * rows[m.producer]
        out.append(max(load, floor))
    return out


def pipelined_critical_path(loads: list[list[float]], pp: int, ends: list[float] | None = None) -> float:
    """Estimated step time of slot-aligned loads (`loads[replica][slot]`, the forward +
    backward of a slot's work over all stages) run as a `pp`-stage 1F1B pipeline: every
    stage does 1/pp of each slot's work, the slots back to back (sum over slots of the
    slowest replica), plus the fill and drain: the forward of a replica's first pass and
    the backward of its last run alone on one stage after another, idling the others for
    (pp - 1)/pp of that work (`ends[replica]`, the slowest replica's counts). For uniform
    loads l over m slots this is the textbook (m + pp - 1) l / pp; with pp = 1 it is the
    plain critical path sum_s max_r load(s, r) and `ends` is not read."""
    crit = sum(max(col) for col in zip(*loads, strict=True))
    if pp <= 1:
        return crit
    if ends is None:
        raise ValueError("a pipelined critical path needs each replica's fill and drain work (ends)")
    return (crit + (pp - 1) * max(ends, default=0.0)) / pp


def pipeline_ends(loads: list[float], forward_fraction: float) -> float:
    """Fill + drain work of one replica's standalone microbatches in execution order (see
    `pipelined_critical_path`): the forward share of the first, the backward share of the
    last."""
    run = [x for x in loads if x > 0]
    if not run:
        return 0.0
    return forward_fraction * run[0] + (1.0 - forward_fraction) * run[-1]


def place_sorted(costs: list[float], dp: int) -> list[tuple[int, int]]:
    """(replica, slot) per microbatch: sorted by cost, dp consecutive microbatches form a
    slot (so a slot holds similar loads), and inside a slot the largest goes to the
    replica with the smallest running total (so step totals stay even)."""
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    totals = [0.0] * dp
    out: list[tuple[int, int]] = [(0, 0)] * len(costs)
    for s in range(math.ceil(len(order) / dp)):
        group = order[s * dp : (s + 1) * dp]
        free = sorted(range(dp), key=lambda r: (totals[r], r))
        for i, r in zip(group, free, strict=False):
            out[i] = (r, s)
            totals[r] += costs[i]
    return out


def lpt_balanced(
    items: list[int],
    cost: list[float],
    size: list[int],
    num_bins: int,
    cap: int,
) -> list[list[int]] | None:
    """Largest cost first into the least-loaded bin with room (a heap of loads); None
    when an item fits nowhere."""
    heap = [(0.0, b) for b in range(num_bins)]
    room = [cap] * num_bins
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for it in sorted(items, key=lambda i: (-cost[i], i)):
        skipped = []
        while heap:
            load, b = heapq.heappop(heap)
            if size[it] <= room[b]:
                bins[b].append(it)
                room[b] -= size[it]
                heapq.heappush(heap, (load + cost[it], b))
                break
            skipped.append((load, b))
        else:
            return None
        for x in skipped:
            heapq.heappush(heap, x)
    return bins


def first_fit_decreasing(items: list[int], size: list[int], cap: int) -> list[list[int]]:
    """Classic FFD (largest first into the lowest-numbered bin with room), O(n log bins)
    through a max-tree over the bins' free room."""
    n = max(1, len(items))
    width = 1
    while width < n:
        width *= 2
    tree = [-1] * (2 * width)  # max free room per subtree; -1 = bin not opened
    bins: list[list[int]] = []
    for it in sorted(items, key=lambda i: (-size[i], i)):
        need = size[it]
        if tree[1] >= need:
            k = 1
            while k < width:
                k = 2 * k if tree[2 * k] >= need else 2 * k + 1
            b = k - width
        else:
            b = len(bins)
            bins.append([])
            k = b + width
            tree[k] = cap
        bins[b].append(it)
        tree[k] -= need
        k //= 2
        while k:
            tree[k] = max(tree[2 * k], tree[2 * k + 1])
            k //= 2
    return bins


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def sub_forest(forest: RolloutForest, roots: list[int], trajs: list[int] | None = None, prune: bool = False
               ) -> tuple[RolloutForest, np.ndarray, np.ndarray]:
    """The forest of the trees at `roots` (structure only), with its node and trajectory
    ids mapped back: (sub-forest, original node id per node, original trajectory id per
    trajectory). `trajs`: keep only these trajectories (all nodes of the trees stay; with
    `prune`, only the nodes on their root paths)."""
    sub_end = forest.node_subtree_end
    keep = np.concatenate([np.arange(r, int(sub_end[r]) + 1) for r in roots]) if roots else np.zeros(0, np.int64)
    if prune and trajs is not None:
        on_path = np.zeros(forest.num_nodes, bool)
        parent = forest.node_parent
        for t in trajs:
            v = int(forest.traj_node[t])
            while v >= 0 and not on_path[v]:
                on_path[v] = True
                v = int(parent[v])
        keep = keep[on_path[keep]]
    new_id = np.full(forest.num_nodes, -1, np.int64)
    new_id[keep] = np.arange(keep.size)
    parent = forest.node_parent[keep]
    parent = np.where(parent >= 0, new_id[np.maximum(parent, 0)], -1)
    in_trees = new_id[forest.traj_node] >= 0
    if trajs is not None:
        mask = np.zeros(forest.num_trajectories, bool)
        mask[np.asarray(trajs, np.int64)] = True
        in_trees &= mask
    tmap = np.flatnonzero(in_trees)
    sub = RolloutForest(
        node_parent=parent.astype(np.int64),
        node_start=forest.node_start[keep],
        node_end=forest.node_end[keep],
        node_group=forest.node_group[keep],
        groups=forest.groups,
        traj_ids=tuple(forest.traj_ids[t] for t in tmap.tolist()),
        traj_node=new_id[forest.traj_node[tmap]],
    )
    return sub, keep, tmap


def step_load(plan: Plan, config: PlanConfig) -> float:
    """A finished plan's step in the planners' load units: without a pipeline the
    heaviest replica's `floored_load` (its loads summed, each at least its microbatch
    floor), or with expert parallelism (`config.ep` > 1) the heaviest EP group's
    `lockstep_load`; with a pipeline the pipelined critical path of its slot loads."""
    if config.pp <= 1:
        if config.ep > 1:
            return lockstep_load(plan, config)
        return floored_load(plan.microbatches, config)
    from harts.plan.metrics import slot_loads

    loads = slot_loads(plan).T.tolist()
    ff = config.cost_model.forward_fraction
    ends = [pipeline_ends(row, ff) for row in loads]
    return pipelined_critical_path(loads, config.pp, ends)


def lockstep_load(plan: Plan, config: PlanConfig) -> float:
    """The heaviest EP group's step in load units: its joint events (`harts.plan.lockstep`,
    as the executor and the simulator run them), each its kind's share (forward
    `forward_fraction`, backward the rest, forward-backward all) of its longest pass; a
    pass is a microbatch's floored load (`floored_loads`), a shadow's the microbatch
    floor."""
    from harts.plan.lockstep import joint_events

    mbs = plan.microbatches
    load = dict(zip((m.id for m in mbs), floored_loads(mbs, config), strict=True))
    ff = config.cost_model.forward_fraction
    share = {"F": ff, "B": 1.0 - ff, "FB": 1.0}
    worst = 0.0
    for first in range(0, plan.dp, config.ep):
        group = range(first, min(first + config.ep, plan.dp))
        if not any(m.replica in group for m in mbs):
            continue
        total = 0.0
        for e in joint_events(mbs, group):
            passes = [load[i] for i in e.members.values()]
            if len(e.members) < len(group):
                passes.append(config.microbatch_floor)
            total += share[e.kind] * max(passes)
        worst = max(worst, total)
    return worst
