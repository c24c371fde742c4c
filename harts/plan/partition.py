"""Which trajectories share a microbatch: each layout's default partition of a step under a
token budget, without a model or a trainer (no torch). The trainers' `partition` methods
are these functions; callers that only need the bins (a report comparing layouts on the
same microbatches, `harts verify --divergence`) call them directly.

- `packed_partition`: the expanded layout, trajectories packed first-fit-decreasing by length;
- `tree_partition`: tree mode, whole groups packed by their compact (tree) size;
- `prefix_partition`: the prefix-merged baseline, prefix hosts packed by length, each with
  every trajectory merged into it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from harts.tree import Trajectory, build_forest
from harts.tree.prefix import prefix_hosts

__all__ = ["PARTITIONS", "pack_microbatches", "packed_partition", "partition", "prefix_partition",
           "tree_partition"]


def pack_microbatches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit-decreasing bins of indices with total length <= budget; an item longer than
    the budget gets a bin of its own. Deterministic: ties keep input order."""
    if budget < 1:
        raise ValueError(f"microbatch token budget must be >= 1; got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for b, r in enumerate(room):
            if n <= r:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(budget - n)
    return bins


def packed_partition(trajectories: Sequence[Trajectory], microbatch_tokens: int) -> list[list[int]]:
    """Which trajectories share a microbatch: first-fit-decreasing on their lengths."""
    return pack_microbatches([len(t) for t in trajectories], microbatch_tokens)


def tree_partition(trajectories: Sequence[Trajectory], microbatch_tokens: int) -> list[list[int]]:
    """Whole groups, packed first-fit-decreasing by their compact (tree) size."""
    groups: dict[str, list[int]] = {}
    for j, t in enumerate(trajectories):
        groups.setdefault(t.group, []).append(j)
    members = list(groups.values())
    sizes = [build_forest([trajectories[j] for j in m]).compact_tokens for m in members]
    return [sorted(j for g in b for j in members[g]) for b in pack_microbatches(sizes, microbatch_tokens)]


def prefix_partition(trajectories: Sequence[Trajectory], microbatch_tokens: int) -> list[list[int]]:
    """Prefix hosts packed by length, each bin holding every trajectory merged into its hosts."""
    host = prefix_hosts([t.tokens for t in trajectories])
    hosts = np.flatnonzero(host == np.arange(host.size))
    members: dict[int, list[int]] = {int(h): [] for h in hosts}
    for j, h in enumerate(host.tolist()):
        members[h].append(j)
    bins = pack_microbatches([len(trajectories[h]) for h in hosts], microbatch_tokens)
    return [sorted(j for b in bin_ for j in members[int(hosts[b])]) for bin_ in bins]


PARTITIONS = {"expanded": packed_partition, "tree": tree_partition, "prefix-merged": prefix_partition}


def partition(layout: str, trajectories: Sequence[Trajectory], microbatch_tokens: int) -> list[list[int]]:
    """The default partition of `layout` ("expanded", "tree" or "prefix-merged")."""
    try:
        fn = PARTITIONS[layout]
    except KeyError:
        raise ValueError(f"unknown layout {layout!r}; known: {', '.join(PARTITIONS)}") from None
    return fn(trajectories, microbatch_tokens)
