"""`CellSolver`: solves one cell (its items on its k slots, levelled by shaving), re-cuts a
solved cell toward per-slot loads (`relevel`), and prices cells (`loads`, `ends`).

Sharing is the balancing lever: the overshoot of a slot is *shaved*, a DFS prefix of one
of its items cut on the KDA chunk grid moving into the window's producer (a DFS prefix is
ancestor-closed, so the item's remaining rows read it as context). Moved work reappears,
split `forward_fraction : 1 - forward_fraction`, in the first and last slots, where the
producer's forward and backward run; a last shave from one end solves the two end
equations (their sum is fixed by conservation), so every slot of the cell carries its
target up to one chunk of work.

Budget: every microbatch of a window holds its rows plus `producer_retention` x the
producer's rows, and the producer itself fits the budget (`fits`). When the full levelling
does not fit, the largest fraction of it that does is applied (bisection,
`apply_fitting`). A tree over the budget whose producer and one consumer each fit runs as
a 1-slot window (`alone`). Solved cells are memoised (`solved`), since candidate plans of
several slot counts share many cells."""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

from harts.plan.planners.common import ForestIndex, PlanConfig
from harts.plan.planners.l1l2.cell import Cell, Item
from harts.plan.planners.l1l2.fill import fill_levelled, fill_unlevelled

# shave at most this share of an item (its last rows always stay with the consumer)
MAX_SHAVE = 0.95


