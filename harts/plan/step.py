"""From a planner's `Plan` (harts.plan.plan) over a forest to the simulator's `StepWork`.

Per microbatch:
- tokens: the rows it computes (`executed_tokens`);
- attention pairs: a row at depth p attends the p + 1 rows of its root path (its own and
  its ancestors', computed here or read from the producer), so a piece covering depths
  [s, e) contributes sum_{p=s}^{e-1} (p + 1) pairs. Pieces of a connected component without
  a fork run as one causal sequence (flash varlen, a prefix read from the producer or an
  earlier piece is a KV prefix); a component with a fork needs the ancestor mask;
- KDA rounds: the minimum-call plan (`harts.plan.kda_calls`) of the pieces it computes. A
  piece whose predecessor row is not computed here (a context row from its producer, or
  a root path computed elsewhere) starts from a handed-off boundary state, available
  before the microbatch starts, so it runs in round 0 and replays s mod B rows of state. Expanded
  microbatches are one round of independent sequences.

A plan's KDA call plans (`plan_kda_calls_of`) are made once per plan: the executor builds
its KDA schedules from the same ones (`harts.exec.tree_layout.plan_replay_schedule`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from harts.plan.kda_calls import KDACallPlan, plan_kda_calls
from harts.plan.plan import Microbatch, Piece, Plan, PlanMode
from harts.plan.work import KDARound, MicrobatchWork, StepWork, expanded_microbatch, segment_pairs
from harts.tree.forest import RolloutForest

__all__ = ["MicrobatchKDACalls", "microbatch_kda_calls", "plan_kda_calls_of", "step_from_plan",
           "tree_microbatch_work"]


@dataclass(frozen=True, eq=False)
class MicrobatchKDACalls:
    """The minimum-call KDA plan of one tree-mode microbatch: `calls` over planner nodes
    that are its pieces (`pieces`, sorted: DFS preorder) and, before each component entry
    that starts mid-chunk, a virtual node covering the replayed rows [a, s) of that entry's
    root path. Planner coordinates are shifted down by the component's aligned start
    (`node_shift`, a multiple of B, so every chunk boundary stays one): the planned
    sequence starts exactly where the real one does, from the handed-off state S(a)."""

    chunk_size: int
    pieces: tuple[Piece, ...]
    node_piece: np.ndarray  # int64 [N]: the piece a planner node is, -1 for a virtual node
    node_shift: np.ndarray  # int64 [N]: the aligned start its component is shifted by
    calls: KDACallPlan | None  # None when the microbatch computes nothing


def _pieces_forest(pieces: tuple[Piece, ...], forest: RolloutForest) -> tuple[list[int], list[int], list[int], list[int]]:
    """(first depth, end depth, predecessor piece or -1, component entry) per sorted piece.
    The predecessor is the piece whose rows end right before this piece's first row on its path."""
    node_start = forest.node_start
    n = len(pieces)
    starts = [int(node_start[v]) + a for v, a, _ in pieces]
    ends = [int(node_start[v]) + b for v, _, b in pieces]
    by_end: dict[tuple[int, int], int] = {}
    for i, (v, _, b) in enumerate(pieces):
        by_end[(v, b)] = i
    parent_node = forest.node_parent
    node_len = forest.node_length
    pred = [-1] * n
    for i, (v, a, _) in enumerate(pieces):
        if a > 0:
            pred[i] = by_end.get((v, a), -1)
        else:
            p = int(parent_node[v])
            if p >= 0:
                pred[i] = by_end.get((p, int(node_len[p])), -1)
    comp = list(range(n))
    for i in range(n):
        if pred[i] >= 0:
            comp[i] = comp[pred[i]]
    return starts, ends, pred, comp


