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
"""

from __future__ import annotations

import numpy as np

from harts.plan.kda_calls import plan_kda_calls
from harts.plan.plan import Microbatch, Plan, PlanMode
from harts.plan.work import KDARound, MicrobatchWork, StepWork, expanded_microbatch, segment_pairs
from harts.tree.forest import RolloutForest

__all__ = ["step_from_plan", "tree_microbatch_work"]


def tree_microbatch_work(mb: Microbatch, forest: RolloutForest, chunk_size: int = 64) -> MicrobatchWork:
    node_start = forest.node_start
    pieces = sorted(mb.pieces)  # node ids are DFS preorder: parents before children
    n = len(pieces)
    starts = [int(node_start[v]) + a for v, a, _ in pieces]
    ends = [int(node_start[v]) + b for v, _, b in pieces]
    # predecessor piece: the one whose rows end right before this piece's first row on its path
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
    # attention: split components into chains (causal) and trees (ancestor mask)
    children = [0] * n
    for i in range(n):
        if pred[i] >= 0:
            children[pred[i]] += 1
    comp = list(range(n))
    for i in range(n):
        if pred[i] >= 0:
            comp[i] = comp[pred[i]]
    forked = {comp[i] for i in range(n) if children[i] > 1}
    pairs = segment_pairs(np.asarray(starts), np.asarray(ends)) if n else np.zeros(0, dtype=np.int64)
    causal = int(sum(int(pairs[i]) for i in range(n) if comp[i] not in forked))
    tree = int(sum(int(pairs[i]) for i in range(n) if comp[i] in forked))
    # KDA: a forest over the pieces. Each component is shifted down by its entry's aligned
    # start (a multiple of B, so every chunk boundary stays a chunk boundary) and an entry
    # that starts mid-chunk hangs below a virtual root covering the replayed rows: the
    # planned sequence then starts exactly where the real one does, from the handed-off
    # state, in round 0.
    k_parent: list[int] = []
    k_start: list[int] = []
    k_end: list[int] = []
    index = [0] * n
    for i in range(n):
        entry = comp[i]
        shift = starts[entry] - starts[entry] % chunk_size
        if pred[i] < 0 and starts[i] > shift:
            k_parent.append(-1)
            k_start.append(0)
            k_end.append(starts[i] - shift)
            parent = len(k_parent) - 1
        else:
            parent = -1 if pred[i] < 0 else index[pred[i]]
        index[i] = len(k_parent)
        k_parent.append(parent)
        k_start.append(starts[i] - shift)
        k_end.append(ends[i] - shift)
    rounds: tuple[KDARound, ...] = ()
    if n:
        kp = plan_kda_calls(np.asarray(k_parent), np.asarray(k_start), np.asarray(k_end), chunk_size)
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


def step_from_plan(plan: Plan, forest: RolloutForest, chunk_size: int = 64) -> StepWork:
    traj_len = forest.traj_length
    works = []
    for mb in plan.microbatches:
        if plan.mode == PlanMode.EXPANDED:
            w = expanded_microbatch(mb.id, mb.replica, traj_len[list(mb.trajectories)].tolist(), chunk_size,
                                    slot=mb.slot, order=mb.order)
        else:
            w = tree_microbatch_work(mb, forest, chunk_size)
        works.append(w)
    return StepWork(tuple(works), plan.dp, expanded_tokens=int(forest.expanded_tokens), label=plan.planner)
