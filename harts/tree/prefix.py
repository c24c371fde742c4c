"""Prefix merging: the strongest non-tree baseline's view of a batch.

A sequence that is a prefix of another sequence of the batch (an identical copy included)
needs no rows of its own: the longer sequence's causal forward computes every logit the
prefix needs, so a trainer can run only the *hosts* (sequences no other sequence extends,
one of each set of copies) and serve every merged sequence's targets, with their own
weights, advantages and old log-probs, from its host's rows. A host position may then
carry several targets. This is what a multi-turn trainer does with step-wise samples
(nested prefixes of one rollout, each training its last action).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from harts.tree.forest import RolloutForest

__all__ = ["duplicate_counts", "forest_host_lengths", "prefix_hosts"]


def prefix_hosts(token_seqs: Sequence[np.ndarray]) -> np.ndarray:
    """host[i]: the sequence i is merged into (i itself for a host). Sequences are token-id
    arrays (non-negative); i is merged iff it is a prefix of another sequence of the list.
    Of identical copies the last one in input order hosts the others. O(n log n)
    comparisons: in sorted order a sequence that extends anything extends its successor."""
    n = len(token_seqs)
    keys = [np.ascontiguousarray(np.asarray(t, dtype=np.int64)).astype(">i8").tobytes() for t in token_seqs]
    if any(np.asarray(t).size and int(np.min(t)) < 0 for t in token_seqs):
        raise ValueError("token ids must be >= 0")
    order = sorted(range(n), key=lambda i: (keys[i], i))
    host = np.arange(n, dtype=np.int64)
    for j in range(n - 2, -1, -1):
        i, nxt = order[j], order[j + 1]
        if keys[nxt].startswith(keys[i]):
            host[i] = host[nxt]
    return host


def forest_host_lengths(forest: RolloutForest) -> np.ndarray:
    """Lengths of the hosts of a forest's trajectories (structure-only forests included):
    one per leaf node, since within a group a trajectory is a prefix of another iff it
    ends at a node with children or shares its end node with another trajectory."""
    leaves = np.flatnonzero(forest.node_num_children == 0)
    return forest.node_end[leaves].astype(np.int64)


def duplicate_counts(forest: RolloutForest) -> dict[str, int]:
    """{'distinct_trajectories', 'duplicate_trajectories'}: trajectories of a group that end
    at the same node are identical sequences; each such set counts once as distinct and
    its other members as duplicates."""
    distinct = int(np.unique(forest.traj_node).size)
    return {"distinct_trajectories": distinct, "duplicate_trajectories": forest.num_trajectories - distinct}