def microbatch_kda_calls(mb: Microbatch, forest: RolloutForest, chunk_size: int = 64) -> MicrobatchKDACalls:
    """The KDA call plan of the pieces `mb` computes (`MicrobatchKDACalls`). A piece whose
    predecessor row is not computed here starts from a handed-off boundary state."""
    pieces = tuple(sorted(mb.pieces))  # node ids are DFS preorder: parents before children
    starts, ends, pred, comp = _pieces_forest(pieces, forest)
    n = len(pieces)
    k_parent: list[int] = []
    k_start: list[int] = []
    k_end: list[int] = []
    k_piece: list[int] = []
    k_shift: list[int] = []
    index = [0] * n
    for i in range(n):
        entry = comp[i]
        shift = starts[entry] - starts[entry] % chunk_size
        if pred[i] < 0 and starts[i] > shift:
            k_parent.append(-1)
            k_start.append(0)
            k_end.append(starts[i] - shift)
            k_piece.append(-1)
            k_shift.append(shift)
            parent = len(k_parent) - 1
        else:
            parent = -1 if pred[i] < 0 else index[pred[i]]
        index[i] = len(k_parent)
        k_parent.append(parent)
        k_start.append(starts[i] - shift)
        k_end.append(ends[i] - shift)
        k_piece.append(i)
        k_shift.append(shift)
    calls = (plan_kda_calls(np.asarray(k_parent), np.asarray(k_start), np.asarray(k_end), chunk_size)
             if n else None)
    return MicrobatchKDACalls(chunk_size, pieces, np.asarray(k_piece, np.int64), np.asarray(k_shift, np.int64),
                              calls)


def _forest_key(forest: RolloutForest) -> bytes:
    """The node structure a plan's KDA calls depend on, as a digest."""
    h = hashlib.blake2b(digest_size=16)
    for a in (forest.node_parent, forest.node_start, forest.node_length):
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return h.digest()


# plan identity -> (a weak reference to the plan, {(chunk size, forest key): calls by microbatch id})
_PLAN_KDA_CALLS: dict[int, tuple[weakref.ref, dict[tuple[int, bytes], dict[int, MicrobatchKDACalls]]]] = {}
_PLAN_KDA_CALLS_LOCK = threading.Lock()


def plan_kda_calls_of(plan: Plan, forest: RolloutForest, chunk_size: int = 64) -> dict[int, MicrobatchKDACalls]:
    """Every tree-mode microbatch's KDA call plan (`microbatch_kda_calls`) by microbatch id,
    computed once per plan (and chunk size and forest structure) and shared by whoever asks:
    the simulator's `step_from_plan` and the executor's KDA schedules
    (`harts.exec.tree_layout.plan_replay_schedule`). Plans are immutable, and the result is
    forgotten with the plan. For an expanded-mode plan only its chain pieces' (microbatches
    with pieces: trajectories longer than its budget)."""
    if plan.mode != PlanMode.TREE and not any(mb.pieces for mb in plan.microbatches):
        return {}
    key = (int(chunk_size), _forest_key(forest))
    pid = id(plan)
    with _PLAN_KDA_CALLS_LOCK:
        entry = _PLAN_KDA_CALLS.get(pid)
        if entry is None or entry[0]() is not plan:
            entry = (weakref.ref(plan, lambda _: _PLAN_KDA_CALLS.pop(pid, None)), {})
            _PLAN_KDA_CALLS[pid] = entry
        memo = entry[1]
        calls = memo.get(key)
        if calls is None:
            calls = memo[key] = {mb.id: microbatch_kda_calls(mb, forest, chunk_size) for mb in plan.microbatches
                                 if plan.mode == PlanMode.TREE or mb.pieces}
    return calls


