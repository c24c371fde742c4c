"""The tree layout: whole rollout trees per microbatch.

Legend: R compact rows of a microbatch, N targets.

A microbatch holds whole trees (one group = one radix tree); groups are packed by
first-fit-decreasing on their *compact* size under the token budget (a tree larger than
the budget gets a microbatch of its own; splitting trees across microbatches is the plan
layout's, with sharing windows). Each microbatch runs the model once per compact row over
a `TreeContext`; each row's logits serve every target whose previous position is that
row, and losses use the step's expanded denominators, so the step computes the same
numbers as the packed layout on the same trajectories. MoE statistics weight each row by
its occurrence count; token dropping is refused (by the tree trainer).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from harts.exec.layouts.base import LayoutBase, budget
from harts.exec.loss import TargetTable
from harts.exec.step import Microbatch
from harts.exec.transfer import to_device
from harts.exec.tree import TreeContext
from harts.plan.partition import tree_partition
from harts.tree import Targets, Trajectory, build_forest

__all__ = ["TreeLayout", "target_table"]


def target_table(tg: Targets, *, select: np.ndarray | None = None, row: np.ndarray | None = None,
                 traj: np.ndarray | None = None) -> TargetTable:
    """A forest's expanded targets as the loss's TargetTable: optionally a subset
    (`select`), with the serving rows and trajectory indices remapped (`row`, `traj`:
    already restricted to the subset) into the executing microbatch's own index spaces."""
    sel = slice(None) if select is None else select

    def col(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x[sel]))

    return TargetTable(
        row=torch.from_numpy(row) if row is not None else col(tg.row), label=col(tg.label),
        traj=torch.from_numpy(traj) if traj is not None else col(tg.traj), position=col(tg.position),
        weight=col(tg.weight), advantage=col(tg.advantage), old_logprob=col(tg.old_logprob),
        ref_logprob=None if tg.ref_logprob is None else col(tg.ref_logprob),
    )


class TreeLayout(LayoutBase):
    """Whole trees per microbatch (module docstring). `kda_mode`: "replay" (the KDA call
    plan's rounds) or the "node" ablation."""

    def __init__(self, kda_mode: str = "replay"):
        self.kda_mode = kda_mode

    def partition(self, trajectories: Sequence[Trajectory], microbatch_tokens: int | None) -> list[list[int]]:
        """Whole groups, packed first-fit-decreasing by their compact (tree) size
        (`harts.plan.partition.tree_partition`)."""
        return tree_partition(trajectories, budget(microbatch_tokens))

    def microbatches(self, trajectories: Sequence[Trajectory],
                     partition: Sequence[Sequence[int]]) -> Iterator[Microbatch]:
        model, device, dtype = self.model, self.device, self.dtype
        for members in partition:
            members = list(members)
            forest = build_forest([trajectories[j] for j in members])
            tg = forest.targets()
            global_traj = np.asarray(members, dtype=np.int64)[tg.traj]
            table = target_table(tg, traj=global_traj).to(device, dtype)
            ctx = TreeContext(forest, chunk_size=model.config.chunk_size, kda_mode=self.kda_mode, device=device,
                              kernels=self.kernels, kernel_record=self.kernel_record)
            if model.config.num_kda_layers:
                ctx.prepare_kda(model.config.conv_window)  # host work and uploads ahead of the step
            ids_T = to_device(forest.token_ids, device)
            info = {"kda_rounds": ctx.kda_rounds, "replay_tokens": ctx.replay_tokens,
                    "compression": forest.compression}
            yield Microbatch(members, ids_T, ctx, table, forest.expanded_tokens, info)
