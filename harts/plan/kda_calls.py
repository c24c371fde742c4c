"""Minimum-call planner for chunkwise linear attention (KDA) over a rollout forest.

The call model (DESIGN.md §4). Node v covers token positions [s_v, e_v); chunk size B.
A *sequence* is a downward chain v1 -> ... -> vm run contiguously in one call, starting
at the aligned position a = floor(s_v1 / B) * B: the ancestor tokens [a, s_v1) are
replayed (state only, replay < B) from the initial state S(a) of its root path. A
sequence produces S(c) for every multiple c of B in (a, e_vm]. A *round* is one packed
call; a sequence runs in round r iff S(a) is zeros (a = 0) or was produced in an earlier
round. Every node's own tokens are computed by exactly one sequence, so a plan is fixed
by one choice per node: which child (if any) continues its chain.

Two facts carry the planner (proofs below, and tests/plan/test_kda_calls.py checks both
against exhaustive search on small forests):

1. Replay does not depend on the chain: a sequence starting at node c replays
   s_c mod B tokens whatever chain c branched off. So the total replay R only depends on
   which nodes continue, and it is smallest when every node with children continues
   into one of them.
2. A child c that branches off chain P (aligned start a_P, round r_P) starts a sequence
   in round r_P if s_c < a_P + B (its aligned start is a_P, the same producer as P) and
   in round r_P + 1 otherwise (its S(a) lies inside a node of P). Whether
   s_v < a_P + B for a node v of P is a property of v alone: it holds iff a_P is v's own
   chunk start floor(s_v / B) * B. So every node is in one of two states, IN (v starts
   inside its chain's first chunk) or OUT.

The DP, over nodes in reverse order (children first). f_in(v), f_out(v) = the smallest
possible "rounds after P's round" spent by the sequences started in v's subtree, when v
is in state IN / OUT. Let m1 >= m2 be the two largest f_in over v's children (k1 the
child attaining m1; m2 = -1 if there is one child). Children start at e_v; in state IN
they stay in the first chunk iff e_v < floor(s_v / B) * B + B ("in_v"). Then

    f_out(v) = max(f_out(k1), 1 + m2)          (continue into k1, branch the rest at +1)
    f_in(v)  = m1 if in_v else f_out(v)        (inside the first chunk, branches are free)

and the minimum number of rounds is 1 + max over roots of f_in(root). Proof sketch:
by induction f_in <= f_out <= 1 + f_in. In state OUT, stopping the chain costs 1 + m1;
continuing into k costs max(f_out(k), 1 + max_{c != k} f_in(c)), which for k = k1 is
<= max(1 + m1, 1 + m2) = 1 + m1 and for any other k is >= 1 + m1. In state IN with
in_v every choice costs m1; otherwise IN behaves as OUT. So continuing into k1 is optimal
in both states at once, the choice does not depend on the state, and it never stops a
chain — which by fact 1 also makes R the smallest over *all* plans, not just the
minimum-round ones. Ties in m1 go to the first child in sibling order; they change
neither the round count nor R (nor the number of sequences).

Guaranteed: the minimum number of rounds under this call model; the minimum total replay
R among all plans (hence among minimum-round plans); rounds are as-soon-as-possible;
num_rounds <= 1 + log2(nodes of the largest tree) (f rises to k only at a node with two
children of f_in >= k - 1, so f >= k needs >= 2^k nodes). Not optimised: how tokens balance
across rounds, or anything outside the model (e.g. replaying more than one chunk).

Cost: O(N) time and memory. Three recursions are plain Python loops over lists: the DP
and the chain tails (children first, over nodes) and rounds/producers (parents first, over
sequences); everything else is vectorised numpy. About 1 µs per node (BENCHMARKS.md).

Array legend: `node_*` arrays have one entry per node (length N, node ids are the input
order), `seq_*` arrays one per sequence (length S); `seq_nodes` holds all chains
concatenated, sliced by `seq_offsets` (length S + 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "KDACallPlan",
    "build_kda_plan",
    "plan_kda_calls",
    "plan_kda_calls_for",
]

DEFAULT_CHUNK_SIZE = 64


@dataclass(frozen=True, eq=False)
class KDACallPlan:
    """Sequences, rounds and handoffs for the chunkwise KDA calls over one forest.

    All arrays are read-only int64. Sequence ids order sequences by their first node.
    """

    chunk_size: int
    num_rounds: int
    # Sum over sequences of seq_replay: ancestor tokens recomputed for state only.
    replay_tokens: int
    node_parent: np.ndarray
    node_start: np.ndarray
    node_end: np.ndarray
    # The child that continues the node's chain, -1 where the chain ends.
    node_next: np.ndarray
    # The sequence whose call computes (writes the outputs of) the node.
    node_seq: np.ndarray
    seq_offsets: np.ndarray
    seq_nodes: np.ndarray
    # 0-based round (packed call) the sequence runs in.
    seq_round: np.ndarray
    # Aligned start a = floor(s_v1 / B) * B; the initial state is S(a).
    seq_start: np.ndarray
    # s_v1 - a, in [0, B).
    seq_replay: np.ndarray
    # e_vm: the last position (exclusive) the sequence computes.
    seq_end: np.ndarray
    # The sequence that produces S(a), -1 when a = 0 (zero state).
    seq_producer: np.ndarray
    # rounds[r] = ids of the sequences packed into call r, ascending.
    rounds: tuple[np.ndarray, ...]

    @property
    def num_nodes(self) -> int:
        return len(self.node_parent)

    @property
    def num_sequences(self) -> int:
        return len(self.seq_round)

    @property
    def seq_init_boundary(self) -> np.ndarray:
        """The boundary c whose state S(c) a sequence starts from; always its aligned start."""
        return self.seq_start

    @property
    def seq_head(self) -> np.ndarray:
        """First node v1 of each sequence."""
        return self.seq_nodes[self.seq_offsets[:-1]]

    def chain(self, seq: int) -> np.ndarray:
        """Node ids of sequence `seq`, from v1 down to vm."""
        return self.seq_nodes[self.seq_offsets[seq] : self.seq_offsets[seq + 1]]

    def validate(self) -> None:
        """Check every rule of the call model from the definitions; raise ValueError.

        Independent of how the plan was built: the producer of each initial state is
        found by walking up the root path to the node u with s_u < a <= e_u.
        """
        parent, start, end = _check_forest(
            self.node_parent, self.node_start, self.node_end, self.chunk_size
        )
        B = self.chunk_size
        n = len(parent)
        num_seq = len(self.seq_round)
        for name in ("node_next", "node_seq"):
            if getattr(self, name).shape != (n,):
                raise ValueError(f"{name} must have one entry per node ({n})")
        for name in ("seq_start", "seq_replay", "seq_end", "seq_producer"):
            if getattr(self, name).shape != (num_seq,):
                raise ValueError(f"{name} must have one entry per sequence ({num_seq})")
        offsets, nodes = self.seq_offsets, self.seq_nodes
        if offsets.shape != (num_seq + 1,) or offsets[0] != 0 or offsets[-1] != n:
            raise ValueError("seq_offsets must run from 0 to the number of nodes")
        lengths = np.diff(offsets)
        if (lengths < 1).any():
            raise ValueError(f"sequence {int(np.argmax(lengths < 1))} has no nodes")
        if nodes.shape != (n,) or not np.array_equal(np.sort(nodes), np.arange(n)):
            raise ValueError("seq_nodes must hold every node exactly once")
        owner = np.repeat(np.arange(num_seq), lengths)
        if not np.array_equal(self.node_seq[nodes], owner):
            bad = int(nodes[np.argmax(self.node_seq[nodes] != owner)])
            raise ValueError(f"node {bad}: node_seq disagrees with the chain holding it")
        same_seq = owner[1:] == owner[:-1]
        broken = same_seq & (parent[nodes[1:]] != nodes[:-1])
        if broken.any():
            j = int(np.argmax(broken))
            raise ValueError(
                f"sequence {int(owner[j])}: node {int(nodes[j + 1])} is not a child of "
                f"node {int(nodes[j])}, the node before it in the chain"
            )
        expected_next = np.full(n, -1, dtype=np.int64)
        expected_next[nodes[:-1][same_seq]] = nodes[1:][same_seq]
        if not np.array_equal(self.node_next, expected_next):
            bad = int(np.argmax(self.node_next != expected_next))
            raise ValueError(f"node {bad}: node_next disagrees with the chains")

        heads = nodes[offsets[:-1]]
        tails = nodes[offsets[1:] - 1]
        aligned = start[heads] // B * B
        if not np.array_equal(self.seq_start, aligned):
            bad = int(np.argmax(self.seq_start != aligned))
            raise ValueError(f"sequence {bad}: aligned start is not floor(s_v1 / B) * B")
        replay = start[heads] - aligned
        if not np.array_equal(self.seq_replay, replay) or (replay >= B).any():
            bad = int(np.argmax((self.seq_replay != replay) | (replay >= B)))
            raise ValueError(f"sequence {bad}: replay must be s_v1 - a and < B")
        if not np.array_equal(self.seq_end, end[tails]):
            raise ValueError("seq_end must be the end of each chain's last node")
        if self.replay_tokens != int(replay.sum()):
            raise ValueError(f"replay_tokens {self.replay_tokens} != {int(replay.sum())}")

        rnd = self.seq_round
        if num_seq and rnd.min() < 0:
            raise ValueError("rounds must be >= 0")
        par_l, start_l, end_l = parent.tolist(), start.tolist(), end.tolist()
        node_seq_l = self.node_seq.tolist()
        for q, (head, a) in enumerate(zip(heads.tolist(), aligned.tolist(), strict=True)):
            producer = int(self.seq_producer[q])
            if a == 0:
                if producer != -1:
                    raise ValueError(f"sequence {q} starts at 0 but names producer {producer}")
                continue
            u = par_l[head]
            while not (start_l[u] < a <= end_l[u]):
                u = par_l[u]
            if producer != node_seq_l[u]:
                raise ValueError(
                    f"sequence {q}: S({a}) lies in node {u}, computed by sequence "
                    f"{node_seq_l[u]}, but the plan names producer {producer}"
                )
            if not (self.seq_start[producer] < a <= self.seq_end[producer]):
                raise ValueError(f"sequence {q}: producer {producer} does not reach S({a})")
            if rnd[producer] >= rnd[q]:
                raise ValueError(
                    f"sequence {q} runs in round {int(rnd[q])} but its initial state S({a}) "
                    f"comes from sequence {producer} in round {int(rnd[producer])}"
                )

        expected_rounds = int(rnd.max()) + 1 if num_seq else 0
        if self.num_rounds != expected_rounds or len(self.rounds) != expected_rounds:
            raise ValueError(f"num_rounds and rounds must both be {expected_rounds}")
        listed = np.concatenate(self.rounds) if self.rounds else np.empty(0, np.int64)
        if not np.array_equal(np.sort(listed), np.arange(num_seq)):
            raise ValueError("rounds must list every sequence exactly once")
        for r, ids in enumerate(self.rounds):
            if (rnd[ids] != r).any():
                raise ValueError(f"round {r} lists a sequence of another round")


def plan_kda_calls(
    node_parent: Any, node_start: Any, node_end: Any, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> KDACallPlan:
    """Minimum-round, minimum-replay KDA call plan for a forest (see the module docstring).

    Nodes must list parents before children (DFS preorder is the convention); node_parent
    is -1 for roots, roots start at 0, a child starts where its parent ends, e > s.
    """
    parent, start, end = _check_forest(node_parent, node_start, node_end, chunk_size)
    node_next = _choose_continuations(parent, start, end, chunk_size)
    return _build(parent, start, end, node_next, chunk_size)


def plan_kda_calls_for(forest: Any, chunk_size: int = DEFAULT_CHUNK_SIZE) -> KDACallPlan:
    """plan_kda_calls for any object with node_parent, node_start and node_end arrays."""
    return plan_kda_calls(forest.node_parent, forest.node_start, forest.node_end, chunk_size)


def build_kda_plan(
    node_parent: Any,
    node_start: Any,
    node_end: Any,
    node_next: Any,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> KDACallPlan:
    """The plan for a given continuation choice (node_next[v]: a child of v or -1).

    Rounds are as soon as possible. For ablations: e.g. always continuing into the first
    child shows what the planner's choice saves.
    """
    parent, start, end = _check_forest(node_parent, node_start, node_end, chunk_size)
    nxt = np.asarray(node_next)
    if nxt.shape != parent.shape or not np.issubdtype(nxt.dtype, np.integer):
        raise ValueError("node_next must be an integer array with one entry per node")
    nxt = nxt.astype(np.int64)
    chosen = nxt >= 0
    bad = (nxt < -1) | (nxt >= len(parent))
    bad[chosen & ~bad] = parent[nxt[chosen & ~bad]] != np.flatnonzero(chosen & ~bad)
    if bad.any():
        v = int(np.argmax(bad))
        raise ValueError(f"node_next[{v}] = {int(nxt[v])} is not a child of node {v}")
    return _build(parent, start, end, nxt, chunk_size)


def _check_forest(
    node_parent: Any, node_start: Any, node_end: Any, chunk_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if not isinstance(chunk_size, int | np.integer) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    arrays = []
    for name, x in (
        ("node_parent", node_parent),
        ("node_start", node_start),
        ("node_end", node_end),
    ):
        a = np.asarray(x)
        if a.ndim != 1 or not (np.issubdtype(a.dtype, np.integer) or a.size == 0):
            raise ValueError(f"{name} must be a 1-D integer array")
        arrays.append(a.astype(np.int64))
    parent, start, end = arrays
    n = len(parent)
    if len(start) != n or len(end) != n:
        raise ValueError("node_parent, node_start and node_end must have the same length")
    order_ok = (parent >= -1) & (parent < np.arange(n))
    if not order_ok.all():
        v = int(np.argmax(~order_ok))
        raise ValueError(f"node {v}: parent {int(parent[v])} must be -1 or an earlier node")
    if (end <= start).any():
        v = int(np.argmax(end <= start))
        raise ValueError(f"node {v}: end {int(end[v])} must exceed start {int(start[v])}")
    is_root = parent < 0
    expected_start = np.where(is_root, 0, end[np.where(is_root, 0, parent)])
    if n and not np.array_equal(start, expected_start):
        v = int(np.argmax(start != expected_start))
        raise ValueError(
            f"node {v}: start {int(start[v])} must be {int(expected_start[v])} "
            "(0 for a root, the parent's end otherwise)"
        )
    return parent, start, end


def _choose_continuations(
    parent: np.ndarray, start: np.ndarray, end: np.ndarray, chunk_size: int
) -> np.ndarray:
    """The DP of the module docstring; returns node_next (k1 of every node, -1 at leaves)."""
    n = len(parent)
    # in_v: v's children start inside the chunk v starts in.
    in_chunk = (end - start // chunk_size * chunk_size < chunk_size).tolist()
    par = parent.tolist()
    f_out = [0] * n
    best = [-1] * n
    second = [-1] * n
    arg = [-1] * n
    for v in range(n - 1, -1, -1):
        k = arg[v]
        if k >= 0:
            # f_out = max(f_out(k1), 1 + m2); m2 = -1 (one child) never wins.
            fo = f_out[k]
            if second[v] >= fo:
                fo = second[v] + 1
            f_out[v] = fo
            fi = best[v] if in_chunk[v] else fo
        else:
            fi = 0
        p = par[v]
        if p >= 0:
            b = best[p]
            # Children arrive last-sibling first; >= hands ties to the earlier sibling.
            if fi >= b:
                second[p] = b
                best[p] = fi
                arg[p] = v
            elif fi > second[p]:
                second[p] = fi
    return np.asarray(arg, dtype=np.int64)


def _build(
    parent: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    node_next: np.ndarray,
    chunk_size: int,
) -> KDACallPlan:
    n = len(parent)
    B = chunk_size
    node_ids = np.arange(n)
    # Chains are found bottom-up by their last node: tail[v], and below[v] = how many
    # chain nodes follow v. Everything per node after this loop is vectorised.
    nxt = node_next.tolist()
    tail = list(range(n))
    below = [0] * n
    for v in range(n - 1, -1, -1):
        k = nxt[v]
        if k >= 0:
            tail[v] = tail[k]
            below[v] = below[k] + 1
    node_tail = np.asarray(tail, dtype=np.int64)
    node_below = np.asarray(below, dtype=np.int64)
    is_head = (parent < 0) | (node_next[np.maximum(parent, 0)] != node_ids)
    seq_head = np.flatnonzero(is_head)
    num_seq = len(seq_head)
    seq_of_tail = np.empty(n, dtype=np.int64)
    seq_of_tail[node_tail[seq_head]] = np.arange(num_seq)
    node_seq = seq_of_tail[node_tail]
    seq_offsets = np.zeros(num_seq + 1, dtype=np.int64)
    np.cumsum(node_below[seq_head] + 1, out=seq_offsets[1:])
    seq_nodes = np.empty(n, dtype=np.int64)
    seq_nodes[seq_offsets[1:][node_seq] - 1 - node_below] = node_ids
    seq_start = start[seq_head] // B * B

    # The sequence each head branches off (its parent's), always an earlier id.
    head_parent = parent[seq_head]
    branched_off = np.where(head_parent >= 0, node_seq[np.maximum(head_parent, 0)], -1)
    # A head whose aligned start differs from that sequence's starts one round later,
    # from S(a) produced by that sequence (a lies in (a_P, e_p]); otherwise it is still
    # inside P's first chunk and shares P's initial state and round.
    later = (head_parent >= 0) & (seq_start != seq_start[np.maximum(branched_off, 0)])
    off = branched_off.tolist()
    step = later.tolist()
    producer = [-1] * num_seq
    rnd = [0] * num_seq
    for q in range(num_seq):
        P = off[q]
        if P >= 0:
            if step[q]:
                producer[q] = P
                rnd[q] = rnd[P] + 1
            else:
                producer[q] = producer[P]
                rnd[q] = rnd[P]

    seq_replay = start[seq_head] - seq_start
    seq_round = np.asarray(rnd, dtype=np.int64)
    num_rounds = int(seq_round.max()) + 1 if num_seq else 0
    # Planned rounds are few (<= 1 + log2 N): uint16 keys get numpy's linear radix sort.
    keys = seq_round.astype(np.uint16) if num_rounds <= 1 << 16 else seq_round
    by_round = np.argsort(keys, kind="stable")
    cuts = np.cumsum(np.bincount(seq_round, minlength=num_rounds))[:-1]
    rounds = tuple(np.split(by_round, cuts)) if num_rounds else ()
    arrays = dict(
        node_parent=parent,
        node_start=start,
        node_end=end,
        node_next=node_next,
        node_seq=node_seq,
        seq_offsets=seq_offsets,
        seq_nodes=seq_nodes,
        seq_round=seq_round,
        seq_start=seq_start,
        seq_replay=seq_replay,
        seq_end=end[seq_nodes[seq_offsets[1:] - 1]],
        seq_producer=np.asarray(producer, dtype=np.int64),
    )
    for a in (*arrays.values(), *rounds):
        a.flags.writeable = False
    return KDACallPlan(
        chunk_size=int(B),
        num_rounds=num_rounds,
        replay_tokens=int(seq_replay.sum()),
        rounds=rounds,
        **arrays,
    )