def tree_microbatch_work(mb: Microbatch, forest: RolloutForest, chunk_size: int = 64,
                         kda: MicrobatchKDACalls | None = None) -> MicrobatchWork:
    """`kda`: the microbatch's KDA call plan where already made (`plan_kda_calls_of`)."""
    pieces = tuple(sorted(mb.pieces))
    n = len(pieces)
    starts, ends, pred, comp = _pieces_forest(pieces, forest)
    # attention: split components into chains (causal) and trees (ancestor mask)
    children = [0] * n
    for i in range(n):
        if pred[i] >= 0:
            children[pred[i]] += 1
    forked = {comp[i] for i in range(n) if children[i] > 1}
    pairs = segment_pairs(np.asarray(starts), np.asarray(ends)) if n else np.zeros(0, dtype=np.int64)
    causal = int(sum(int(pairs[i]) for i in range(n) if comp[i] not in forked))
    tree = int(sum(int(pairs[i]) for i in range(n) if comp[i] in forked))
    # KDA: the minimum-call plan over the pieces (`microbatch_kda_calls`)
    if kda is None:
        kda = microbatch_kda_calls(mb, forest, chunk_size)
    rounds: tuple[KDARound, ...] = ()
    if kda.calls is not None:
        kp = kda.calls
        seq_tokens = kp.seq_end - kp.seq_start
        seq_chunks = -(-seq_tokens // chunk_size)
        rounds = tuple(
            KDARound(int(seq_tokens[ids].sum()), int(seq_chunks[ids].max()), int(ids.size))
            for ids in kp.rounds
            if ids.size
        )
    return MicrobatchWork(
        mb=mb.id,
        replica=mb.replica,
        tokens=int(mb.executed_tokens),
        kda_rounds=rounds,
        attn_pairs_causal=causal,
        attn_pairs_tree=tree,
        producer=mb.producer,
        slot=mb.slot,
        order=mb.order,
        expanded_tokens=int(mb.expanded_tokens),
    )


def outer_stashes_on_host(plan: Plan, device_budgets: float | None = None) -> tuple[set[int], dict[int, int]]:
    """(producers whose stash moves to host memory, reader -> its context rows read from
    there) under the executor's rule for a chain's outer stashes
    (`harts.exec.layouts.plan._WindowRun.outer_stashes_to_host`): a reader's producers above
    its nearest stay on the device, nearest first, while the rows their consumers read sum
    to at most `device_budgets` (default: `KernelConfig.from_env`'s
    `chain_stash_device_budgets`, what a trainer in this environment runs with) microbatch
    budgets. A reader is charged every row of a moved stash its consumers read, a bound on
    its own context's share."""
    parent = {mb.id: mb.producer for mb in plan.microbatches}
    if not any(p is not None and parent[p] is not None for p in parent.values()):
        return set(), {}  # no chain of windows: no stash is outer to any reader
    if device_budgets is None:
        from harts.config.kernels import KernelConfig

        device_budgets = KernelConfig.from_env().chain_stash_device_budgets
    cap = device_budgets * plan.microbatch_tokens
    read: dict[int, int] = {}
    moved: set[int] = set()
    host_rows: dict[int, int] = {}
    for mb in plan.microbatches:
        if mb.producer is None or parent[mb.producer] is None:
            continue
        rows = on_host = 0
        p = parent[mb.producer]
        while p is not None:
            if p not in read:
                read[p] = plan.read_rows(p)
            rows += read[p]
            if rows > cap:
                moved.add(p)
                on_host += read[p]
            p = parent[p]
        if on_host:
            host_rows[mb.id] = on_host
    return moved, host_rows


def step_from_plan(plan: Plan, forest: RolloutForest, chunk_size: int = 64) -> StepWork:
    traj_len = forest.traj_length
    kda = plan_kda_calls_of(plan, forest, chunk_size)
    works = []
    producers = {mb.producer for mb in plan.microbatches if mb.producer is not None}
    moved, host_rows = outer_stashes_on_host(plan)
    for mb in plan.microbatches:
        if plan.mode == PlanMode.EXPANDED and not mb.pieces:
            w = expanded_microbatch(mb.id, mb.replica, traj_len[list(mb.trajectories)].tolist(), chunk_size,
                                    slot=mb.slot, order=mb.order)
        else:
            w = tree_microbatch_work(mb, forest, chunk_size, kda[mb.id])
        if mb.id in producers:
            w = dataclasses.replace(w, read_rows=plan.read_rows(mb.id))
        if mb.context:
            w = dataclasses.replace(w, context_rows=sum(int(p.end - p.start) for p in mb.context))
        if mb.id in moved or mb.id in host_rows:
            w = dataclasses.replace(w, stash_on_host=mb.id in moved, host_context_rows=host_rows.get(mb.id, 0))
        works.append(w)
    return StepWork(tuple(works), plan.dp, expanded_tokens=int(forest.expanded_tokens), label=plan.planner)
