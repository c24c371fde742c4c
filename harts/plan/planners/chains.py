"""Chains of sharing windows: trajectories longer than the microbatch budget.

A tree with a root-to-leaf path longer than the budget cannot be one microbatch, nor be
split at forks alone. Every planner hands such trees here (`plan_with_chains`, called by
`make_plan` for every registered planner), and a tree-mode planner also the trees it names
as ones it cannot lay out without recomputing rows (l1l2: a tree over the budget whose
one-window cell does not solve, say a long trunk whose branches do not fit beside the
trunk's retained rows): the planner plans the other trees as it always does (on a
sub-forest of them), and each of these becomes a *window tree* of microbatches along its
paths, appended to the least-loaded replica after the planner's slots.

The window tree (`chain_windows`), built top-down from a *stem* (node v from offset o,
with its subtree) and the microbatch above it:

- a stem whose rows fit the room left beside its producer's retained rows
  (`microbatch_tokens - producer_retention x producer rows`) is one microbatch that
  computes all of it and owns every trajectory ending in it;
- a stem whose node alone has more rows than a piece (`piece_tokens`) is cut inside the
  node: a microbatch computes the node's rows up to the last multiple of the KDA chunk
  size within a piece, and is the producer of the stem that starts there. A chain piece
  therefore starts on the trajectory's chunk grid (no replay) and hands its consumer the
  boundary state at the cut;
- otherwise (a fork within a piece) a microbatch computes the node's remaining rows and,
  largest first, whole child subtrees while it stays within a piece; the other children
  become its consumers: those that fit beside it grouped first-fit-decreasing, the rest
  stems of their own. A child starting mid-chunk replays from its aligned start (the
  producer hands the state there and the replayed rows' inputs, `harts.exec.stash`).
  `chain_windows` also builds the variant in which such a microbatch goes on into its
  largest remaining child up to the piece's last chunk boundary (that child's rest a stem
  of its own; its siblings then read a larger producer), and the variant in which it goes
  on *through* that child, and the next, wherever a child's own rows fit the piece (a
  trunk with forks a few rows apart: the other children of every fork it passes are its
  consumers, a leaf holding branches of several forks reading the longest root path
  among them); `fewest_windows` keeps the build with fewest microbatches, and the plan
  goes back to pieces ending at forks where, its leaves filled, the variant's plan is no
  shorter and no lighter.

Every microbatch reads its whole root path above its rows as context through its
producer, which computed those rows or read them itself (a consumer has exactly one
producer; the executor reads each row from the stash of the producer up the chain that
computed it, `harts.exec.stash.ChainStash`). `piece_tokens` is the largest multiple of
the chunk size C with piece x (1 + producer_retention) <= budget, so a piece's consumer,
itself a piece, fits beside it; a budget below two chunks is refused.

Expanded plans (`expanded-ffd`) chain each long trajectory's own copy along its path
(`path_chain`): the baseline splits long sequences at the same budget.

Execution order is the window tree's depth-first order: a producer, then each consumer
with its own window, so windows nest and never cross; a producer's backward runs after
its last consumer's window closed (`harts.exec.layouts.plan`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from harts.config.plan import PlanConfig
from harts.plan.memory import chain_charge
from harts.plan.plan import Microbatch, Piece, Plan, PlanMode, forest_digest
from harts.plan.planners.common import (
    ForestIndex,
    TreeMB,
    first_fit_decreasing,
    step_load,
    sub_forest,
)
from harts.plan.planners.leaves import fill_leaves, sink_leaves, sinks
from harts.tree.forest import RolloutForest

__all__ = ["chain_windows", "fewest_windows", "heavy_trees", "long_roots", "path_chain", "piece_tokens",
           "plan_with_chains", "step_load", "sub_forest"]


def piece_tokens(config: PlanConfig) -> int:
    """Rows of a chain piece: the largest multiple of the chunk size C with
    piece x (1 + producer_retention) <= budget (a piece beside its producer piece fits)."""
    B, C, rho = config.microbatch_tokens, config.chunk_size, config.producer_retention
    if B < 2 * C:
        raise ValueError(f"microbatch budget {B} is below two KDA chunks (2 x {C}): a trajectory longer than "
                         f"the budget is cut into chunk-aligned pieces; raise --microbatch-tokens to >= {2 * C}")
    piece = int(B // (1.0 + rho)) // C * C
    if piece < C or C + rho * C > B:
        raise ValueError(f"microbatch budget {B} cannot hold a {C}-row chain piece beside its producer's "
                         f"(producer retention {rho}): raise --microbatch-tokens")
    return piece


class _Stalled(Exception):
    """A chain charge left a piece less than a chunk beside its producer."""


def long_roots(idx: ForestIndex, budget: int) -> list[int]:
    """Roots of the trees with a trajectory longer than the budget."""
    roots = set()
    for t, n in enumerate(idx.traj_length):
        if n > budget:
            v = idx.traj_node[t]
            while idx.parent[v] >= 0:
                v = idx.parent[v]
            roots.add(v)
    return sorted(roots)


class _Builder:
    """The window tree of one long tree (or, `path`, of one trajectory's copy)."""

    def __init__(self, idx: ForestIndex, config: PlanConfig, path: list[int] | None = None, go_on: bool = False,
                 through: bool = False):
        self.idx = idx
        # at a fork whose children do not all fit, the piece goes on into its largest child
        # (cut on the chunk grid) instead of ending at the fork (`chain_windows`); `through`:
        # on through that child's forks too where its own rows fit
        self.go_on = go_on and path is None
        self.through = through
        self.B = config.microbatch_tokens
        self.C = config.chunk_size
        self.rho = config.producer_retention
        self.cr = config.chain_retention
        self.P = piece_tokens(config)
        self.path = path  # nodes of one trajectory's path (expanded copies), else None
        self.out: list[TreeMB] = []
        self.producer_of: list[int | None] = []

    def _new(self, producer: int | None, v: int, o: int) -> int:
        mb = TreeMB()
        idx = self.idx
        u, first = v, True
        while u >= 0:  # the root path above the stem is context
            if first:
                if o > 0:
                    mb.context[u] = (0, o)
                first = False
            else:
                mb.context[u] = (0, idx.length[u])
            u = idx.parent[u]
        mb.producer = producer
        self.out.append(mb)
        self.producer_of.append(producer)
        return len(self.out) - 1

    def _rows_below(self, v: int, o: int) -> int:
        """Rows of the stem (v, o): its subtree's, or along the path."""
        idx = self.idx
        if self.path is None:
            return idx.sub_rows[v] - o
        return idx.end[self.path[-1]] - idx.start[v] - o

    def _kids(self, v: int) -> list[int]:
        if self.path is None:
            return list(self.idx.children[v])
        k = self.path.index(v)
        return [self.path[k + 1]] if k + 1 < len(self.path) else []

    def _take_subtree(self, m: int, v: int, o: int) -> None:
        """Microbatch m computes the stem (v, o) whole and owns what ends in it."""
        idx, mb = self.idx, self.out[m]
        if self.path is None:
            mb.rows[v] = (o, idx.length[v])
            mb.tokens += idx.length[v] - o
            for w in range(v + 1, idx.sub_end[v] + 1):
                mb.rows[w] = (0, idx.length[w])
                mb.tokens += idx.length[w]
            mb.trajs.extend(idx.trajs_in_subtree(v))
        else:
            k = self.path.index(v)
            for j, w in enumerate(self.path[k:]):
                a = o if j == 0 else 0
                mb.rows[w] = (a, idx.length[w])
                mb.tokens += idx.length[w] - a

    def _room(self, d0: int, o: int, held: int) -> float:
        """Rows a stem starting at depth d0 (offset o in its node) may hold beside its
        producer's `held` rows: the budget less the memory rule's charge
        (`harts.plan.memory`), the chain charge for a piece cut inside a node."""
        charge = self.rho * held
        if self.cr is not None and o > 0:
            charge = chain_charge(charge, self.cr, d0)
        return self.B - charge

    def build(self, v: int, o: int, producer: int | None, held: int) -> None:
        idx = self.idx
        d0 = idx.start[v] + o
        room = self._room(d0, o, held)
        if self._rows_below(v, o) <= room:
            self._take_subtree(self._new(producer, v, o), v, o)
            return
        m = self._new(producer, v, o)
        mb = self.out[m]
        # a piece's rows: P beside a producer piece of at most P rows; with a chain
        # retention, what the memory rule leaves beside this one's producer
        piece = self.P if self.cr is None else int(room)
        cut = (d0 + piece) // self.C * self.C
        if cut <= d0:
            raise _Stalled(d0)
        if cut < idx.end[v]:  # a chain piece inside the node
            mb.rows[v] = (o, cut - idx.start[v])
            mb.tokens = cut - d0
            self.build(v, cut - idx.start[v], m, mb.tokens)
            return
        mb.rows[v] = (o, idx.length[v])
        mb.tokens = idx.end[v] - d0
        if self.path is None:
            mb.trajs.extend(idx.ends_here[v])
        kids = self._kids(v)
        if self.path is None:  # whole child subtrees join the producer while it stays a piece
            rest = []
            for c in sorted(kids, key=lambda c: (-idx.sub_rows[c], c)):
                if mb.tokens + idx.sub_rows[c] <= piece:
                    self._take_subtree(m, c, 0)
                else:
                    rest.append(c)
            kids = sorted(rest)
        go_on = None
        side: list[int] = []  # children of the nodes the piece went on through: its consumers too
        while self.go_on and kids:
            c = max(kids, key=lambda c: (idx.sub_rows[c], -c))
            cut = (idx.start[c] + piece - mb.tokens) // self.C * self.C
            if cut >= idx.end[c] and self.through:  # the child's own rows fit: through it, on to its children
                mb.rows[c] = (0, idx.length[c])
                mb.tokens += idx.length[c]
                mb.trajs.extend(idx.ends_here[c])
                side += [k for k in kids if k != c]
                kids = []
                for k in sorted(self._kids(c), key=lambda k: (-idx.sub_rows[k], k)):
                    if mb.tokens + idx.sub_rows[k] <= piece:
                        self._take_subtree(m, k, 0)
                    else:
                        kids.append(k)
                continue
            if idx.start[c] < cut < idx.end[c]:
                mb.rows[c] = (0, cut - idx.start[c])
                mb.tokens += cut - idx.start[c]
                kids = [k for k in kids if k != c]
                go_on = (c, cut - idx.start[c])
            break
        kids = sorted(side + kids)
        leaf_room = self.B - self.rho * mb.tokens
        fits = [c for c in kids if self._rows_below(c, 0) <= leaf_room]
        size = {c: self._rows_below(c, 0) for c in kids}
        for group in first_fit_decreasing(fits, size, int(leaf_room)) if fits else []:
            g = sorted(group)
            leaf = self._new(m, g[0], 0)
            for c in g[1:]:  # siblings from forks further down read the longer root path
                u = idx.parent[c]
                while u >= 0:
                    self.out[leaf].context[u] = (0, idx.length[u])
                    u = idx.parent[u]
            for c in g:
                self._take_subtree(leaf, c, 0)
        for c in kids:
            if c not in fits:
                self.build(c, 0, m, mb.tokens)
        if go_on is not None:
            self.build(go_on[0], go_on[1], m, mb.tokens)


def chain_windows(idx: ForestIndex, root: int, config: PlanConfig, go_on: bool = False, through: bool = False
                  ) -> tuple[list[TreeMB], list[int | None]]:
    """The window tree of the long tree at `root`: its microbatches in execution order
    (depth-first) and each one's producer (an index into that list, None for the first).
    `go_on`: a piece at a fork goes on into its largest remaining child rather than ending
    there; with `through`, on through that child, and the next, while their own rows fit
    the piece, the other children of every fork it passes its consumers (`fewest_windows`
    builds the three ways and keeps the one with fewest microbatches). Leaves move into
    other leaves where `config` lets them (`sink_leaves`)."""
    b = _Builder(idx, config, go_on=go_on, through=through)
    try:
        b.build(root, 0, None, 0)
    except _Stalled:  # a chain charge leaving no chunk beside a producer: the producer charge alone
        return chain_windows(idx, root, dataclasses.replace(config, chain_retention=None), go_on, through)
    return sink_leaves(b.out, b.producer_of, config)


def fewest_windows(idx: ForestIndex, root: int, config: PlanConfig, plain: tuple | None = None
                   ) -> tuple[list[TreeMB], list[int | None]]:
    """`chain_windows`'s build of the tree at `root` with the fewest microbatches: pieces
    ending at forks (`plain`, where already built), going on into one child, or going on
    through forks (ties: the first)."""
    builds = [plain or chain_windows(idx, root, config), chain_windows(idx, root, config, go_on=True),
              chain_windows(idx, root, config, go_on=True, through=True)]
    return min(builds, key=lambda b: len(b[0]))


def path_chain(idx: ForestIndex, traj: int, config: PlanConfig) -> tuple[list[TreeMB], list[int | None]]:
    """The chain of windows along one trajectory's path, its own copy (expanded plans);
    the last microbatch owns the trajectory."""
    path = idx.path(idx.traj_node[traj])
    b = _Builder(idx, config, path=path)
    L = idx.traj_length[traj]
    d, held, producer = 0, 0, None
    while True:
        v = next(u for u in path if idx.start[u] <= d < idx.end[u])
        room = b._room(d, d - idx.start[v], held)
        last = L - d <= room
        cut = L if last else (d + (b.P if b.cr is None else int(room))) // b.C * b.C
        if cut <= d:
            return path_chain(idx, traj, dataclasses.replace(config, chain_retention=None))
        m = b._new(producer, v, d - idx.start[v])
        mb = b.out[m]
        for u in path:
            lo, hi = max(d, idx.start[u]), min(cut, idx.end[u])
            if lo < hi:
                mb.rows[u] = (lo - idx.start[u], hi - idx.start[u])
        mb.tokens = cut - d
        if last:
            mb.trajs.append(traj)
            return b.out, b.producer_of
        d, held, producer = cut, cut - d, m


def _map_back(plan: Plan, nodes: np.ndarray, trajs: np.ndarray) -> list[Microbatch]:
    nm, tm = nodes.tolist(), trajs.tolist()
    return [dataclasses.replace(
        m, trajectories=tuple(sorted(tm[t] for t in m.trajectories)),
        pieces=tuple(Piece(nm[v], a, b) for v, a, b in m.pieces),
        context=tuple(Piece(nm[v], a, b) for v, a, b in m.context)) for m in plan.microbatches]


def plan_with_chains(forest: RolloutForest, config: PlanConfig, fn: Callable[[RolloutForest, PlanConfig], Plan],
                     name: str, nest: Callable[[RolloutForest, PlanConfig], list[int]] | None = None) -> Plan:
    """`fn`'s plan where every trajectory fits the budget and `nest` (a tree-mode planner's)
    names no tree; otherwise `fn` plans the rest (trees without a long trajectory and not
    named by `nest`; for an expanded-mode planner, the trajectories that fit) on a
    sub-forest, and the long and named trees are chained (module docstring). With dp > 1
    a tree-mode plan also competes, by step load, with one in which every tree holding
    more than a replica's share of the rows is a window tree that may be split over the
    replicas (`harts.plan.planners.tree_split`). With `config.chain_retention` set, the
    plan with chain pieces sized by their context competes with the plan under the
    producer charge alone (fewer microbatches, then the lighter `step_load`): pieces
    filled from the first leave a short last piece, a microbatch the host issues whole."""
    plan = _with_chains(forest, config, fn, name, nest)
    if config.chain_retention is None or not plan.info.get("chains") and not plan.info.get("nested_trees"):
        return plan
    alt = _with_chains(forest, dataclasses.replace(config, chain_retention=None), fn, name, nest)
    if (alt.num_microbatches, step_load(alt, config)) < (plan.num_microbatches, step_load(plan, config) * (1 - 1e-9)):
        return alt
    return plan


def _with_chains(forest: RolloutForest, config: PlanConfig, fn: Callable[[RolloutForest, PlanConfig], Plan],
                 name: str, nest: Callable[[RolloutForest, PlanConfig], list[int]] | None) -> Plan:
    plan = _chained(forest, config, fn, name, nest, [])
    if name == "expanded-ffd" or config.dp < 2 or not config.split_trees or not forest.num_trajectories:
        return plan
    heavy = heavy_trees(forest, config.dp)
    if int(forest.traj_length.max()) > config.microbatch_tokens:  # long trees are chained (and split) anyway
        heavy = sorted(set(heavy) - set(long_roots(ForestIndex(forest, config.cost_model), config.microbatch_tokens)))
    if not heavy:
        return plan
    try:
        piece_tokens(config)
    except ValueError:
        return plan
    alt = _chained(forest, config, fn, name, nest, heavy)
    return alt if step_load(alt, config) < step_load(plan, config) * (1 - 1e-9) else plan


def heavy_trees(forest: RolloutForest, dp: int) -> list[int]:
    """Roots of the trees with two or more trajectories and more than 1/dp of the forest's rows."""
    start, end = forest.node_row_start, forest.node_subtree_end
    return [r for r in forest.roots.tolist() if start[end[r] + 1] - start[r] > forest.num_rows / dp
            and forest.node_occurrence[r] >= 2]


def _chained(forest: RolloutForest, config: PlanConfig, fn: Callable[[RolloutForest, PlanConfig], Plan],
             name: str, nest: Callable[[RolloutForest, PlanConfig], list[int]] | None, extra: list[int]) -> Plan:
    """`plan_with_chains` with the trees at `extra` chained (and split where it pays) too."""
    budget = config.microbatch_tokens
    lengths = forest.traj_length
    if lengths.size == 0:
        return fn(forest, config)
    expanded = name == "expanded-ffd"
    has_long = int(lengths.max()) > budget
    nested = [] if expanded or nest is None else nest(forest, config)
    if nested and not has_long:
        try:
            piece_tokens(config)
        except ValueError:
            nested = []  # no chain piece fits this budget: the planner's own plan
    if not has_long and not nested and not extra:
        return fn(forest, config)
    piece_tokens(config)  # refuses a budget below two chunks
    cm = config.cost_model
    idx = ForestIndex(forest, cm)
    long_trajs = np.flatnonzero(lengths > budget).tolist()
    chains: list[tuple[list[TreeMB], list[int | None]]] = []
    if expanded:
        short = np.flatnonzero(lengths <= budget).tolist()
        roots = forest.roots.tolist()
        sub, nodes, tmap = sub_forest(forest, roots, short)
        chains = [path_chain(idx, t, config) for t in long_trajs]
    else:
        long = set(long_roots(idx, budget))
        nested = sorted(set(nested) - long)  # the named trees without a long trajectory
        extra = sorted(set(extra) - long - set(nested))  # heavy trees not chained anyway
        longs = sorted(long | set(nested) | set(extra))
        roots = [r for r in forest.roots.tolist() if r not in set(longs)]
        sub, nodes, tmap = sub_forest(forest, roots)
        plain = [chain_windows(idx, r, config) for r in longs]
        # each window tree as the build with fewest microbatches (ties: pieces end at forks)
        chains = [fewest_windows(idx, r, config, p) for r, p in zip(longs, plain, strict=True)]
        # the same without leaves sunk into later leaves (`sink_leaves`, which moves none
        # without floors, or over replicas or stages)
        sinking = sinks(config)
        unsunk = dataclasses.replace(config, sink_leaves=False)
        plain_kept = [chain_windows(idx, r, unsunk) for r in longs] if sinking else plain
        kept = ([fewest_windows(idx, r, unsunk, p) for r, p in zip(longs, plain_kept, strict=True)]
                if sinking else chains)
    inner: list[Microbatch] = []
    mode = PlanMode.EXPANDED if expanded else PlanMode.TREE
    info: dict = {}
    if tmap.size:
        p = fn(sub, config)
        mode = p.mode
        info = dict(p.info)
        inner = _map_back(p, nodes, tmap)
    def assemble(chains: list[tuple[list[TreeMB], list[int | None]]]) -> Plan:
        dp = config.dp
        start = forest.node_start
        # the window trees go to the replicas largest first, each to the least-loaded one
        load = [0.0] * dp
        count = [0] * dp
        for m in inner:
            load[m.replica] += m.cost
            count[m.replica] += 1
        base_slot = 1 + max((m.slot for m in inner), default=-1)
        next_slot = [base_slot] * dp
        out: list[tuple[int, int, dict]] = []  # (replica, order, fields)
        for m in inner:
            out.append((m.replica, m.order, {"m": m}))
        chain_cost = []
        frozen = []
        for mbs, producer_of in chains:
            fz = []
            for b in mbs:
                pieces = tuple(Piece(v, a, e) for v, (a, e) in sorted(b.rows.items()))
                ctx = tuple(Piece(v, a, e) for v, (a, e) in sorted(b.context.items()))
                arr = np.asarray(pieces, dtype=np.int64).reshape(-1, 3)
                cost = cm.microbatch_overhead + float(cm.segment_cost(start[arr[:, 0]] + arr[:, 1],
                                                                      start[arr[:, 0]] + arr[:, 2]).sum())
                fz.append((pieces, ctx, tuple(sorted(b.trajs)), int((arr[:, 2] - arr[:, 1]).sum()), cost))
            frozen.append((fz, producer_of))
            chain_cost.append(sum(f[4] for f in fz))
        keys: dict[tuple[int, int], tuple[int, int]] = {}  # (chain, index) -> (replica, order)
        for k in sorted(range(len(frozen)), key=lambda k: (-chain_cost[k], k)):
            r = min(range(dp), key=lambda r: (load[r], r))
            load[r] += chain_cost[k]
            fz, producer_of = frozen[k]
            is_producer = {p for p in producer_of if p is not None}
            slot = next_slot[r]
            for i, (pieces, ctx, trajs, tokens, cost) in enumerate(fz):
                keys[(k, i)] = (r, count[r])
                out.append((r, count[r], {"chain": (k, i), "pieces": pieces, "ctx": ctx, "trajs": trajs,
                                          "tokens": tokens, "cost": cost, "slot": slot}))
                count[r] += 1
                if i not in is_producer:
                    slot += 1
            next_slot[r] = slot
        filled = 0
        if mode == PlanMode.TREE:
            out, filled = fill_leaves(out, frozen, config)
        out.sort(key=lambda x: (x[0], x[1]))
        new_id = {(r, o): i for i, (r, o, _) in enumerate(out)}
        old_inner = {m.id: new_id[(m.replica, m.order)] for _, _, f in out if "m" in f for m in [f["m"]]}
        # orders run 0, 1, ... along each replica and slots stay dense where microbatches left
        rank, seen = {}, [0] * dp
        for r, o, _ in out:
            rank[(r, o)] = seen[r]
            seen[r] += 1
        used = sorted({f["m"].slot if "m" in f else f["slot"] for _, _, f in out})
        dense = {s: j for j, s in enumerate(used)}
        mbs_out = []
        for i, (r, o, f) in enumerate(out):
            if "m" in f:
                m = f["m"]
                mbs_out.append(dataclasses.replace(
                    m, id=i, order=rank[(r, o)], slot=dense[m.slot],
                    producer=None if m.producer is None else old_inner[m.producer]))
                continue
            k, j = f["chain"]
            p = frozen[k][1][j]
            mbs_out.append(Microbatch(
                id=i, replica=r, slot=dense[f["slot"]], order=rank[(r, o)], trajectories=f["trajs"], pieces=f["pieces"],
                context=f["ctx"], producer=None if p is None else new_id[keys[(k, p)]],
                executed_tokens=f["tokens"], expanded_tokens=sum(idx.traj_length[t] for t in f["trajs"]),
                cost=f["cost"]))
        return Plan(mode=mode, planner=name, dp=dp, microbatch_tokens=budget, microbatches=tuple(mbs_out),
                    producer_retention=config.producer_retention, chain_retention=config.chain_retention,
                    cost_model=cm.spec(), seed=config.seed,
                    forest=forest_digest(forest),
                    info={**info, "chains": len(chains), "nested_trees": len(nested), "heavy_trees": len(extra),
                          "chain_microbatches": sum(len(c[0]) for c in chains), "filled_leaves": filled,
                          "piece_tokens": piece_tokens(config)})

    def pick(chains: list, plain: list) -> tuple[Plan, list]:
        plan = assemble(chains)
        if any(c is not p for c, p in zip(chains, plain, strict=True)):
            # where short trees filling leaves leave the plan no shorter and no lighter:
            # pieces ending at forks
            alt = assemble(plain)
            if (alt.num_microbatches, step_load(alt, config)) <= (plan.num_microbatches, step_load(plan, config)):
                return alt, plain
        return plan, chains

    plan, chains = pick(chains, chains if expanded else plain)
    if not expanded and sinking:
        # sunk leaves are kept only where the finished plan has fewer microbatches and is
        # lighter (`step_load`, floors included where given): a leaf moved under a later
        # piece reads a longer context, which the memory rule does not charge
        alt, alt_chains = pick(kept, plain_kept)
        if (alt.num_microbatches <= plan.num_microbatches
                or step_load(alt, config) <= step_load(plan, config)):
            plan, chains = alt, alt_chains
        else:
            plan.info["sunk_leaves"] = alt.num_microbatches - plan.num_microbatches
    if not expanded and config.dp > 1 and config.split_trees:
        plan = _split_over_replicas(forest, idx, config, longs, chains, plan, assemble)
    if not has_long:
        # only named (or heavy) trees were nested: the planner's own plan of the whole forest
        # competes, as l1l2's windows compete with L1's recomputation
        own = fn(forest, config)
        priced = {"own": step_load(own, config), "nested": step_load(plan, config)}
        if priced["nested"] >= priced["own"] * (1 - 1e-9):  # ties: the planner's own slots
            return dataclasses.replace(own, info={**own.info, "nested_load": priced})
        plan.info["nested_load"] = priced
    return plan


def _split_over_replicas(forest: RolloutForest, idx: ForestIndex, config: PlanConfig, roots: list[int],
                         chains: list, plan: Plan, assemble: Callable[[list], Plan]) -> Plan:
    """`plan` with the window trees at `roots` (their builds `chains`) split over replicas
    where that lowers the step load (`harts.plan.planners.tree_split`): trees largest
    first, each into the group count (2 .. min(dp, 8), the powers of two up to dp, and
    dp) and grouping whose finished plan is lightest, kept only where it is lighter than
    without (ties: unsplit)."""
    from harts.plan.planners.tree_split import split_window_trees

    dp = config.dp
    counts = sorted({*range(2, min(dp, 8) + 1), *(1 << j for j in range(1, dp.bit_length())), dp})
    entries = [[c] for c in chains]
    best = step_load(plan, config)
    split = []
    for j in sorted(range(len(roots)), key=lambda j: (-idx.sub_rows[roots[j]], j)):
        for k in counts:
            for how in ("contiguous", "fork"):
                parts = split_window_trees(idx, roots[j], k, config, lambda i, r: fewest_windows(i, r, config), how)
                if len(parts) < 2:
                    continue
                trial = entries[:j] + [parts] + entries[j + 1:]
                cand = assemble([c for e in trial for c in e])
                load = step_load(cand, config)
                if load < best * (1 - 1e-9):
                    plan, best, entries = cand, load, trial
        if len(entries[j]) > 1:
            split.append(len(entries[j]))
    if split:
        plan.info["split_trees"] = split
    return plan

