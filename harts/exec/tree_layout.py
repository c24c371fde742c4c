"""A microbatch's local layout and its KDA schedules: the host-side data of tree execution
(no autograd), built ahead of a step and read by `harts.exec.tree.TreeContext`.

A `LocalLayout` is a microbatch's computed rows plus the *context* rows it reads from a
producer (sharing windows). A `KDASchedule` is the rounds of packed chunkwise calls that
cover its computed rows: `replay_schedule` (the minimum-call plan of
`harts.plan.kda_calls`, sequences starting on their trajectories' chunk grids; for a
plan's microbatch `plan_replay_schedule` builds the same from the plan's own call plans,
`harts.plan.step.plan_kda_calls_of`) or `node_schedule` (the no-replay ablation). `chunk_state_of` names the round and index of
the chunk-boundary state a sequence hands on at a position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from harts.plan.kda_calls import KDACallPlan, plan_kda_calls
from harts.plan.step import MicrobatchKDACalls
from harts.tree.forest import RolloutForest

ZERO_STATE = -1
EXTERNAL_STATE = -2


def _sorted_unique(a) -> np.ndarray:
    """np.unique for int64 row ids, skipping the work when they already ascend strictly
    (the usual case: layouts list rows in DFS order)."""
    a = np.asarray(a, dtype=np.int64).reshape(-1)
    if a.size < 2 or bool((a[1:] > a[:-1]).all()):
        return a
    return np.unique(a)


@dataclass(frozen=True, eq=False)
class LocalLayout:
    """The rows one microbatch touches, in DFS order, with its path structure."""

    rows: np.ndarray  # int64 [L]: global compact row ids, ascending
    computed: np.ndarray  # bool [L]: computed here (else read from the producer)
    parent: np.ndarray  # int64 [L]: local index of the previous row on the path, -1 at a root
    end: np.ndarray  # int64 [L]: local index of the last row of the row's subtree
    position: np.ndarray  # int64 [L]: depth

    @classmethod
    def of_rows(cls, forest: RolloutForest, computed_rows: np.ndarray,
                context_rows: np.ndarray | None = None) -> LocalLayout:
        computed_rows = _sorted_unique(computed_rows)
        context_rows = _sorted_unique(context_rows if context_rows is not None else [])
        if context_rows.size == 0:  # a whole forest or a producer: no set algebra needed
            rows, computed = computed_rows, np.ones(computed_rows.size, dtype=bool)
        else:
            if np.intersect1d(computed_rows, context_rows, assume_unique=True).size:
                raise ValueError("a row cannot be both computed and read from the producer")
            rows = np.sort(np.concatenate([computed_rows, context_rows]))
            computed = np.isin(rows, computed_rows, assume_unique=True)
        gparent = forest.row_parent[rows]
        local_parent = np.searchsorted(rows, gparent)
        has = gparent >= 0
        ok = np.zeros(rows.size, dtype=bool)
        ok[has] = (local_parent[has] < rows.size) & (rows[np.minimum(local_parent[has], rows.size - 1)] == gparent[has])
        if not (ok | ~has).all():
            bad = int(rows[np.flatnonzero(has & ~ok)[0]])
            raise ValueError(f"row {bad}: its parent row {int(forest.row_parent[bad])} is neither computed "
                             "nor read from the producer")
        parent = np.where(has, local_parent, -1)
        if (computed[parent[has & ~computed]]).any():
            raise ValueError("a context row cannot descend from a computed row")
        end = np.searchsorted(rows, forest.row_end[rows], side="right") - 1
        return cls(rows, computed, parent.astype(np.int64), end.astype(np.int64),
                   forest.row_position[rows].astype(np.int64))

    @classmethod
    def full(cls, forest: RolloutForest) -> LocalLayout:
        return cls.of_rows(forest, np.arange(forest.num_rows))

    @property
    def num_rows(self) -> int:
        return int(self.rows.size)

    @property
    def computed_index(self) -> np.ndarray:
        return np.flatnonzero(self.computed)

    @property
    def context_index(self) -> np.ndarray:
        return np.flatnonzero(~self.computed)

    def ancestor(self, row: int, steps: int) -> int:
        for _ in range(steps):
            row = int(self.parent[row])
        return row


@dataclass(frozen=True)
class KDARound:
    """One packed call: which local rows go in, which outputs come out, where states come from."""

    gather_rows: np.ndarray  # int64 [Tr]: local rows, sequence after sequence
    cu_seqlens: np.ndarray  # int64 [Sr + 1]
    keep: np.ndarray  # int64: positions in gather_rows whose outputs are written
    # per sequence: ZERO_STATE, EXTERNAL_STATE or the round whose handed states it starts from
    init_round: np.ndarray  # int64 [Sr]
    init_index: np.ndarray  # int64 [Sr]: index into those states / the external states


@dataclass(frozen=True)
class KDASchedule:
    mode: str  # "replay" | "node"
    chunk_size: int
    rounds: tuple[KDARound, ...]
    # states handed to later rounds come from chunk boundaries ("replay") or from each
    # sequence's final state ("node")
    handoff: str  # "chunk" | "final"
    replay_tokens: int
    written_rows: np.ndarray  # int64 [C]: local rows in the order the rounds write them
    # external states this microbatch starts from: (position a, local row at depth a-1)
    external: tuple[tuple[int, int], ...] = ()
    # per local row computed here: the round and state base of its sequence, and the
    # sequence's aligned start (global position); -1 elsewhere. Lets a consumer ask this
    # microbatch for S(a) at any chunk boundary on its rows.
    row_round: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    row_state_base: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    row_seq_start: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)


def _segments(layout: LocalLayout) -> tuple[np.ndarray, np.ndarray]:
    """Maximal fork-free runs of computed rows: (first local row, last local row) each."""
    L = layout.num_rows
    kids = np.bincount(layout.parent[layout.parent >= 0], minlength=L)
    idx = np.arange(L)
    prev = idx - 1
    starts = (
        (idx == 0)
        | (layout.parent != prev)
        | (np.r_[True, kids[:-1] != 1] if L else np.zeros(0, bool))
        | (layout.computed != np.r_[~layout.computed[:1], layout.computed[:-1]])
    )
    first = np.flatnonzero(starts & layout.computed)
    # a segment runs until the next segment start
    all_starts = np.flatnonzero(starts)
    nxt = np.searchsorted(all_starts, first, side="right")
    last = np.where(nxt < all_starts.size, all_starts[np.minimum(nxt, all_starts.size - 1)] - 1, L - 1)
    return first, last


def replay_schedule(layout: LocalLayout, chunk_size: int = 64) -> KDASchedule:
    """The minimum-call plan over the computed rows of a layout, as gather/scatter indices.

    Each tree of computed rows whose root starts at depth s > 0 (below context rows) is
    planned in coordinates shifted by its aligned start a = floor(s/B)*B — a multiple of B,
    so chunk grids are unchanged — with a virtual first node covering the replayed context
    rows [a, s); its S(a) is an external state (zeros when a = 0).
    """
    B = chunk_size
    first, last = _segments(layout)
    seg_of_row = np.full(layout.num_rows, -1, dtype=np.int64)
    for i, (f, l_) in enumerate(zip(first.tolist(), last.tolist(), strict=True)):
        seg_of_row[f : l_ + 1] = i
    # planner arrays (preorder: local order of segments is DFS order)
    n_parent, n_start, n_end, n_rows, n_shift, n_virtual = [], [], [], [], [], []
    root_ext: dict[int, int] = {}  # planner root node -> external state index or ZERO_STATE
    external: list[tuple[int, int]] = []
    node_of_seg = {}
    for i, (f, l_) in enumerate(zip(first.tolist(), last.tolist(), strict=True)):
        par_row = int(layout.parent[f])
        s = int(layout.position[f])
        if par_row >= 0 and layout.computed[par_row]:
            parent = node_of_seg[int(seg_of_row[par_row])]
            shift = n_shift[parent]
        else:
            # a tree of computed rows: plan it shifted by its aligned start
            shift = s // B * B
            if shift > 0:
                external.append((shift, layout.ancestor(f, s - shift + 1)))
                ext = len(external) - 1
            else:
                ext = ZERO_STATE
            parent = -1
            if s > shift:
                # the replayed context rows [a, s) as a virtual node heading the tree
                root_ext[len(n_parent)] = ext
                n_parent.append(-1)
                n_start.append(0)
                n_end.append(s - shift)
                n_rows.append(np.asarray([layout.ancestor(f, k) for k in range(s - shift, 0, -1)], np.int64))
                n_shift.append(shift)
                n_virtual.append(True)
                parent = len(n_parent) - 1
            else:
                root_ext[len(n_parent)] = ext
        node_of_seg[i] = len(n_parent)
        n_parent.append(parent)
        n_start.append(s - shift)
        n_end.append(int(layout.position[l_]) + 1 - shift)
        n_rows.append(np.arange(f, l_ + 1, dtype=np.int64))
        n_shift.append(shift)
        n_virtual.append(False)
    plan = plan_kda_calls(np.asarray(n_parent, np.int64), np.asarray(n_start, np.int64),
                          np.asarray(n_end, np.int64), B)
    return _replay_rounds(layout, plan, n_parent, n_rows, n_shift, n_virtual, root_ext, external)


def plan_replay_schedule(layout: LocalLayout, forest: RolloutForest, kda: MicrobatchKDACalls) -> KDASchedule:
    """`replay_schedule` of a plan's microbatch from the plan's own KDA call plan
    (`harts.plan.step.plan_kda_calls_of`, made once per plan and shared with the simulator)
    instead of planning the layout's segments again: the planner nodes are the
    microbatch's pieces (a fork-free run of them continues one chain, as one segment
    would) and a virtual node of replayed context rows before each entry that starts
    mid-chunk. `layout` holds the pieces' rows (and its context rows); the schedule is
    `replay_schedule(layout, kda.chunk_size)`, array for array."""
    if kda.calls is None:  # nothing computed here
        return replay_schedule(layout, kda.chunk_size)
    calls = kda.calls
    rs = forest.node_row_start
    n_parent = calls.node_parent.tolist()
    n_rows, n_shift, n_virtual = [], [], []
    root_ext: dict[int, int] = {}  # planner root node -> external state index or ZERO_STATE
    external: list[tuple[int, int]] = []
    for k, (i, shift) in enumerate(zip(kda.node_piece.tolist(), kda.node_shift.tolist(), strict=True)):
        # a virtual node heads the entry piece right after it
        v, a, b = kda.pieces[i if i >= 0 else int(kda.node_piece[k + 1])]
        f = int(np.searchsorted(layout.rows, int(rs[v]) + a))  # the piece's first local row
        if i >= 0:
            n_rows.append(np.arange(f, f + b - a, dtype=np.int64))
        else:
            # the replayed context rows [a, s) above the entry
            n_rows.append(np.asarray([layout.ancestor(f, j) for j in range(int(calls.node_end[k]), 0, -1)],
                                     np.int64))
        if n_parent[k] < 0:
            # a tree of computed rows, planned shifted by its aligned start: S(a) is external
            # (zeros when a = 0)
            if shift > 0:
                external.append((shift, layout.ancestor(f, int(layout.position[f]) - shift + 1)))
                root_ext[k] = len(external) - 1
            else:
                root_ext[k] = ZERO_STATE
        n_shift.append(shift)
        n_virtual.append(i < 0)
    return _replay_rounds(layout, calls, n_parent, n_rows, n_shift, n_virtual, root_ext, external)


def _replay_rounds(layout: LocalLayout, plan: KDACallPlan, n_parent: list[int], n_rows: list[np.ndarray],
                   n_shift: list[int], n_virtual: list[bool], root_ext: dict[int, int],
                   external: list[tuple[int, int]]) -> KDASchedule:
    """The rounds of a KDA call plan over planner nodes (their local rows, the shift of
    their coordinates, whether they are virtual, the external state of each root) as
    gather/scatter indices."""
    B = plan.chunk_size
    root_of = np.arange(len(n_parent))
    for v in range(len(n_parent)):
        if n_parent[v] >= 0:
            root_of[v] = root_of[n_parent[v]]
    L = layout.num_rows
    row_round = np.full(L, -1, np.int64)
    row_base = np.full(L, -1, np.int64)
    row_start = np.full(L, -1, np.int64)
    state_base: dict[int, tuple[int, int]] = {}
    rounds, written = [], []
    replay_total = 0
    for r, seqs in enumerate(plan.rounds):
        gather, cu, keep, init_r, init_i = [], [0], [], [], []
        num_states = 0
        for s in seqs.tolist():
            chain = plan.chain(s).tolist()
            head = chain[0]
            replay = int(plan.seq_replay[s])
            own_rows = [n_rows[v] for v in chain]
            own_kept = [n_rows[v] for v in chain if not n_virtual[v]]
            replay_rows = [layout.ancestor(int(n_rows[head][0]), k) for k in range(replay, 0, -1)]
            base = len(gather)
            gather.extend(replay_rows)
            n_virt = sum(n_rows[v].size for v in chain if n_virtual[v])
            replay_total += replay + n_virt
            # virtual nodes only ever head a chain, so kept rows follow them contiguously
            gather.extend(np.concatenate(own_rows).tolist())
            keep.extend(range(base + replay + n_virt, len(gather)))
            kept = np.concatenate(own_kept) if own_kept else np.zeros(0, np.int64)
            written.append(kept)
            shift = n_shift[head]
            row_round[kept] = r
            row_base[kept] = num_states
            row_start[kept] = int(plan.seq_start[s]) + shift
            cu.append(len(gather))
            state_base[s] = (r, num_states)
            num_states += (len(gather) - base) // B
            p = int(plan.seq_producer[s])
            if p < 0:
                ext = root_ext[int(root_of[head])]
                init_r.append(ZERO_STATE if ext == ZERO_STATE else EXTERNAL_STATE)
                init_i.append(-1 if ext == ZERO_STATE else ext)
            else:
                pr, pbase = state_base[p]
                init_r.append(pr)
                init_i.append(pbase + (int(plan.seq_start[s]) - int(plan.seq_start[p])) // B - 1)
        rounds.append(KDARound(np.asarray(gather, np.int64), np.asarray(cu, np.int64),
                               np.asarray(keep, np.int64), np.asarray(init_r, np.int64),
                               np.asarray(init_i, np.int64)))
    return KDASchedule("replay", B, tuple(rounds), "chunk", replay_total,
                       np.concatenate(written) if written else np.zeros(0, np.int64),
                       tuple(external), row_round, row_base, row_start)


def node_schedule(forest: RolloutForest, chunk_size: int = 64) -> KDASchedule:
    """The no-replay ablation: one sequence per node, started from its parent's final state."""
    level = forest.node_level
    rs = forest.node_row_start
    rounds = []
    written = []
    index_in_round: dict[int, int] = {}
    for lv in range(int(level.max()) + 1 if forest.num_nodes else 0):
        nodes = np.flatnonzero(level == lv)
        gather, cu, init_r, init_i = [], [0], [], []
        for i, v in enumerate(nodes.tolist()):
            gather.extend(range(int(rs[v]), int(rs[v + 1])))
            cu.append(len(gather))
            index_in_round[v] = i
            p = int(forest.node_parent[v])
            init_r.append(ZERO_STATE if p < 0 else lv - 1)
            init_i.append(-1 if p < 0 else index_in_round[p])
        g = np.asarray(gather, np.int64)
        written.append(g)
        rounds.append(KDARound(g, np.asarray(cu, np.int64), np.arange(g.size, dtype=np.int64),
                               np.asarray(init_r, np.int64), np.asarray(init_i, np.int64)))
    return KDASchedule("node", chunk_size, tuple(rounds), "final", 0,
                       np.concatenate(written) if written else np.zeros(0, np.int64))


def chunk_state_of(schedule: KDASchedule, local_row: int, position: int) -> tuple[int, int]:
    """S(position) on the path through `local_row` (the row at depth position-1), as the
    replay round that computed that row and the index into that round's full list of
    chunk-boundary states (KDAOutput.chunk_states numbering)."""
    r = int(schedule.row_round[local_row]) if 0 <= local_row < schedule.row_round.size else -1
    if r < 0:
        raise ValueError(f"local row {local_row} is not computed by a replay round")
    start = int(schedule.row_seq_start[local_row])
    B = schedule.chunk_size
    if position % B or position <= start:
        raise ValueError(f"S({position}) is not a chunk boundary of the sequence starting at {start}")
    return r, int(schedule.row_state_base[local_row]) + (position - start) // B - 1
