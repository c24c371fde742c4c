"""`l1l2`: HARTS level 1 + level 2, joint refinement of membership, sharing, placement
and order.

Level 1 (`l1`) fixes how many slots a compression-oriented packing needs; level 2
rebuilds the step around *sharing windows* so that no row is computed twice and every
slot carries the same load on every replica.

1. **Cells.** Each replica's S slots are cut into runs of consecutive slots, *cells*
   (m per replica; a tree larger than the budget gets a cell of its own). Whole trees
   are dealt to cells largest-cost-first into the cell least loaded relative to its slot
   count (token room capped near the step's average fill), then the best move or swap
   out of the heaviest cell is applied while it helps. A tree over the budget that runs
   as a *1-slot window* (its producer and its one consumer in the same slot, each within
   the budget, the consumer paying the producer's retention; `_CellSolver.alone`) may
   sit alone in a cell of one slot whatever that cell's token room, so a replica of a
   few such trees needs a slot per tree, not two. A cell that does not solve on all its
   slots (a one-node tree cannot be split over two) runs on as many as solve, the rest
   left empty. A tree never leaves its cell and each cell has at most one producer, so
   every row of the step is computed exactly once: the compression is the forest's own.
2. **Membership inside a cell** (k slots, target L = the cell's load / k). Items are
   subtrees; a tree too large for a microbatch is split (its top node goes to the
   producer, its children become items). k - 2 slots are *covered*: filled just past L
   by the subset of items with the least overshoot within the token room (a min-token
   knapsack over rounded costs), either anchored on the largest item or splitting an
   item at a fork when nothing covers; the two cheapest slots become the window's ends.
3. **Sharing as the balancing lever.** The overshoot of every covered slot is *shaved*:
   a DFS prefix of one of its items, cut on the KDA chunk grid, moves into the producer
   (a DFS prefix is ancestor-closed, so the item's remaining rows read it as context).
   Moved work reappears, split `forward_fraction : 1 - forward_fraction`, in the first
   and last slots, where the producer's forward and backward run; a last shave from one
   end solves the two end equations (their sum is fixed by conservation), so every slot
   of the cell carries L up to one chunk of work.
4. **Budget.** Every microbatch of a window holds its rows plus `producer_retention` x
   the producer's rows, and the producer itself fits the budget. When the full levelling
   does not fit, the largest fraction of it that does is applied (bisection); when even
   the covering does not pack, the cell is packed without levelling (largest cost into
   the least-loaded slot, or first-fit-decreasing by tokens then load-evening moves),
   slots heaviest first. The best feasible of these per cell is kept.
5. **Order.** Per cell: slots that do not read the producer, the producer, its first
   consumer, the other slots, the last consumer; the producer's backward follows the
   last consumer (the executor's window).
6. **Arrangement** (pp = 1). Cells are independent, so whole cells may change places
   within a replica or move between replicas (one for one of as many slots, or one for
   two whose slots add up to its own): each replica's cells start in falling order of
   their mean slot load when that is shorter, then the best strictly improving move per
   pair of replicas is taken, a few rounds. Where most trees need windows of their own,
   cells of one size hold trees of very different cost, and lining alike loads up across
   replicas is what evens the slots; the critical path never rises and no cell changes.
7. **Re-cutting and hand-over** (pp = 1, only when the path is not near ideal). A window
   (cell of k >= 2 slots) is re-shaved toward the other replicas' peak (or mean) load in
   each of its slots instead of its own mean, with its items kept or its two ends
   swapped (`_relevel`): a 62k-cost tree can load 35k + 27k where single trees and other
   windows sit. A window may hand one slot to another window of its replica
   (`_reshape`): k - 1 and k + 1 slots, re-solved; a 1-slot window holds its producer and
   its one consumer in the same slot (each within the budget, the consumer paying the
   producer's retention), so a tree a little over the budget loads one slot like the
   single trees next to it. Both are taken only when they shorten the critical path
   (then, at equal path, raise the slots' mean / max); trees, rows and slot counts stay.
8. **Joint re-cut** (pp = 1, only off-ideal). Re-cutting one window at a time cannot
   move a slot whose peak sits on another replica; a linear program over every window's
   slot loads (each within the range a re-cut reaches, `_window_ranges`) lowers
   sum_s (peak - mean) / peak with the path capped at today's, and `relevel` applies it
   (`_recut`). Kept only when the path is no longer and the slot balance higher; at a
   32k cap (swe-treestep-64, DP 8) all windows empty one slot alike: 96.84 -> 97.13%.
   The same is tried with each replica's runs of single trees (1-slot cells, within the
   budget) first merged into 3-slot windows (`_merge_runs`) and `_arrange`d: a window's
   slot loads move under the re-cut, a single tree's cannot. Kept on the same terms and
   when the 5th percentile of the per-slot balances is no lower: 97.13 -> 97.26% there
   (DP 4 98.22 -> 98.54%, DP 2 99.11 -> 99.23%).
9. **Tree swaps** (pp = 1, off-ideal). A window's loads move only inside it, so a cell
   heavier over its slots than the other replicas' slots there (trees near the budget
   leave it little room) keeps those slots' peaks whatever the re-cut does. Two rounds:
   each placement's excess (its load minus the slots' mean loads over its span), the
   single-tree swaps between two cells that most lower the summed |excess| shortlisted
   (6), each scored by the joint re-cut's LP (one round, path capped) with the new
   cells' ranges taken as the old cells' moved by the change in their slot loads, the
   best 2 scored again with their own ranges, the best taken when it raises the LP's
   balance; then `_recut`, kept on the terms of step 8 (`_swap_trees`; deterministic).
   At a 32k cap (swe-treestep-64, DP 8) one tree of a 3-slot window at the slot-2 peak
   traded for a lighter one of a window light over its slots: 97.28 -> 97.61% (P5 kept,
   path 332,315 -> 331,051) for ~0.09 s; DP 4 98.54 -> 98.94%, DP 2 99.25 -> 99.43%.
10. **Search over windows** (pp = 1, off-ideal, opt-in: `PlanConfig.search_evaluations`
   > 0, seeded by `PlanConfig.seed`). The final cells become placements (cell, first
   slot); simulated annealing swaps or moves a tree between two cells or re-splits two
   cells' trees into one or two new cells on the slots they free, each neighbour scored
   by the joint re-cut's LP (one round, path capped); the best few layouts are re-cut
   (`_recut`) and the best kept on the terms of step 8 (`_search_windows`). At a 32k cap
   (swe-treestep-64, DP 8), from step 9's plan, 400 evaluations reach
   97.67/97.73/97.75/97.65/97.67% (seeds 0-4) in ~1.0-1.1 s more (~3 ms an evaluation);
   off by default.

(S, m) is chosen to minimise the step's critical path sum_s max_r load(s, r): S rises
from the compact-token lower bound, never past L1's slot count (so `l1l2` never uses more
slots than `l1`, which never uses more than first-fit-decreasing), and the search stops
at a near-ideal critical path or after two slot counts that work. L1's own plan competes
on the same measure and wins when windows do not pay, so the compression is never below
L1's. KDA replay is not counted: shaved prefixes end on the chunk grid.

Pipelines (`PlanConfig.pp` > 1). S starts at `PlanConfig.target_microbatches` (at least
that many microbatches per replica, so 1F1B can fill its stages); only when no plan with
that many slots exists does the search fall back to fewer. A cell with fewer items than
slots splits its largest trees at their top nodes (into the producer) until it has
enough, so a few large trees become windows of several consumers without recomputing a
row. Candidates and L1's plan are scored by the pipelined critical path (slot loads plus
the fill and drain, `pipelined_critical_path`); L1's plan displaces a plan that meets the
floor only when it meets it too. Trees are dealt to cells with ties
broken toward the least loaded replica, since several cells per replica are then the
rule. A 1-slot window counts as one microbatch toward the floor: its producer's forward
runs just before its consumer's and adds no warm-up depth (harts/sim/schedule.py), its
backward runs with or right after the consumer's. With pp = 1 none of this applies.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from dataclasses import dataclass, field

import numpy as np
from ortools.linear_solver.python import model_builder_helper as mbh
from scipy.optimize import linprog
from scipy.sparse import csr_matrix

from harts.plan.plan import Plan
from harts.plan.planners.common import (
    ForestIndex,
    PlanConfig,
    TreeMB,
    finalize_tree,
    first_fit_decreasing,
    lpt_balanced,
    pipeline_ends,
    pipelined_critical_path,
)
from harts.plan.planners.l1 import l1_microbatches, place
from harts.plan.planners.registry import PlannerName, register_planner
from harts.tree.forest import RolloutForest

_MAX_SWAP_ROUNDS = 400
# stop searching slot counts once the critical path is this close to the ideal
_GOOD_ENOUGH = 0.002
# shave at most this share of an item (its last rows always stay with the consumer)
_MAX_SHAVE = 0.95
# improvement rounds of `_arrange` (each tries every pair of replicas once)
_ARRANGE_ROUNDS = 8
# rounds of `_relevel` (each re-cuts every window once)
_RELEVEL_ROUNDS = 3
# rounds of `_recut` (each re-solves the linear program at the new slot peaks)
_RECUT_ROUNDS = 2
# `_merge_runs`: runs of 1-slot single-tree cells become windows of this many slots
_MERGE_RUN = 3
# `_recut`: a window whose re-cut misses the LP's loads by more than this share of its
# load in all is held at what it got while the others are solved again
_PIN_MISS = 0.002


@dataclass(eq=False)
class Item:
    """A subtree `root` placed in one microbatch, minus a DFS prefix shaved into the
    producer: whole nodes `full` and rows [0, cut_off) of node `cut_node`."""

    root: int
    cost: float
    tokens: int
    full: list[int] = field(default_factory=list)
    cut_node: int = -1
    cut_off: int = 0
    shaved_cost: float = 0.0
    shaved_tokens: int = 0

    @property
    def left_cost(self) -> float:
        return self.cost - self.shaved_cost

    @property
    def left_tokens(self) -> int:
        return self.tokens - self.shaved_tokens


@dataclass(eq=False)
class Cell:
    """One replica's run of k consecutive slots: its items per slot and its producer
    (the trunk nodes of split trees plus every item's shaved prefix)."""

    k: int
    trees: list[int]
    trunk: list[int] = field(default_factory=list)  # whole nodes split into the producer
    trunk_cost: float = 0.0
    trunk_tokens: int = 0
    bins: list[list[Item]] = field(default_factory=list)
    _hanging: set[int] = field(default_factory=set)  # item roots whose parent is a trunk node

    def p_cost(self) -> float:
        return self.trunk_cost + sum(it.shaved_cost for b in self.bins for it in b)

    def p_tokens(self) -> int:
        return self.trunk_tokens + sum(it.shaved_tokens for b in self.bins for it in b)

    def bin_cost(self, b: int) -> float:
        return sum(it.left_cost for it in self.bins[b])

    def bin_tokens(self, b: int) -> int:
        return sum(it.left_tokens for it in self.bins[b])

    def reads_producer(self, b: int) -> bool:
        return any(it.shaved_tokens or it.root in self._hanging for it in self.bins[b])


class _CellSolver:
    def __init__(self, idx: ForestIndex, config: PlanConfig):
        self.idx = idx
        self.cm = config.cost_model
        self.budget = config.microbatch_tokens
        self.rho = config.producer_retention
        self.ff = config.cost_model.forward_fraction
        self.overhead = config.cost_model.microbatch_overhead
        self.chunk = config.chunk_size
        self.pp = config.pp
        self._alone: frozenset[int] | None = None
        self._chunks: dict[int, tuple[list[int], list[float]]] = {}
        self._first: dict[int, float] = {}  # `_first_chunk_cost` per node
        self._solved: dict[tuple[int, tuple[int, ...]], Cell | None] = {}
        # `_window_ranges` per cell (by identity; the cell is kept so its id stays its own)
        self._ranges: dict[tuple[int, int], tuple[Cell, list[tuple[float, float]] | None]] = {}
        # `_window_ranges` by what the re-cuts start from (shared by re-cut copies)
        self._ranges_of: dict[tuple, list[tuple[float, float]] | None] = {}

    def solved(self, k: int, trees: list[int]) -> Cell | None:
        """Cell of k slots holding `trees`, solved (`solve`), or None; memoised, since
        candidate plans of several slot counts share many cells (the cell returned is
        shared: nothing changes a cell once solved)."""
        key = (k, tuple(trees))
        if key not in self._solved:
            c = Cell(k=k, trees=list(trees))
            self._solved[key] = c if self.solve(c) else None
        return self._solved[key]

    def alone(self) -> frozenset[int]:
        """Trees over the budget that run as a 1-slot window by themselves: the producer
        and its one consumer in the same slot, each within the budget (the consumer also
        paying `producer_retention` x the producer's rows), every row computed once."""
        if self._alone is None:
            idx = self.idx
            self._alone = frozenset(
                r for r in idx.roots if idx.sub_rows[r] > self.budget and self.solved(1, [r]) is not None
            )
        return self._alone

    # ---- shaving ----------------------------------------------------------------------

    def _chunk_costs(self, u: int) -> tuple[list[int], list[float]]:
        """Chunk-aligned offsets o in (0, length) of node u (the cut lands on a multiple of
        the chunk size in depth) and the cost of rows [0, o) at each, rising; memoised
        (every re-cut asks again)."""
        got = self._chunks.get(u)
        if got is None:
            idx = self.idx
            s, e = idx.start[u], idx.end[u]
            first = (s // self.chunk + 1) * self.chunk
            if first >= e:
                got = ([], [])
            else:
                depths = np.arange(first, e, self.chunk, dtype=np.int64)
                costs = self.cm.segment_cost(np.full(depths.size, s), depths)
                got = ((depths - s).tolist(), costs.tolist())
            self._chunks[u] = got
        return got

    def _offset_for(self, u: int, want: float) -> tuple[int, float]:
        """Largest chunk-aligned offset o in [0, length) of node u whose rows [0, o) cost
        at most `want` (the cut lands on a multiple of the chunk size in depth), and the
        cost of those rows."""
        offsets, costs = self._chunk_costs(u)
        n = bisect_right(costs, want)
        return (offsets[n - 1], costs[n - 1]) if n else (0, 0.0)

    def shave(self, it: Item, want: float) -> None:
        """Re-cut item `it` so that its shaved DFS prefix costs about `want` (never more,
        never the whole item)."""
        idx = self.idx
        want = min(want, _MAX_SHAVE * it.cost)
        it.full, it.cut_node, it.cut_off, it.shaved_cost, it.shaved_tokens = [], -1, 0, 0.0, 0
        if want <= 0:
            return
        last = idx.sub_end[it.root]
        for u in range(it.root, last + 1):
            c = idx.node_cost[u]
            if u < last and it.shaved_cost + c <= want:
                it.full.append(u)
                it.shaved_cost += c
                it.shaved_tokens += idx.length[u]
                continue
            o, seg = self._offset_for(u, want - it.shaved_cost)
            if o:
                it.cut_node, it.cut_off = u, o
                it.shaved_cost += seg
                it.shaved_tokens += o
            break

    def shave_bin(self, c: Cell, b: int, amount: float) -> None:
        """Move about `amount` of work from bin b into the producer, item by item."""
        # deep items first: their prefix carries more work per token the producer retains
        idx = self.idx
        for it in sorted(c.bins[b], key=lambda x: (-idx.start[x.root], -x.left_cost, x.root)):
            if amount <= 0:
                return
            before = it.shaved_cost
            self.shave(it, before + amount)
            amount -= it.shaved_cost - before

    # ---- one cell ---------------------------------------------------------------------

    def loads(self, c: Cell) -> list[float]:
        out = [self.overhead + c.bin_cost(b) if c.bins[b] else 0.0 for b in range(c.k)]
        if c.trunk or any(it.shaved_tokens for b in c.bins for it in b):
            cons = [b for b in range(c.k) if c.reads_producer(b)]
            pc = self.overhead + c.p_cost()
            out[cons[0]] += self.ff * pc
            out[cons[-1]] += (1.0 - self.ff) * pc
        return out

    def ends(self, row: list[Cell]) -> float:
        """Fill + drain work of one replica's cells under a pipeline (see
        `pipelined_critical_path`): the forward of its first slot, with its producer's
        forward when that slot is the producer's first consumer (the producer runs right
        before it), and the backward of its last slot, with the producer's backward when
        that slot is the producer's last consumer."""
        used = [(c, b) for c in row for b in range(c.k) if c.bins[b]]
        if not used:
            return 0.0

        def share(c: Cell, b: int, frac: float, which: int) -> float:
            x = frac * (self.overhead + c.bin_cost(b))
            if c.trunk or any(it.shaved_tokens for bb in c.bins for it in bb):
                cons = [j for j in range(c.k) if c.reads_producer(j)]
                if b == cons[which]:
                    x += frac * (self.overhead + c.p_cost())
            return x

        (c0, b0), (c1, b1) = used[0], used[-1]
        return share(c0, b0, self.ff, 0) + share(c1, b1, 1.0 - self.ff, -1)

    def _split_item(self, c: Cell, items: list[Item], it: Item) -> bool:
        idx = self.idx
        v = it.root
        if not idx.children[v] or c.trunk_tokens + idx.length[v] > self.budget:
            return False
        items.remove(it)
        items += [Item(w, idx.sub_cost[w], idx.sub_rows[w]) for w in idx.children[v]]
        c.trunk.append(v)
        c.trunk_cost += idx.node_cost[v]
        c.trunk_tokens += idx.length[v]
        c._hanging.update(idx.children[v])
        return True

    def solve(self, c: Cell) -> bool:
        """Level the cell (every slot at the cell's mean load) when the budget allows,
        trying two ways of filling it; otherwise pack it largest-cost-first into the
        least-loaded slot with token room. Keeps the feasible result with the lowest
        peak load."""
        best: tuple[float, int, Cell] | None = None
        for attempt in ("cover", "anchor", "lpt", "ffd"):
            trial = Cell(k=c.k, trees=list(c.trees))
            if attempt in ("lpt", "ffd"):
                ok = self._solve_lpt(Cell(k=c.k, trees=list(c.trees)), out=trial, ffd=attempt == "ffd")
            else:
                ok = self._solve_level(trial, anchored=attempt == "anchor")
            if ok:
                key = (max(self.loads(trial)), trial.p_tokens())
                if best is None or key < best[:2]:
                    best = (*key, trial)
        if best is None:
            return False
        trial = best[2]
        c.trunk, c.trunk_cost, c.trunk_tokens = trial.trunk, trial.trunk_cost, trial.trunk_tokens
        c.bins, c._hanging = trial.bins, trial._hanging
        return True

    def _mandatory_splits(self, c: Cell, items: list[Item]) -> bool:
        """Split trees too large for one microbatch next to the producer."""
        while True:
            room = self.budget - self.rho * c.trunk_tokens
            big = [it for it in items if it.tokens > room]
            if not big:
                return True
            if not self._split_item(c, items, max(big, key=lambda x: (x.tokens, -x.root))):
                return False

    def _split_to_count(self, c: Cell, items: list[Item], k: int) -> bool:
        """Split the largest item with children at its top node (into the producer) while
        there are fewer than k items; False when that cannot reach k. Only with a pipeline
        (a cell with fewer items than slots is otherwise given up, as before)."""
        if self.pp <= 1:
            return len(items) >= k
        while len(items) < k:
            forks = [it for it in items if self.idx.children[it.root]]
            if not forks or not self._split_item(c, items, max(forks, key=lambda x: (x.cost, -x.root))):
                return False
        return True

    def _solve_lpt(self, c: Cell, out: Cell, ffd: bool) -> bool:
        """No levelling: whole items largest-cost-first into the least-loaded slot with
        token room, or (`ffd`, for tight budgets) first-fit-decreasing by tokens followed
        by load-lowering moves and swaps; slots ordered by load, heaviest first."""
        idx = self.idx
        items = [Item(t, idx.sub_cost[t], idx.sub_rows[t]) for t in c.trees]
        if not self._mandatory_splits(c, items) or not self._split_to_count(c, items, c.k):
            return False
        room = int(self.budget - self.rho * c.trunk_tokens)
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
            _balance_bins(bins, cost, tokens, room)
        if bins is None or any(not b for b in bins):
            return False
        bins.sort(key=lambda b: (-sum(cost[i] for i in b), min(b)))
        out.trunk, out.trunk_cost, out.trunk_tokens = c.trunk, c.trunk_cost, c.trunk_tokens
        out._hanging = c._hanging
        out.bins = [[items[i] for i in b] for b in bins]
        return self._fits(out)

    def _solve_level(self, c: Cell, anchored: bool) -> bool:
        idx = self.idx
        k = c.k
        items = [Item(t, idx.sub_cost[t], idx.sub_rows[t]) for t in c.trees]
        if not self._mandatory_splits(c, items):
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
                if not self._split_to_count(c, items, len(items) + 1):
                    return False
                continue
            else:
                break
            if not self._split_item(c, items, it):
                return False
        todo = sorted(items, key=lambda x: (-x.cost, x.root))
        unit = max(target / 1000.0, 1e-9)
        room = self.budget - self.rho * c.trunk_tokens
        # k - 2 covering slots: the largest remaining item, completed by the subset of
        # the others that reaches the target with the least overshoot within the token
        # room; the two end slots share what is left
        bins: list[list[Item]] = []
        overshoot = 0.0
        for _ in range(k - 2):
            # a covering slot needs an item besides one per end: with a pipeline, split
            # the largest item with children while there are not enough
            if len(todo) < 3 and self._split_to_count(c, todo, 3):
                todo.sort(key=lambda x: (-x.cost, x.root))
                room = self.budget - self.rho * c.trunk_tokens
            if len(todo) < 3:
                break
            if anchored:
                anchor = todo[0]
                pick = [anchor]
                if anchor.cost < target:
                    pick += _subset_near(
                        todo[1:-2], target - anchor.cost, unit, cover=True, room=room - anchor.tokens
                    )
            else:
                while True:
                    if todo[0].cost > target:
                        pick = [todo[0]]
                    else:
                        pick = _subset_near(todo, target, unit, cover=True, room=room)
                    short = sum(it.cost for it in pick) < target
                    if pick and not short and len(todo) - len(pick) >= 2:
                        break
                    # the rest cannot cover the target and leave an item per end:
                    # split the largest remaining item at a fork and try again
                    fork = next((it for it in todo if len(idx.children[it.root]) > 1), None)
                    if fork is None or not self._split_item(c, todo, fork):
                        break
                    todo.sort(key=lambda x: (-x.cost, x.root))
                    room = self.budget - self.rho * c.trunk_tokens
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
            pick = _subset_near(todo, target - self.ff * x, unit, cover=False, room=room)
            if pick and len(pick) < len(todo) and rest_tokens - sum(it.tokens for it in pick) > room:
                last = _subset_near(todo, target - (1.0 - self.ff) * x, unit, cover=False, room=room)
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
            return self._apply_fitting(c, self._shave_plan(c, target))
        return self._fits(c)

    def _shave_plan(self, c: Cell, target: float | list[float]) -> list[tuple[int, float]]:
        """(bin, amount) shaves that level the cell: each middle slot down to the target,
        the ends made consumers, then one end shaved so both ends meet the target.
        `target` may also be one load per slot (the first end's is the one solved for;
        the last end takes what is left)."""
        k = c.k
        tgt = [target] * k if isinstance(target, (int, float)) else list(target)
        plan = []
        for b in range(1, k - 1):
            excess = c.bin_cost(b) - tgt[b]
            if excess > 0:
                plan.append((b, excess))
        for b, amount in plan:
            self.shave_bin(c, b, amount)
        for b in (0, k - 1):
            if not c.reads_producer(b):
                it = min(c.bins[b], key=lambda x: (x.cost, x.root))
                amount = 1e-9 + self._first_chunk_cost(it.root)
                self.shave(it, amount)
                plan.append((b, it.shaved_cost))
        xp = self.overhead + c.p_cost()
        a = tgt[0] - (self.overhead + c.bin_cost(0)) - self.ff * xp
        if a >= 0:
            plan.append((k - 1, a / self.ff if self.ff > 0 else 0.0))
        else:
            plan.append((0, -a / (1.0 - self.ff)))
        for b in c.bins:
            for it in b:
                self.shave(it, 0.0)
        return plan

    def relevel(self, c: Cell, target: list[float], steps: int = 12) -> Cell | None:
        """A copy of cell c (same trunk, same items per slot, or with its two ends
        swapped) whose shaves are re-planned toward one load per slot (`target`, in load
        units, summing to the cell's load) instead of the cell's mean; the largest share
        of that the budget allows, the copy nearest the target. None when nothing fits."""
        if c.k < 2 or not all(c.bins):
            return None
        tgt = [target[0], *(t - self.overhead for t in target[1:-1]), target[-1]]
        best: tuple[float, Cell] | None = None
        for flip in (False, True):
            trial = Cell(k=c.k, trees=list(c.trees), trunk=list(c.trunk), trunk_cost=c.trunk_cost,
                         trunk_tokens=c.trunk_tokens, _hanging=set(c._hanging))
            bins = [[Item(it.root, it.cost, it.tokens) for it in b] for b in c.bins]
            if flip:
                bins[0], bins[-1] = bins[-1], bins[0]
            trial.bins = bins
            plan = self._shave_plan(trial, tgt)
            if not self._apply_fitting(trial, plan, steps=steps):
                continue
            miss = sum(abs(a - b) for a, b in zip(self.loads(trial), target, strict=True))
            if best is None or miss < best[0]:
                best = (miss, trial)
        return None if best is None else best[1]

    def _apply_fitting(self, c: Cell, plan: list[tuple[int, float]], whole: int = 0, steps: int = 12) -> bool:
        """Apply the largest share of `plan` that fits the budget (bisection); its first
        `whole` steps in full; `steps` bisection steps."""
        self._apply(c, plan, 1.0, whole)
        if self._fits(c):
            return True
        lo, hi = 0.0, 1.0
        for _ in range(steps):
            mid = 0.5 * (lo + hi)
            self._apply(c, plan, mid, whole)
            if self._fits(c):
                lo = mid
            else:
                hi = mid
        self._apply(c, plan, lo, whole)
        return self._fits(c)

    def _apply(self, c: Cell, plan: list[tuple[int, float]], lam: float, whole: int = 0) -> None:
        for b in c.bins:
            for it in b:
                self.shave(it, 0.0)
        for j, (b, amount) in enumerate(plan):
            self.shave_bin(c, b, amount if j < whole else lam * amount)
        if lam < 1.0:
            # the ends must still read the producer when one exists
            if c.trunk or any(it.shaved_tokens for b in c.bins for it in b):
                for b in (0, c.k - 1):
                    if not c.reads_producer(b):
                        it = min(c.bins[b], key=lambda x: (x.cost, x.root))
                        self.shave(it, 1e-9 + self._first_chunk_cost(it.root))

    def _fits(self, c: Cell) -> bool:
        p_tokens = c.p_tokens()
        if p_tokens > self.budget:
            return False
        room = self.budget - self.rho * p_tokens
        return all(c.bin_tokens(b) <= room for b in range(c.k))

    def _first_chunk_cost(self, v: int) -> float:
        got = self._first.get(v)
        if got is None:
            idx = self.idx
            s = idx.start[v]
            e = min(idx.end[v], (s // self.chunk + 1) * self.chunk)
            if e >= idx.end[v]:
                got = idx.node_cost[v]
            else:
                got = float(self.cm.segment_cost(np.array([s]), np.array([e]))[0])
            self._first[v] = got
        return got


def _balance_bins(bins: list[list[int]], cost: list[float], tokens: list[int], room: int) -> None:
    """Even out bin loads (least sum of squares) by moving or swapping single items
    between two bins while tokens allow; the best improving step each round."""
    load = [sum(cost[i] for i in b) for b in bins]
    tok = [sum(tokens[i] for i in b) for b in bins]
    n = len(bins)
    for _ in range(4 * len(cost)):
        best, best_gain = None, 1e-9
        for h in range(n):
            for j in range(n):
                if j == h or load[h] <= load[j]:
                    continue
                gap = load[h] - load[j]
                for a in bins[h]:
                    for b in [None, *bins[j]]:
                        d = cost[a] - (cost[b] if b is not None else 0.0)
                        if not 0 < d < gap or (len(bins[h]) == 1 and b is None):
                            continue
                        dt = tokens[a] - (tokens[b] if b is not None else 0)
                        if tok[j] + dt > room or tok[h] - dt > room:
                            continue
                        # change of load[h]^2 + load[j]^2 when d moves from h to j
                        gain = 2.0 * d * (gap - d)
                        if gain > best_gain:
                            best, best_gain = (h, j, a, b, d, dt), gain
        if best is None:
            return
        h, j, a, b, d, dt = best
        bins[h].remove(a)
        bins[j].append(a)
        if b is not None:
            bins[j].remove(b)
            bins[h].append(b)
        load[h] -= d
        load[j] += d
        tok[h] -= dt
        tok[j] += dt


def _subset_near(items: list[Item], aim: float, unit: float, cover: bool, room: float) -> list[Item]:
    """A non-empty subset of `items` with at most `room` tokens whose cost is closest to
    `aim`: the least cost >= aim when `cover` (if any), else the nearest either side.
    A min-token knapsack over costs rounded to `unit`: dp[s] = the fewest tokens of a
    subset with rounded cost s, one numpy pass per item, kept for backtracking."""
    if not items:
        return []
    w = [max(1, round(it.cost / unit)) for it in items]
    target = max(0, round(aim / unit))
    limit = max(target + max(w) + 1, 1)
    big = np.iinfo(np.int64).max // 4
    dp = np.full(limit + 1, big, dtype=np.int64)
    dp[0] = 0
    hist = [dp]
    for wi, it in zip(w, items, strict=True):
        new = dp.copy()
        if wi <= limit:
            np.minimum(new[wi:], dp[: limit + 1 - wi] + it.tokens, out=new[wi:])
        dp = new
        hist.append(dp)
    ok = dp <= room
    ok[0] = False
    sums = np.flatnonzero(ok)
    if not sums.size:
        return []
    above = sums[sums >= target]
    if cover and above.size:
        best = int(above[0])
    else:
        best = int(sums[np.argmin(np.abs(sums - target))])
    out = []
    s = best
    for i in range(len(items), 0, -1):
        if s and hist[i][s] != hist[i - 1][s]:
            out.append(items[i - 1])
            s -= w[i - 1]
    return out[::-1]


# ---- cells ------------------------------------------------------------------------------


def _assign_trees(
    idx: ForestIndex,
    sizes: list[int],
    cap: list[float],
    fixed: dict[int, int],
    replica_of: list[int] | None = None,
    alone: frozenset[int] = frozenset(),
) -> list[list[int]] | None:
    """Trees to cells: largest cost first into the cell least loaded relative to its size
    (with token room), then the best single move or swap between the heaviest cell and
    any other while it lowers the heaviest relative load. `fixed` pins trees to cells.

    `replica_of` (each cell's replica), when given, breaks ties between equally loaded
    cells toward the least loaded replica; without it the lowest-numbered cell wins, which
    puts the largest trees on the first replica's cells while they are all empty. With a
    pipeline l1l2 wants several cells per replica, so it passes `replica_of`; without one
    the established assignment is kept.

    `alone`: trees a 1-slot cell may hold by themselves whatever its token room (a tree a
    little over the budget that runs as a 1-slot window, `_CellSolver.alone`)."""
    n = len(sizes)

    def fits(i: int, tok: int, out: int | None, into: int | None) -> bool:
        # cell i with `tok` tokens after tree `out` leaves it and `into` joins it
        if tok <= cap[i]:
            return True
        if sizes[i] != 1 or not alone:
            return False
        left = [t for t in cells[i] if t != out] + ([into] if into is not None else [])
        return len(left) == 1 and left[0] in alone

    load = [0.0] * n
    tokens = [0] * n
    cells: list[list[int]] = [[] for _ in range(n)]
    replica_of = replica_of if replica_of is not None else [0] * n
    rep_load = [0.0] * (max(replica_of, default=0) + 1)
    cost, rows = idx.sub_cost, idx.sub_rows
    for t, i in fixed.items():
        cells[i].append(t)
        load[i] += cost[t]
        tokens[i] += rows[t]
        rep_load[replica_of[i]] += cost[t]
    for t in sorted(idx.roots, key=lambda r: (-cost[r], r)):
        if t in fixed:
            continue
        best, best_key = -1, None
        for i in range(n):
            if fits(i, tokens[i] + rows[t], None, t):
                key = (load[i] / sizes[i], rep_load[replica_of[i]])
                if best_key is None or key < best_key:
                    best, best_key = i, key
        if best < 0:
            return None
        cells[best].append(t)
        load[best] += cost[t]
        tokens[best] += rows[t]
        rep_load[replica_of[best]] += cost[t]
    for _ in range(_MAX_SWAP_ROUNDS):
        rel = [load[i] / sizes[i] for i in range(n)]
        hi = max(range(n), key=lambda i: (rel[i], -i))
        best_val, best_move = rel[hi], None
        for lo in range(n):
            if lo == hi:
                continue
            for a in cells[hi]:
                if a in fixed:
                    continue
                for b in [None, *cells[lo]]:
                    if b in fixed:
                        continue
                    delta = cost[a] - (cost[b] if b is not None else 0.0)
                    dt = rows[a] - (rows[b] if b is not None else 0)
                    if delta <= 0 or not fits(lo, tokens[lo] + dt, b, a) or not fits(hi, tokens[hi] - dt, a, b):
                        continue
                    new = max((load[hi] - delta) / sizes[hi], (load[lo] + delta) / sizes[lo])
                    if new < best_val - 1e-9:
                        best_val, best_move = new, (lo, a, b, delta, dt)
        if best_move is None:
            break
        lo, a, b, delta, dt = best_move
        cells[hi].remove(a)
        cells[lo].append(a)
        if b is not None:
            cells[lo].remove(b)
            cells[hi].append(b)
        load[hi] -= delta
        load[lo] += delta
        tokens[hi] -= dt
        tokens[lo] += dt
    return cells


def _group_sizes(slots: int, groups: int) -> list[int]:
    base, extra = divmod(slots, groups)
    return [base + (1 if g < extra else 0) for g in range(groups) if base + (1 if g < extra else 0)]


def _build(
    idx: ForestIndex, solver: _CellSolver, dp: int, slots: int, groups: int, by_replica: bool = False
) -> list[list[Cell]] | None:
    """Cells per replica. A tree larger than the budget gets a cell of its own on its
    replica (its trunk then only weighs on that cell's microbatches' budget).
    `by_replica`: trees dealt with ties broken toward the least loaded replica (always so
    with a pipeline)."""
    alone = solver.alone()
    giants = sorted((r for r in idx.roots if idx.sub_rows[r] > solver.budget),
                    key=lambda r: (-idx.sub_rows[r], r))
    # only a few giants get cells of their own (when every tree is a giant, as with
    # step-wise sampling, the cells' own producers take them)
    if len(giants) > dp:
        giants = []
    layout: list[list[int]] = []
    fixed: dict[int, int] = {}
    n = 0
    for r in range(dp):
        own = math.ceil(idx.sub_rows[giants[r]] / (0.9 * solver.budget)) if r < len(giants) else 0
        if own and slots > own:
            sizes = [own, *_group_sizes(slots - own, min(groups, slots - own))]
            fixed[giants[r]] = n
        else:
            sizes = _group_sizes(slots, groups)
        layout.append(sizes)
        n += len(sizes)
    flat = [k for sizes in layout for k in sizes]
    replica_of = [r for r, sizes in enumerate(layout) for _ in sizes]
    # token room per cell: near the step's average fill first (so no cell is left with
    # more tokens than its slots can pack), looser if that cannot be met
    fill = idx.forest.compact_tokens / (dp * slots * solver.budget)
    for slack in (0.01, 0.03, 0.1, None):
        share = 1.0 if slack is None else min(1.0, fill + slack)
        trees = _assign_trees(idx, flat, [k * solver.budget * share for k in flat], fixed,
                              replica_of if solver.pp > 1 or by_replica else None, alone)
        if trees is None:
            continue
        out: list[list[Cell]] = []
        i = 0
        ok = True
        for sizes in layout:
            row = []
            for k in sizes:
                cell = _solve_cell(solver, k, trees[i])
                i += 1
                if cell is None:
                    ok = False
                    break
                row += cell
            if not ok:
                break
            out.append(row)
        if ok:
            return out
    return None


def _solve_cell(solver: _CellSolver, k: int, trees: list[int]) -> list[Cell] | None:
    """The cells that run `trees` on k consecutive slots: one cell of k slots, or when that
    does not solve (a tree of one node cannot be split over two slots, say), the trees on
    as many of the k slots as solve (down to a 1-slot window) followed by an empty cell of
    the slots left over; None when not even one slot holds them."""
    if not trees:
        return [Cell(k=k, trees=[], bins=[[] for _ in range(k)])]
    for j in range(k, 0, -1):
        c = solver.solved(j, trees)
        if c is None:
            continue
        if j == k:
            return [c]
        return [c, Cell(k=k - j, trees=[], bins=[[] for _ in range(k - j)])]
    return None


def _critical_path(cells: list[list[Cell]], solver: _CellSolver, pp: int = 1) -> float:
    """sum over slots of the max load across replicas, pipelined over `pp` stages
    (`pipelined_critical_path`; the plain sum when pp = 1)."""
    rows = [[x for c in row for x in solver.loads(c)] for row in cells]
    if pp <= 1:
        return pipelined_critical_path(rows, 1)
    return pipelined_critical_path(rows, pp, [solver.ends(row) for row in cells])


def _arrange(cells: list[list[Cell]], solver: _CellSolver, rounds: int = _ARRANGE_ROUNDS) -> list[list[Cell]]:
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
                for wa, wb, build in _moves(rows[r1], rows[r2], r1 == r2, loads, vecs[r1], vecs[r2]):
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


def _relevel(cells: list[list[Cell]], solver: _CellSolver, rounds: int = _RELEVEL_ROUNDS) -> list[list[Cell]]:
    """Re-cut windows toward the other replicas' slots: each cell of two or more slots is
    re-shaved (`_CellSolver.relevel`) toward the others' peak load in each of its slots,
    shifted evenly so the cell's own load is kept; the copy replaces the cell when it
    shortens the critical path. Trees, producers' trunks and every cell's slots stay, so
    the plan stays valid with every row computed once. Returns new rows."""
    rows = [list(r) for r in cells]
    dp = len(rows)
    if dp < 2:
        return rows
    vecs = [[x for c in row for x in solver.loads(c)] for row in rows]
    for _ in range(rounds):
        improved = False
        for r in range(dp):
            s0 = 0
            for i, c in enumerate(rows[r]):
                k = c.k
                if k >= 2 and c.trees:
                    span = range(s0, s0 + k)
                    peak = [max(vecs[q][s] for q in range(dp) if q != r) for s in span]
                    rest = [sum(vecs[q][s] for q in range(dp) if q != r) for s in span]
                    old = vecs[r][s0 : s0 + k]
                    score = _window_score(old, peak, rest, dp)
                    for aim in (peak, [x / (dp - 1) for x in rest]):
                        shift = (sum(old) - sum(aim)) / k
                        cand = solver.relevel(c, [a + shift for a in aim])
                        if cand is None:
                            continue
                        new = solver.loads(cand)
                        got = _window_score(new, peak, rest, dp)
                        if got < score:
                            rows[r][i], old, score = cand, new, got
                            vecs[r][s0 : s0 + k] = new
                            improved = True
                s0 += k
        if not improved:
            break
    return rows


def _slot_balances(vecs: list[list[float]]) -> list[float]:
    """Per slot, mean / max load across replicas."""
    out = []
    for col in zip(*vecs, strict=True):
        peak = max(col)
        out.append(sum(col) / len(col) / peak if peak > 0 else 1.0)
    return out


def _slot_balance(vecs: list[list[float]]) -> float:
    """Mean over slots of mean / max load across replicas (the plan's slot balance)."""
    out = _slot_balances(vecs)
    return sum(out) / len(out) if out else 1.0


def _window_ranges(solver: _CellSolver, c: Cell, steps: int = 12) -> list[tuple[float, float]] | None:
    """The load each slot of window c can take under a re-cut (`_CellSolver.relevel`):
    per slot, the load when it is aimed at everything and at nothing (the others sharing
    the rest evenly). The slots are treated as
    independent (a box), so a load the ranges allow may be missed by the re-cut (which
    then lands nearest to it); the caller checks what it gets. None when a re-cut does not
    fit. `steps`: the re-cuts' bisection steps (`_CellSolver._apply_fitting`; fewer give
    ranges a little narrower where the budget binds, never wider). Memoised per cell on
    the solver (a cell never changes once solved), and by what its re-cuts start from
    (slot count, trunk, each slot's item roots and the cell's load in all; not its
    shaves, which `relevel` redoes), so that re-cut copies of one cell share them."""
    got = solver._ranges.get((id(c), steps))
    if got is None:
        key = (c.k, tuple(c.trunk), tuple(tuple(it.root for it in b) for b in c.bins), sum(solver.loads(c)), steps)
        rg = solver._ranges_of.get(key, False)
        if rg is False:
            rg = solver._ranges_of[key] = _reach_ranges(solver, c, steps)
        got = solver._ranges[(id(c), steps)] = (c, rg)
    return got[1]


def _reach_ranges(solver: _CellSolver, c: Cell, steps: int) -> list[tuple[float, float]] | None:
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


def _recut(cells: list[list[Cell]], solver: _CellSolver, rounds: int = _RECUT_ROUNDS,
           cap: float | None = None, ranges=None) -> list[list[Cell]]:
    """Re-cut all windows at once (pp = 1): each window's slot loads become variables
    within the ranges a re-cut reaches (`_window_ranges`; a window's loads sum to its
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
    rows (the input is not modified)."""
    rows = [list(r) for r in cells]
    dp = len(rows)
    if dp < 2 or not any(rows):
        return rows
    wins = []  # (replica, first slot, cell index, ranges, total)
    for r, row in enumerate(rows):
        s0 = 0
        for i, c in enumerate(row):
            if c.k >= 2 and c.trees and all(c.bins):
                rng = _window_ranges(solver, c) if ranges is None else ranges(c)
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
    bal = _slot_balance(vecs)
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
        res = linprog(cost, A_ub=a_ub, b_ub=b_ub, bounds=bounds + [(0.0, None)] * n_slots, method="highs")
        if res.status != 0:
            break
        sol = res.x
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
                if sum(abs(x - y) for x, y in zip(got, aim, strict=True)) > _PIN_MISS * total:
                    missed[j] = (new, got)
        pinned.update(missed)
        cur = [[x for c in row for x in solver.loads(c)] for row in cand]
        # kept only when the path is no longer and the slots are better balanced; the
        # next round re-weights at this candidate's peaks either way
        cbal = _slot_balance(cur)
        if round(sum(map(max, *cur)), 6) <= crit and cbal > bal + 1e-12:
            best, bal = cand, cbal
        if missed and not repair:
            repair = True
        else:
            repair = False
            done += 1
            pinned.clear()
    return best


def _merge_runs(cells: list[list[Cell]], solver: _CellSolver, size: int = _MERGE_RUN) -> list[list[Cell]] | None:
    """Each replica's runs of consecutive 1-slot cells of one tree within the budget
    become windows of `size` slots (one tree per slot; the remainder of a run first, a
    remainder of one left as it is): a slot load that sits in a window can move under
    `_recut`, a single tree's cannot. A group whose window does not solve on all its slots
    keeps its cells. Trees and slot counts stay, and every row is still computed once.
    Returns new rows, or None when no window formed."""
    idx = solver.idx

    def single(c: Cell) -> bool:
        return c.k == 1 and len(c.trees) == 1 and idx.sub_rows[c.trees[0]] <= solver.budget

    out: list[list[Cell]] = []
    formed = False
    for row in cells:
        new: list[Cell] = []
        i = 0
        while i < len(row):
            j = i
            while j < len(row) and single(row[j]):
                j += 1
            if j == i:
                new.append(row[i])
                i += 1
                continue
            n = j - i
            for k in ([n % size] if n % size else []) + [size] * (n // size):
                group = row[i : i + k]
                i += k
                c = None
                if k > 1:
                    c = solver.solved(k, sorted((x.trees[0] for x in group), key=lambda t: (-idx.sub_cost[t], t)))
                if c is not None and len(c.bins) == k and all(c.bins):
                    new.append(c)
                    formed = True
                else:
                    new.extend(group)
        out.append(new)
    return out if formed else None


def _window_score(mine: list[float], peak: list[float], rest: list[float], dp: int) -> tuple[float, float]:
    """How a replica's loads over some slots fare against the other replicas' (their peak
    and their sum per slot): (critical path over those slots, minus their summed slot
    balance mean / max), rounded so that float noise never counts as a gain."""
    crit = sum(max(a, p) for a, p in zip(mine, peak, strict=True))
    bal = sum((a + s) / dp / max(a, p) for a, p, s in zip(mine, peak, rest, strict=True) if max(a, p) > 0)
    return round(crit, 6), -round(bal, 9)


def _order_row(row: list[Cell], vec_of, peak: list[float], moving: tuple[Cell, ...]) -> tuple[float, list[Cell]]:
    """Cells of one replica reordered (the best swap of a `moving` cell with another
    while it helps) to minimise sum_s max(load(s), peak(s)); returns (that sum, the
    order)."""

    def cost(r: list[Cell]) -> float:
        v = [x for c in r for x in vec_of(c)]
        return sum(max(a, p) for a, p in zip(v, peak, strict=True))

    row = list(row)
    cur = cost(row)
    while True:
        best = None
        for i in range(len(row)):
            for j in range(i + 1, len(row)):
                if not (any(row[i] is m for m in moving) or any(row[j] is m for m in moving)):
                    continue
                n = list(row)
                n[i], n[j] = n[j], n[i]
                v = cost(n)
                if v < cur * (1 - 1e-9) and (best is None or v < best[0]):
                    best = (v, n)
        if best is None:
            return cur, row
        cur, row = best


def _reshape(cells: list[list[Cell]], solver: _CellSolver) -> list[list[Cell]]:
    """Give one window's slot to another window of the same replica: X (k >= 2 slots)
    re-solved with k - 1 (a 1-slot window holds its producer and its consumer in one
    slot: a tree a little over the budget then loads one slot like a tree just under it),
    Y with k + 1; the replica's cells reordered and re-cut against the other replicas'
    peaks. Taken when that shortens the critical path; slot counts stay. Returns new
    rows."""
    rows = [list(r) for r in cells]
    dp = len(rows)
    if dp < 2:
        return rows
    cache: dict[int, tuple[float, ...]] = {}

    def vec_of(c: Cell) -> tuple[float, ...]:
        if id(c) not in cache:
            cache[id(c)] = tuple(solver.loads(c))
        return cache[id(c)]

    solved: dict[tuple[int, tuple[int, ...]], Cell | None] = {}

    def resolve(c: Cell, k: int) -> Cell | None:
        key = (k, tuple(c.trees))
        if key not in solved:
            n = Cell(k=k, trees=list(c.trees))
            solved[key] = n if solver.solve(n) else None
        return solved[key]

    vecs = [[x for c in row for x in vec_of(c)] for row in rows]
    for r in range(dp):
        peak = [max(vecs[q][s] for q in range(dp) if q != r) for s in range(len(vecs[r]))]
        cur = sum(max(a, p) for a, p in zip(vecs[r], peak, strict=True))
        best = None
        wins = [i for i, c in enumerate(rows[r]) if c.trees and c.k >= 2]
        grow = wins
        for i in wins:
            x = resolve(rows[r][i], rows[r][i].k - 1)
            if x is None:
                continue
            for j in grow:
                if j == i:
                    continue
                y = resolve(rows[r][j], rows[r][j].k + 1)
                if y is None:
                    continue
                row = [x if t == i else y if t == j else c for t, c in enumerate(rows[r])]
                v, row = _order_row(row, vec_of, peak, (x, y))
                if v < cur * (1 - 1e-9) and (best is None or v < best[0]):
                    best = (v, row)
        if best is not None:
            rows[r] = best[1]
            vecs[r] = [x for c in rows[r] for x in vec_of(c)]
    return rows


def _moves(a: list[Cell], b: list[Cell], same: bool, loads: dict | None = None,
           va: list[float] | None = None, vb: list[float] | None = None):
    """The rearrangements `_arrange` tries between two replicas' cell lists (or within one
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


# ---- search over windows ------------------------------------------------------------------

# `_search_windows`: simulated annealing temperature (in slot-balance units), its decay per
# evaluation and its floor; move mix (swap a tree, move a tree, re-form two cells). On
# swe-treestep-64 DP 8 (seeds 0-4) T0 1e-4, decay 0.99 average 97.49% at 200 evaluations
# and 97.52% at 400, against 97.41% / 97.49% for T0 5e-4, decay 0.999
_SA_T0 = 0.0001
_SA_DECAY = 0.99
_SA_TMIN = 1e-5
_SA_MOVES = (0.4, 0.25, 0.35)
# a re-formed cell has at most this many slots; tries per move before another is drawn
_SA_MAX_K = 4
_SA_TRIES = 4
# bisection steps of the re-cuts that give a window's ranges (`_window_ranges`) while
# searching and when the result is re-cut (fewer are cheaper, but at 4-8 the narrower
# ranges lose most of the gain on swe-treestep-64 DP 8)
_SA_STEPS = 12
# the best this many layouts met are re-cut and the best result kept
_SA_REALISE = 3


class _Columns:
    """The step as placements (cell, first slot) over S slots and dp replicas, scored by
    the joint re-cut's linear program (`_recut`, one round, the critical path capped): the
    slot balance the re-cut can reach with these cells where they are."""

    def __init__(self, rows: list[list[Cell]], solver: _CellSolver, crit: float):
        self.solver = solver
        self.dp = len(rows)
        self.S = sum(c.k for c in rows[0])
        self.crit = crit
        self.info: dict[int, tuple[Cell, list[float], list[tuple[float, float]] | None, float]] = {}
        self.P: list[tuple[Cell, int]] = []
        for row in rows:
            s0 = 0
            for c in row:
                self.reg(c)
                self.P.append((c, s0))
                s0 += c.k

    def reg(self, c: Cell) -> bool:
        """Cell c's loads and re-cut ranges, noted once; False when c cannot be placed (a
        window that does not fill its slots)."""
        got = self.info.get(id(c))
        if got is None:
            ld = self.solver.loads(c)
            movable = c.k >= 2 and bool(c.trees) and all(c.bins)
            rg = _window_ranges(self.solver, c, _SA_STEPS) if movable else None
            if rg is not None:
                # the cell's own loads are in reach (coarse ranges may fall short of them)
                rg = [(min(lo, x), max(hi, x)) for (lo, hi), x in zip(rg, ld, strict=True)]
            got = self.info[id(c)] = (c, ld, rg, sum(ld))
        return True

    def cell_for(self, k: int, trees: list[int]) -> Cell | None:
        """The solved cell of k slots holding `trees` (every slot used), or None."""
        solver = self.solver
        idx = solver.idx
        trees = sorted(trees, key=lambda r: (-idx.sub_cost[r], r))
        if not trees or k > _SA_MAX_K:
            return None
        # an exact rejection before solving: k consumers hold at most budget - rho x the
        # producer's tokens each, the producer at most the budget
        tok = sum(idx.sub_rows[t] for t in trees)
        if tok > (k + max(0.0, 1.0 - k * solver.rho)) * solver.budget:
            return None
        c = solver.solved(k, trees)
        if c is None or len(c.bins) != k or not all(c.bins):
            return None
        self.reg(c)
        if k >= 2 and self.info[id(c)][2] is None:
            return None
        return c

    def score(self, P: list[tuple[Cell, int]], aims: dict | None = None) -> float:
        """The slot balance of the re-cut LP's loads for placements P (-1 when the LP
        fails): one round of `_recut`'s program, weights at P's own peaks, built as arrays
        and solved by GLOP (OR-Tools' model builder). `aims`, when given, receives each
        window's LP loads by its index in P."""
        S, dp, info = self.S, self.dp, self.info
        cols: list[list[float]] = [[] for _ in range(S)]
        wins = []
        at_p = []
        for t, (c, s) in enumerate(P):
            _, ld, rg, total = info[id(c)]
            if rg is None:
                for j, x in enumerate(ld):
                    cols[s + j].append(x)
            else:
                wins.append((s, ld, rg, total))
                at_p.append(t)
        fixedmax = [max(col) if col else 0.0 for col in cols]
        peak = list(fixedmax)
        for s, ld, _, _ in wins:
            for j, x in enumerate(ld):
                if x > peak[s + j]:
                    peak[s + j] = x
        w = [1.0 / max(p, 1e-9) for p in peak]
        # the program as arrays (one sparse matrix, built row by row in lists): variables
        # are the S peaks, then each window's first k - 1 slot loads; rows the critical
        # path cap, then per window its last slot under the peak (`top`), its last slot
        # within range (`tail`), and each other slot under its peak
        inf = math.inf
        nv = S + sum(len(rg) - 1 for _, _, rg, _ in wins)
        lb = [0.0] * nv
        ub = [inf] * nv
        obj = [0.0] * nv
        lb[:S] = fixedmax
        obj[:S] = w
        indptr, indices, data = [0, S], list(range(S)), [1.0] * S
        clo, cup = [-inf], [self.crit]
        at = S
        for s, _, rg, total in wins:
            k = len(rg)
            last = s + k - 1
            vs = list(range(at, at + k - 1))
            for j in range(k - 1):
                lb[at + j], ub[at + j] = rg[j]
                obj[at + j] = (w[last] - w[s + j]) / dp
            indices += [last, *vs]
            data += [-1.0] * k
            indptr.append(len(indices))
            clo.append(-inf)
            cup.append(-total)
            indices += vs
            data += [1.0] * (k - 1)
            indptr.append(len(indices))
            clo.append(total - rg[-1][1])
            cup.append(total - rg[-1][0])
            for j in range(k - 1):
                indices += [s + j, at + j]
                data += [-1.0, 1.0]
                indptr.append(len(indices))
                clo.append(-inf)
                cup.append(0.0)
            at += k - 1
        mat = csr_matrix((np.array(data), np.array(indices, dtype=np.int32), np.array(indptr, dtype=np.int32)),
                         shape=(len(clo), nv))
        model = mbh.ModelBuilderHelper()
        model.fill_model_from_sparse_data(np.array(lb), np.array(ub), np.array(obj), np.array(clo), np.array(cup), mat)
        lp = mbh.ModelSolverHelper("glop")
        lp.solve(model)
        if lp.status() != mbh.SolveStatus.OPTIMAL:
            return -1.0
        sol = lp.variable_values().tolist()
        at = S
        for t, (s, _, rg, total) in zip(at_p, wins, strict=True):
            k = len(rg)
            z = sol[at : at + k - 1]
            at += k - 1
            for j, x in enumerate(z):
                cols[s + j].append(x)
            cols[s + k - 1].append(total - sum(z))
            if aims is not None:
                aims[t] = [*z, total - sum(z)]
        return sum(sum(col) / dp / max(col) if max(col) > 0 else 1.0 for col in cols) / S

    def rows(self, P: list[tuple[Cell, int]]) -> list[list[Cell]] | None:
        """Placements back to replicas' rows (each placement on a replica whose slots so
        far end where it starts), or None when they do not tile dp x S."""
        rows: list[list[Cell]] = [[] for _ in range(self.dp)]
        free = [0] * self.dp
        for c, s in sorted(P, key=lambda p: (p[1], -p[0].k)):
            r = next((q for q in range(self.dp) if free[q] == s), None)
            if r is None:
                return None
            rows[r].append(c)
            free[r] = s + c.k
        return rows if all(f == self.S for f in free) else None


def _place_on(S: int, freed: list[int], new: list[Cell], rng: random.Random) -> list[int] | None:
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


def _propose(M: _Columns, P: list[tuple[Cell, int]], live: list[int], rng: random.Random):
    """One random neighbour of placements P (None when the draw does not give one): a tree
    swapped between two cells, a tree moved from one cell into another (shapes and slots
    kept), or the trees of two cells re-split into one or two new cells of at most
    `_SA_MAX_K` slots laid on the slots they free."""
    i, j = rng.sample(live, 2)
    (a, sa), (b, sb) = P[i], P[j]
    u = rng.random()
    if u < _SA_MOVES[0]:
        x, y = rng.choice(a.trees), rng.choice(b.trees)
        ca = M.cell_for(a.k, [t for t in a.trees if t != x] + [y])
        cb = ca and M.cell_for(b.k, [t for t in b.trees if t != y] + [x])
        if cb is None:
            return None
        Q = list(P)
        Q[i], Q[j] = (ca, sa), (cb, sb)
        return Q
    if u < _SA_MOVES[0] + _SA_MOVES[1]:
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
    for _ in range(_SA_TRIES):
        g = [t for t in pool if rng.random() < 0.5]
        h = [t for t in pool if t not in g]
        groups = [x for x in (g, h) if x]
        if len(groups) == 1:
            ks = [n]
        else:
            k1 = rng.randint(1, n - 1)
            ks = [k1, n - k1]
        if any(k > _SA_MAX_K for k in ks):
            continue
        new = []
        for grp, k in zip(groups, ks, strict=True):
            c = M.cell_for(k, grp)
            if c is None:
                break
            new.append(c)
        if len(new) != len(groups):
            continue
        at = _place_on(M.S, freed, new, rng)
        if at is not None:
            return [p for t, p in enumerate(P) if t not in (i, j)] + list(zip(new, at, strict=True))
    return None


# `_swap_trees`: rounds of single-tree swaps; per round the `_SWAP_SHORTLIST` swaps that
# most even the placements' loads against the slots' means are scored by the re-cut LP
# with the old cells' ranges moved to the new cells' loads, the best `_SWAP_EXACT` of
# them again with the new cells' own ranges
_SWAP_ROUNDS = 2
_SWAP_SHORTLIST = 6
_SWAP_EXACT = 2


class _Shifted:
    """Stand-in for a cell in `_Columns.score`: a solved cell's loads with the ranges of
    the cell it replaces, moved by the difference in each slot's load (no re-cuts)."""

    def __init__(self, k: int):
        self.k = k


def _swap_trees(rows: list[list[Cell]], solver: _CellSolver, rounds: int = _SWAP_ROUNDS,
                shortlist: int = _SWAP_SHORTLIST, exact: int = _SWAP_EXACT) -> list[list[Cell]]:
    """Swap one tree between two cells of the step (pp = 1), shapes and slots kept: the
    joint re-cut can only move load inside a window, so a cell that is heavier over its
    slots than the other replicas' slots there (trees near the budget leave a window
    little room) keeps those slots' peaks; a tree of it traded for a lighter tree of a
    cell that is light over its own slots evens both. Per round, the swaps that most
    lower the placements' summed |load - the slots' mean loads over their span| are
    scored by the re-cut LP (`_Columns.score`, the critical path capped at today's),
    first with each new cell's ranges taken as the old cell's moved by the change in its
    slot loads (`shortlist` of them), then the best `exact` with their own ranges; the
    best swap is taken when it raises the LP's balance. The result is re-cut (`_recut`)
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
    M = _Columns(rows, solver, crit)
    P = list(M.P)
    where = [(r, i) for r, row in enumerate(rows) for i in range(len(row))]
    cur = M.score(P)
    if cur < 0:
        return rows

    def solved(k: int, trees: list[int]) -> Cell | None:
        c = solver.solved(k, sorted(trees, key=lambda t: (-cost[t], t)))
        return c if c is not None and len(c.bins) == k and all(c.bins) else None

    def shifted(old: Cell, new: Cell) -> _Shifted:
        _, ld, rg, _ = M.info[id(old)]
        nl = solver.loads(new)
        if rg is not None:
            rg = [(lo + b - a, hi + b - a) for (lo, hi), a, b in zip(rg, ld, nl, strict=True)]
        proxy = _Shifted(new.k)
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
    cand = _recut(new_rows, solver, cap=crit, ranges=lambda c: M.info[id(c)][2])
    now = _slot_balances(vecs)
    new = _slot_balances([[x for c in row for x in solver.loads(c)] for row in cand])
    if (_critical_path(cand, solver) <= crit * (1 + 1e-12)
            and sum(new) / len(new) > sum(now) / len(now) + 1e-12
            and np.percentile(new, 5) >= np.percentile(now, 5) - 1e-12):
        return cand
    return rows


def _search_windows(rows: list[list[Cell]], solver: _CellSolver, evaluations: int,
                    seed: int) -> list[list[Cell]]:
    """Re-form the step's cells by simulated annealing (pp = 1): placements (cell, first
    slot) change by swapping or moving a tree between two cells or re-splitting two cells'
    trees into new cells on the slots they free (`_propose`), each neighbour scored by
    the joint re-cut's linear program (`_Columns.score`, the critical path capped at
    today's), `evaluations` of them (deterministic for a seed). The best layout is
    realised with `_recut` and returned when its critical path is no longer, its slot
    balance higher and the 5th percentile of its per-slot balances no lower; else `rows`.
    Every tree stays in exactly one cell, so every row is still computed once."""
    vecs = [[x for c in row for x in solver.loads(c)] for row in rows]
    if len(rows) < 2 or evaluations <= 0 or any(len(v) != len(vecs[0]) for v in vecs):
        return rows
    crit = sum(map(max, *vecs))
    M = _Columns(rows, solver, crit)
    P = M.P
    live = [t for t, (c, _) in enumerate(P) if c.trees]
    if len(live) < 2:
        return rows
    rng = random.Random(seed)
    cur = best = M.score(P)
    top: list[tuple[float, int, list[tuple[Cell, int]]]] = []  # the best layouts met
    temp = _SA_T0
    n = tries = 0
    while n < evaluations and tries < 20 * evaluations:
        tries += 1
        Q = _propose(M, P, live, rng)
        if Q is None:
            continue
        n += 1
        got = M.score(Q)
        if got >= 0 and (got > cur or rng.random() < math.exp((got - cur) / temp)):
            P, cur = Q, got
            live = [t for t, (c, _) in enumerate(P) if c.trees]
            if got > best:
                best = got
                top = sorted([*top, (-got, n, Q)], key=lambda x: x[:2])[:_SA_REALISE]
        temp = max(temp * _SA_DECAY, _SA_TMIN)
    # the re-cut may miss the model (windows at the budget): the best few layouts are
    # realised, the best that passes kept
    now = _slot_balances(vecs)
    out, out_bal = rows, sum(now) / len(now) + 1e-12
    for _, _, Q in top:
        cand = M.rows(Q)
        if cand is None:
            continue
        cand = _recut(cand, solver, cap=crit, ranges=lambda c: M.info[id(c)][2])
        new = _slot_balances([[x for c in row for x in solver.loads(c)] for row in cand])
        if (_critical_path(cand, solver) <= crit * (1 + 1e-12)
                and sum(new) / len(new) > out_bal
                and np.percentile(new, 5) >= np.percentile(now, 5) - 1e-12):
            out, out_bal = cand, sum(new) / len(new)
    return out


def _min_microbatches(cells: list[list[Cell]]) -> int:
    """The fewest non-producer microbatches on any replica."""
    return min(sum(1 for c in row for b in c.bins if b) for row in cells)


def _to_microbatches(idx: ForestIndex, cells: list[list[Cell]]) -> list[TreeMB]:
    mbs: list[TreeMB] = []
    for r, row in enumerate(cells):
        slot0 = 0
        order = 0
        for c in row:
            trunk = set(c.trunk)
            has_p = bool(c.trunk) or any(it.shaved_tokens for b in c.bins for it in b)
            prod: TreeMB | None = None
            prod_id = -1
            if has_p:
                prod = TreeMB()
                for v in c.trunk:
                    prod.add_node(idx, v)
                    prod.trajs.extend(idx.ends_here[v])
            for b in range(c.k):
                if not c.bins[b]:
                    continue
                m = TreeMB()
                for it in c.bins[b]:
                    _add_item(idx, m, prod, it, trunk)
                if m.context:
                    if prod_id < 0:
                        prod.replica, prod.slot, prod.order = r, slot0 + b, order
                        order += 1
                        prod_id = len(mbs)
                        mbs.append(prod)
                    m.producer = prod_id
                m.replica, m.slot, m.order = r, slot0 + b, order
                order += 1
                mbs.append(m)
            slot0 += c.k
    return mbs


def _add_item(idx: ForestIndex, m: TreeMB, prod: TreeMB | None, it: Item, trunk: set[int]) -> None:
    """Rows of item `it` to consumer m (context from the producer), its prefix to prod."""
    for u in it.full:
        prod.add_node(idx, u)
        m.context[u] = (0, idx.length[u])
    if it.cut_node >= 0:
        u, o = it.cut_node, it.cut_off
        prod.rows[u] = (0, o)
        prod.tokens += o
        m.context[u] = (0, o)
        m.rows[u] = (o, idx.length[u])
        m.tokens += idx.length[u] - o
    skip = set(it.full)
    for u in range(it.root, idx.sub_end[it.root] + 1):
        if u not in skip and u != it.cut_node:
            m.add_node(idx, u)
    m.trajs.extend(idx.trajs_in_subtree(it.root))
    u = idx.parent[it.root]
    while u >= 0 and u in trunk and u not in m.context:
        m.context[u] = (0, idx.length[u])
        u = idx.parent[u]


def _group_options(slots: int) -> list[int]:
    out, m = [], 1
    while m <= slots:
        out.append(m)
        m = m + 1 if m < 4 else m * 2
    return out


def _search(
    idx: ForestIndex,
    solver: _CellSolver,
    config: PlanConfig,
    slot_range: range,
    ideal: float,
    min_microbatches: int = 1,
) -> tuple[float, int, int, list[list[Cell]]] | None:
    """The best (critical path, slots, cells per replica, cells) over `slot_range` among
    plans with at least `min_microbatches` non-producer microbatches on every replica;
    stops at a near-ideal critical path or after two slot counts that work."""
    best = None
    feasible_slots = 0
    for slots in slot_range:
        found = 0
        for groups in _group_options(slots):
            # trees dealt cell by cell, and with replica-aware ties (which spreads large
            # trees over replicas when cells tie, as when most trees need windows): the
            # shorter critical path wins (with a pipeline both are replica-aware)
            for by_replica in ((False, True) if config.pp <= 1 else (False,)):
                cells = _build(idx, solver, config.dp, slots, groups, by_replica)
                if cells is None or (min_microbatches > 1 and _min_microbatches(cells) < min_microbatches):
                    continue
                found += 1
                crit = _critical_path(cells, solver, config.pp)
                if best is None or crit < best[0] * (1 - 1e-9):
                    best = (crit, slots, groups, cells)
        feasible_slots += bool(found)
        # a near-ideal plan, or two slot counts that work, ends the search
        if best is not None and (best[0] <= ideal * (1 + _GOOD_ENOUGH) or feasible_slots >= 2):
            break
    return best


@register_planner(PlannerName.L1L2)
def plan_l1l2(forest: RolloutForest, config: PlanConfig) -> Plan:
    idx = ForestIndex(forest, config.cost_model)
    budget = config.microbatch_tokens
    l1_mbs, _ = l1_microbatches(idx, config)
    l1_slots = math.ceil(len(l1_mbs) / config.dp)
    lower = max(1, math.ceil(forest.compact_tokens / (config.dp * budget)))
    solver = _CellSolver(idx, config)
    # the critical path can be no shorter than an even split of all the step's work
    ideal = (sum(idx.sub_cost[r] for r in idx.roots) + config.cost_model.microbatch_overhead) / config.dp
    if config.pp > 1:
        # as pipelined: fill and drain are (pp - 1) passes of 1/pp of an even slot's load
        ideal = ideal * (1 + (config.pp - 1) / max(lower, config.target_microbatches)) / config.pp
    # with a pipeline, at least `target` slots (microbatches per replica) first: cells of
    # k slots split their trees into a producer and k consumers, so no row is computed
    # twice; when no such plan exists, the slot counts below the target
    target = config.target_microbatches
    best = None
    searched = range(lower, l1_slots + 1)
    if target > lower:
        # slot counts from the floor up, as far as twice it (a few cells of a few slots
        # per replica), or L1's count when that is larger
        searched = range(target, max(l1_slots, 2 * target) + 1)
        best = _search(idx, solver, config, searched, ideal, target)
    if best is None:
        searched = range(lower, l1_slots + 1)
        best = _search(idx, solver, config, searched, ideal)
    if best is not None and config.pp <= 1:
        # line the replicas' slots up by rearranging whole cells (never a longer path)
        cells = best[3]
        # windows re-cut and slots handed over only where the path is not near ideal
        passes = 2 if best[0] > ideal * (1 + _GOOD_ENOUGH) else 1
        for _ in range(passes):
            cells = _relevel(_arrange(_reshape(cells, solver), solver), solver) if passes > 1 else _arrange(cells, solver)
            crit = _critical_path(cells, solver)
            if not crit < best[0] * (1 - 1e-9):
                break
            best = (crit, best[1], best[2], cells)
        if passes > 1:
            # all windows re-cut together (a path no longer, the slots better balanced)
            cells = _recut(best[3], solver)
            # the same, with runs of single trees merged into windows first: kept when
            # its path is no longer, its slots better balanced and its least balanced
            # slots (5th percentile) no worse
            merged = _merge_runs(best[3], solver)
            if merged is not None:
                alt = _recut(_arrange(merged, solver), solver)
                now, new = (_slot_balances([[x for c in row for x in solver.loads(c)] for row in r])
                            for r in (cells, alt))
                if (_critical_path(alt, solver) <= _critical_path(cells, solver) * (1 + 1e-12)
                        and sum(new) / len(new) > sum(now) / len(now) + 1e-12
                        and np.percentile(new, 5) >= np.percentile(now, 5) - 1e-12):
                    cells = alt
            cells = _swap_trees(cells, solver)
            if config.search_evaluations > 0:
                cells = _search_windows(cells, solver, config.search_evaluations, config.seed)
            best = (_critical_path(cells, solver), best[1], best[2], cells)
    # L1's own microbatches (recomputed paths, no windows) compete on the same measure
    place(l1_mbs, config.dp)
    l1_loads = [[0.0] * l1_slots for _ in range(config.dp)]
    for m in l1_mbs:
        l1_loads[m.replica][m.slot] += config.cost_model.microbatch_overhead + m.cost
    l1_ends = [pipeline_ends(row, config.cost_model.forward_fraction) for row in l1_loads]
    l1_crit = pipelined_critical_path(l1_loads, config.pp, l1_ends)
    pipe = {"pp": config.pp, "target_microbatches": target} if config.pp > 1 else {}
    # a plan that meets the pipeline's floor is only displaced by an L1 plan that does too
    l1_floor = min(sum(1 for x in row if x > 0) for row in l1_loads) >= target
    floor_met = best is not None and target > lower and _min_microbatches(best[3]) >= target
    if best is None or ((l1_floor or not floor_met) and l1_crit < best[0] * (1 - 1e-9)):
        return finalize_tree(idx, l1_mbs, config, PlannerName.L1L2.value, {"chosen": "l1", **pipe})
    _, slots, groups, cells = best
    mbs = _to_microbatches(idx, cells)
    info = {
        "slots_considered": [searched.start, searched.stop - 1],
        "cells_per_replica": groups,
        "producers": len({m.producer for m in mbs if m.producer is not None}),
        "producer_tokens": sum(c.p_tokens() for row in cells for c in row),
        **pipe,
    }
    return finalize_tree(idx, mbs, config, PlannerName.L1L2.value, info)
