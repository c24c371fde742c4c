"""The packed layout, the expanded baseline's: trajectories packed into microbatches under a
token budget (first-fit-decreasing, `harts.plan.partition.packed_partition`; a trajectory
longer than the budget gets a microbatch of its own), each a `PackedContext` over
independent causal sequences (sequences never see each other).

Shapes: N targets."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from harts.exec.layouts.base import LayoutBase, budget
from harts.exec.loss import TargetTable
from harts.exec.model.context import PackedContext
from harts.exec.step import Microbatch
from harts.exec.transfer import to_device
from harts.plan.partition import packed_partition
from harts.tree.trajectory import Trajectory

__all__ = ["PackedLayout", "trajectory_targets"]


def trajectory_targets(
    trajectories: Sequence[Trajectory], traj_indices: Sequence[int], row_offsets: Sequence[int]
) -> TargetTable:
    """Targets of positions 1..L-1 of each trajectory (masked ones included with weight 0, so
    every position gets a log-prob); trajectory j's row p-1 sits at row_offsets[j] + p - 1."""
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("row", "label", "traj", "position", "weight", "adv", "old", "ref")}
    have_ref = all(trajectories[j].ref_logprobs is not None for j in traj_indices)
    for j, off in zip(traj_indices, row_offsets, strict=True):
        t = trajectories[j]
        p = np.arange(1, len(t), dtype=np.int64)
        parts["row"].append(off + p - 1)
        parts["label"].append(t.tokens[1:])
        parts["traj"].append(np.full(p.size, j, dtype=np.int64))
        parts["position"].append(p)
        parts["weight"].append(t.loss_mask[1:].astype(np.float64))
        parts["adv"].append(t.advantage[1:])
        parts["old"].append(t.old_logprobs[1:])
        if have_ref:
            parts["ref"].append(t.ref_logprobs[1:])
    cat = {k: torch.from_numpy(np.concatenate(v)) if v else None for k, v in parts.items()}
    return TargetTable(
        row=cat["row"], label=cat["label"], traj=cat["traj"], position=cat["position"],
        weight=cat["weight"], advantage=cat["adv"], old_logprob=cat["old"], ref_logprob=cat["ref"],
    )


class PackedLayout(LayoutBase):
    """Trajectories packed, each mixing only within itself (module docstring)."""

    def partition(self, trajectories: Sequence[Trajectory], microbatch_tokens: int | None) -> list[list[int]]:
        """First-fit-decreasing on the trajectories' lengths (`packed_partition`)."""
        return packed_partition(trajectories, budget(microbatch_tokens))

    def microbatches(self, trajectories: Sequence[Trajectory],
                     partition: Sequence[Sequence[int]]) -> Iterator[Microbatch]:
        model, device, dtype = self.model, self.device, self.dtype
        for members in partition:
            members = list(members)
            sizes = [len(trajectories[j]) for j in members]
            offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            ids_T = to_device(np.concatenate([trajectories[j].tokens for j in members]), device)
            ctx = PackedContext(torch.from_numpy(offsets), chunk_size=model.config.chunk_size, kernels=self.kernels,
                                kernel_record=self.kernel_record).to(device)
            table = trajectory_targets(trajectories, members, offsets[:-1].tolist()).to(device, dtype)
            yield Microbatch(members, ids_T, ctx, table, int(offsets[-1]))
