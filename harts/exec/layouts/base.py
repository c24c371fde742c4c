"""What every layout shares: the model and kernels it builds microbatches for."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from harts.config.kernels import KernelConfig
from harts.exec.ops.record import KernelRecord
from harts.exec.step import Microbatch
from harts.tree.trajectory import Trajectory


class LayoutBase:
    """A `harts.exec.step.Layout` without its partition and microbatches: `bind` and a
    `prepare` that builds one pass's microbatches into a list."""

    preparable = True
    covers_step = True
    model: torch.nn.Module
    kernels: KernelConfig
    kernel_record: KernelRecord
    # where and in which dtype the microbatches' tensors go: the model's parameters' (any
    # one: a pipeline stage's module holds no LM head)
    device: torch.device
    dtype: torch.dtype

    def bind(self, model: torch.nn.Module, kernels: KernelConfig, kernel_record: KernelRecord) -> LayoutBase:
        self.model, self.kernels, self.kernel_record = model, kernels, kernel_record
        ref = next(model.parameters())
        self.device, self.dtype = ref.device, ref.dtype
        return self

    def microbatches(self, trajectories: Sequence[Trajectory],
                     partition: Sequence[Sequence[int]]) -> Iterable[Microbatch]:
        raise NotImplementedError

    def prepare(self, trajectories: Sequence[Trajectory], partition: Sequence[Sequence[int]]) -> list[Microbatch]:
        return list(self.microbatches(trajectories, partition))


def budget(microbatch_tokens: int | None) -> int:
    """The token budget a packing layout needs."""
    if microbatch_tokens is None:
        raise ValueError("this layout packs microbatches under a token budget: give microbatch_tokens")
    return microbatch_tokens
