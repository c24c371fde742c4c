"""The planner's units of work: an `Item` (a subtree in one microbatch, minus a DFS prefix
shaved into its window's producer) and a `Cell` (one replica's run of k consecutive slots,
its items per slot and its producer, which may also compute some items whole). Cells
are built and re-cut by `CellSolver`; once solved a cell is never changed (stages copy
it), so cells may be shared between candidate plans and memoised by identity."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    hanging: set[int] = field(default_factory=set)  # item roots whose parent is a trunk node
    # items the producer computes whole, owning their trajectories (no consumer reads
    # them: not in `p_tokens`, the rows consumers are charged for); set only as a plan is
    # finished (`absorb.take_into_producers`)
    taken: list[Item] = field(default_factory=list)

    def p_cost(self) -> float:
        return (self.trunk_cost + sum(it.shaved_cost for b in self.bins for it in b)
                + sum(it.cost for it in self.taken))

    def p_tokens(self) -> int:
        return self.trunk_tokens + sum(it.shaved_tokens for b in self.bins for it in b)

    def bin_cost(self, b: int) -> float:
        return sum(it.left_cost for it in self.bins[b])

    def bin_tokens(self, b: int) -> int:
        return sum(it.left_tokens for it in self.bins[b])

    def reads_producer(self, b: int) -> bool:
        return any(it.shaved_tokens or it.root in self.hanging for it in self.bins[b])
