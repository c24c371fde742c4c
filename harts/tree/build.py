"""Building rollout forests: radix trees over sorted sequences and their adjacent LCPs.

Within a group, sequences are sorted lexicographically (prefixes first; the sort compares
big-endian bytes, i.e. memcmp, never Python ints), and the longest common prefix of each
adjacent pair is found with one vectorised comparison. The compacted trie then follows
from the LCP array alone: a node spanning sorted range [lo, hi] ends at the minimum LCP
inside the range, the sequences that end there come first in the range, and the rest split
where the LCP equals that depth. Work is O(expanded tokens) in numpy plus
O(nodes x tree height) in Python over node ranges, never per token.

The same builder runs over *symbols with lengths*: token ids (each of length 1), or whole
segments (a turn's action or observation) for structure-only workloads whose token ids are
never materialised; depths are then measured in tokens through the segment lengths.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from harts.tree.forest import Payload, RolloutForest
from harts.tree.trajectory import Trajectory


def build_forest(trajectories: Sequence[Trajectory]) -> RolloutForest:
    """One radix tree per group, in first-appearance order of the groups."""
    if not trajectories:
        raise ValueError("no trajectories to build a forest from")
    ids = [t.id for t in trajectories]
    seen: set[str] = set()
    for tid in ids:
        if tid in seen:
            raise ValueError(f"duplicate trajectory id {tid!r}")
        seen.add(tid)
    seqs = [t.tokens for t in trajectories]
    forest = _build(
        seqs,
        [t.group for t in trajectories],
        ids,
        symbol_lengths=None,
    )
    offsets = np.zeros(len(trajectories) + 1, dtype=np.int64)
    np.cumsum([len(t) for t in trajectories], out=offsets[1:])
    has_ref = [t.ref_logprobs is not None for t in trajectories]
    if any(has_ref) and not all(has_ref):
        missing = ids[has_ref.index(False)]
        raise ValueError(f"ref_logprobs given for some trajectories but not {missing!r}")
    payload = Payload(
        offsets=offsets,
        loss_mask=np.concatenate([t.loss_mask for t in trajectories]),
        advantage=np.concatenate([t.advantage for t in trajectories]),
        old_logprobs=np.concatenate([t.old_logprobs for t in trajectories]),
        ref_logprobs=np.concatenate([t.ref_logprobs for t in trajectories]) if all(has_ref) else None,
        extra=tuple(dict(t.extra) for t in trajectories),
        turns=tuple(t.turns for t in trajectories),
    )
    return RolloutForest(
        node_parent=forest.node_parent,
        node_start=forest.node_start,
        node_end=forest.node_end,
        node_group=forest.node_group,
        groups=forest.groups,
        traj_ids=forest.traj_ids,
        traj_node=forest.traj_node,
        token_ids=forest.token_ids,
        payload=payload,
    )


def build_structure(
    symbol_seqs: Sequence[np.ndarray],
    groups: Sequence[str],
    ids: Sequence[str],
    symbol_lengths: np.ndarray,
) -> RolloutForest:
    """A structure-only forest from sequences of segment symbols.

    `symbol_lengths[s]` is the token length of symbol s. Two sequences are taken to share
    tokens exactly where they share symbols, so a fork can only fall on a segment boundary
    (the workload generator guarantees sibling segments differ in their first token).
    """
    return _build(symbol_seqs, groups, ids, symbol_lengths=np.asarray(symbol_lengths, np.int64))


def _sort_key(seq: np.ndarray) -> bytes:
    # big-endian unsigned bytes compare like the integer sequences (ids are non-negative)
    return seq.astype(">u8", copy=False).tobytes()


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    m = min(a.size, b.size)
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


def _build(
    seqs: Sequence[np.ndarray],
    groups: Sequence[str],
    ids: Sequence[str],
    symbol_lengths: np.ndarray | None,
) -> RolloutForest:
    group_names: list[str] = []
    group_index: dict[str, int] = {}
    members: list[list[int]] = []
    for i, g in enumerate(groups):
        if g not in group_index:
            group_index[g] = len(group_names)
            group_names.append(g)
            members.append([])
        members[group_index[g]].append(i)

    parent: list[int] = []
    start: list[int] = []
    end: list[int] = []
    node_group: list[int] = []
    source: list[tuple[int, int, int]] = []  # (sequence, symbol start, symbol end) per node
    traj_node = np.full(len(seqs), -1, dtype=np.int64)

    for gi, idx in enumerate(members):
        keys = [_sort_key(seqs[i]) for i in idx]
        order = sorted(range(len(idx)), key=keys.__getitem__)
        srt = [idx[o] for o in order]
        lens = np.array([seqs[i].size for i in srt], dtype=np.int64)
        lcp = np.zeros(len(srt), dtype=np.int64)
        for j in range(1, len(srt)):
            lcp[j] = _lcp(seqs[srt[j - 1]], seqs[srt[j]])
        if symbol_lengths is not None:
            cum = [np.concatenate(([0], np.cumsum(symbol_lengths[seqs[i]]))) for i in srt]
        # explicit stack of (lo, hi, symbol depth at which the range's node starts, parent)
        stack: list[tuple[int, int, int, int]] = [(0, len(srt) - 1, 0, -1)]
        while stack:
            lo, hi, s, par = stack.pop()
            e = int(lens[lo]) if lo == hi else int(min(lcp[lo + 1 : hi + 1].min(), lens[lo]))
            if e > s:
                node = len(parent)
                parent.append(par)
                if symbol_lengths is None:
                    start.append(s)
                    end.append(e)
                else:
                    start.append(int(cum[lo][s]))
                    end.append(int(cum[lo][e]))
                node_group.append(gi)
                source.append((srt[lo], s, e))
            else:
                node = par  # a fork at the very start: children hang from the same parent
            k = lo
            while k <= hi and lens[k] == e:
                if node < 0:
                    raise ValueError(f"empty trajectory {ids[srt[k]]!r}")
                traj_node[srt[k]] = node
                k += 1
            if k > hi:
                continue
            cuts = (np.flatnonzero(lcp[k + 1 : hi + 1] == e) + k + 1).tolist()
            bounds = [k, *cuts, hi + 1]
            # push in reverse so children pop in sorted order (preorder = sorted order)
            for c in range(len(bounds) - 2, -1, -1):
                stack.append((bounds[c], bounds[c + 1] - 1, e, node))

    token_ids = None
    if symbol_lengths is None:
        token_ids = (
            np.concatenate([seqs[i][a:b] for i, a, b in source]).astype(np.int64)
            if source
            else np.zeros(0, dtype=np.int64)
        )
    return RolloutForest(
        node_parent=np.asarray(parent, dtype=np.int64),
        node_start=np.asarray(start, dtype=np.int64),
        node_end=np.asarray(end, dtype=np.int64),
        node_group=np.asarray(node_group, dtype=np.int64),
        groups=tuple(group_names),
        traj_ids=tuple(ids),
        traj_node=traj_node,
        token_ids=token_ids,
    )