class CellSolver:
    """Solves, re-cuts and prices cells of one forest under one config; memoises what
    the stages ask for again (solved cells, chunk-grid cut costs, window ranges)."""

    def __init__(self, idx: ForestIndex, config: PlanConfig):
        self.idx = idx
        self.cm = config.cost_model
        self.budget = config.microbatch_tokens
        self.rho = config.producer_retention
        self.ff = config.cost_model.forward_fraction
        self.overhead = config.cost_model.microbatch_overhead
        self.chunk = config.chunk_size
        self.pp = config.pp
        # one replica and no pipeline: the slots run one after another on one device, so
        # how a cell's load splits between them does not change the step's time, only its
        # peak memory (see `solve`)
        self.sequential = config.dp <= 1 and config.pp <= 1
        self._alone: frozenset[int] | None = None
        self._chunks: dict[int, tuple[list[int], list[float]]] = {}
        self._first: dict[int, float] = {}  # `first_chunk_cost` per node
        self._solved: dict[tuple[int, tuple[int, ...]], Cell | None] = {}
        # `window_ranges` per cell (by identity; the cell is kept so its id stays its own)
        self.range_memo: dict[tuple[int, int], tuple[Cell, list[tuple[float, float]] | None]] = {}
        # `window_ranges` by what the re-cuts start from (shared by re-cut copies)
        self.range_memo_by_start: dict[tuple, list[tuple[float, float]] | None] = {}

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

    def chunk_costs(self, u: int) -> tuple[list[int], list[float]]:
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

    def offset_for(self, u: int, want: float) -> tuple[int, float]:
        """Largest chunk-aligned offset o in [0, length) of node u whose rows [0, o) cost
        at most `want` (the cut lands on a multiple of the chunk size in depth), and the
        cost of those rows."""
        offsets, costs = self.chunk_costs(u)
        n = bisect_right(costs, want)
        return (offsets[n - 1], costs[n - 1]) if n else (0, 0.0)

    def shave(self, it: Item, want: float) -> None:
        """Re-cut item `it` so that its shaved DFS prefix costs about `want` (never more,
        never the whole item)."""
        idx = self.idx
        want = min(want, MAX_SHAVE * it.cost)
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
            o, seg = self.offset_for(u, want - it.shaved_cost)
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

    def split_item(self, c: Cell, items: list[Item], it: Item) -> bool:
        idx = self.idx
        v = it.root
        if not idx.children[v] or c.trunk_tokens + idx.length[v] > self.budget:
            return False
        items.remove(it)
        items += [Item(w, idx.sub_cost[w], idx.sub_rows[w]) for w in idx.children[v]]
        c.trunk.append(v)
        c.trunk_cost += idx.node_cost[v]
        c.trunk_tokens += idx.length[v]
        c.hanging.update(idx.children[v])
        return True

    def solve(self, c: Cell) -> bool:
        """Level the cell (every slot at the cell's mean load) when the budget allows,
        trying two ways of filling it; otherwise pack it largest-cost-first into the
        least-loaded slot with token room. Keeps the feasible result with the lowest
        peak load (the first such). On one replica without a pipeline (`sequential`), where
        the slot loads simply add up, the one of least total load with the lowest peak
        memory (`peak_tokens`) instead: the levelled fills shave prefixes into the producer
        to even the slots, which there buys no time and makes every consumer hold a larger
        producer."""
        tried: list[tuple[float, float, int, Cell]] = []
        for attempt in ("cover", "anchor", "lpt", "ffd"):
            trial = Cell(k=c.k, trees=list(c.trees))
            if attempt in ("lpt", "ffd"):
                ok = fill_unlevelled(self, Cell(k=c.k, trees=list(c.trees)), out=trial, ffd=attempt == "ffd")
            else:
                ok = fill_levelled(self, trial, anchored=attempt == "anchor")
            if ok:
                loads = self.loads(trial)
                tried.append((sum(loads), max(loads), trial.p_tokens(), trial))
        if not tried:
            return False
        if self.sequential:
            # the least total load (to rounding), then the lowest peak memory
            least = min(t[0] for t in tried)
            tried = [t for t in tried if t[0] <= least * (1 + 1e-9)]
            best = min(tried, key=lambda t: (self.peak_tokens(t[3]), t[2]))
        else:
            best = min(tried, key=lambda t: (t[1], t[2]))
        trial = best[3]
        c.trunk, c.trunk_cost, c.trunk_tokens = trial.trunk, trial.trunk_cost, trial.trunk_tokens
        c.bins, c.hanging = trial.bins, trial.hanging
        return True

    def mandatory_splits(self, c: Cell, items: list[Item]) -> bool:
        """Split trees too large for one microbatch next to the producer."""
        while True:
            room = self.budget - self.rho * c.trunk_tokens
            big = [it for it in items if it.tokens > room]
            if not big:
                return True
            if not self.split_item(c, items, max(big, key=lambda x: (x.tokens, -x.root))):
                return False

    def split_to_count(self, c: Cell, items: list[Item], k: int) -> bool:
        """Split the largest item with children at its top node (into the producer) while
        there are fewer than k items; False when that cannot reach k. Only with a pipeline
        (without one, a cell with fewer items than slots is given up)."""
        if self.pp <= 1:
            return len(items) >= k
        while len(items) < k:
            forks = [it for it in items if self.idx.children[it.root]]
            if not forks or not self.split_item(c, items, max(forks, key=lambda x: (x.cost, -x.root))):
                return False
        return True

    def shave_plan(self, c: Cell, target: float | list[float]) -> list[tuple[int, float]]:
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
                amount = 1e-9 + self.first_chunk_cost(it.root)
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
                         trunk_tokens=c.trunk_tokens, hanging=set(c.hanging))
            bins = [[Item(it.root, it.cost, it.tokens) for it in b] for b in c.bins]
            if flip:
                bins[0], bins[-1] = bins[-1], bins[0]
            trial.bins = bins
            plan = self.shave_plan(trial, tgt)
            if not self.apply_fitting(trial, plan, steps=steps):
                continue
            miss = sum(abs(a - b) for a, b in zip(self.loads(trial), target, strict=True))
            if best is None or miss < best[0]:
                best = (miss, trial)
        return None if best is None else best[1]

    def apply_fitting(self, c: Cell, plan: list[tuple[int, float]], whole: int = 0, steps: int = 12) -> bool:
        """Apply the largest share of `plan` that fits the budget (bisection); its first
        `whole` steps in full; `steps` bisection steps."""
        self.apply(c, plan, 1.0, whole)
        if self.fits(c):
            return True
        lo, hi = 0.0, 1.0
        for _ in range(steps):
            mid = 0.5 * (lo + hi)
            self.apply(c, plan, mid, whole)
            if self.fits(c):
                lo = mid
            else:
                hi = mid
        self.apply(c, plan, lo, whole)
        return self.fits(c)

    def apply(self, c: Cell, plan: list[tuple[int, float]], lam: float, whole: int = 0) -> None:
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
                        self.shave(it, 1e-9 + self.first_chunk_cost(it.root))

    def peak_tokens(self, c: Cell) -> float:
        """The cell's peak activation memory in token units, as `Plan.memory_tokens` prices
        it: the largest slot's rows plus `producer_retention` x the producer's rows (or the
        producer's own rows, when larger)."""
        p_tokens = c.p_tokens()
        held = self.rho * p_tokens if p_tokens else 0.0
        return max([float(p_tokens)] + [c.bin_tokens(b) + held for b in range(c.k)])

    def fits(self, c: Cell) -> bool:
        p_tokens = c.p_tokens()
        if p_tokens > self.budget:
            return False
        room = self.budget - self.rho * p_tokens
        return all(c.bin_tokens(b) <= room for b in range(c.k))

    def first_chunk_cost(self, v: int) -> float:
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
