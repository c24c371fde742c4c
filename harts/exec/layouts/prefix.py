"""The prefix-merged layout, the strongest baseline that does not share rows between
sequences that fork.

Each microbatch runs only its *hosts* (`harts.tree.prefix.prefix_hosts`: sequences no
other sequence of the microbatch extends, one of each set of copies), packed as
independent causal sequences like the packed layout; a merged sequence's targets (its
own weights, advantages, old and reference log-probs) read its host's rows, so a row may
serve several targets. MoE statistics weight each row by the sequences that cover it, as
the tree layout does, so the step computes exactly the expanded step's losses and
gradients. The partition packs hosts first-fit-decreasing by length, each with every
sequence merged into it; a given partition is merged within each of its microbatches.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from harts.exec.layouts.base import LayoutBase, budget
from harts.exec.layouts.packed import trajectory_targets
from harts.exec.model.context import PackedContext
from harts.exec.step import Microbatch
from harts.exec.transfer import to_device
from harts.plan.partition import prefix_partition
from harts.tree.prefix import prefix_hosts
from harts.tree.trajectory import Trajectory

__all__ = ["PrefixMergedLayout"]


class PrefixMergedLayout(LayoutBase):
    """Hosts packed, merged prefixes reading their host's rows (module docstring)."""

    def partition(self, trajectories: Sequence[Trajectory], microbatch_tokens: int | None) -> list[list[int]]:
        """`harts.plan.partition.prefix_partition`."""
        return prefix_partition(trajectories, budget(microbatch_tokens))

    def microbatches(self, trajectories: Sequence[Trajectory],
                     partition: Sequence[Sequence[int]]) -> Iterator[Microbatch]:
        model, device, dtype = self.model, self.device, self.dtype
        for members in partition:
            members = list(members)
            local_host = prefix_hosts([trajectories[j].tokens for j in members])
            hosts = [members[i] for i in range(len(members)) if local_host[i] == i]
            sizes = [len(trajectories[h]) for h in hosts]
            offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            offset_of = dict(zip(hosts, offsets[:-1].tolist(), strict=True))
            weight = np.zeros(int(offsets[-1]), dtype=np.float64)
            for i, j in enumerate(members):
                start = offset_of[members[int(local_host[i])]]
                weight[start:start + len(trajectories[j])] += 1.0
            ids_T = to_device(np.concatenate([trajectories[h].tokens for h in hosts]), device)
            ctx = PackedContext(torch.from_numpy(offsets), torch.from_numpy(weight),
                                chunk_size=model.config.chunk_size, kernels=self.kernels,
                                kernel_record=self.kernel_record).to(device)
            rows_of = [offset_of[members[int(local_host[i])]] for i in range(len(members))]
            table = trajectory_targets(trajectories, members, rows_of).to(device, dtype)
            expanded = sum(len(trajectories[j]) for j in members)
            yield Microbatch(members, ids_T, ctx, table, expanded, {"hosts": len(hosts), "merged": len(members) - len(hosts)})
