"""The prefix-merged expanded baseline: the step runner over the prefix-merged layout
(`harts.exec.layouts.prefix`), the strongest trainer that does not share rows between
sequences that fork."""

from __future__ import annotations

from harts.config.kernels import KernelConfig
from harts.config.optimizer import OptimizerConfig
from harts.exec.layouts.prefix import PrefixMergedLayout
from harts.exec.loss import PolicyLossConfig
from harts.exec.model.model import HybridModel
from harts.exec.step import StepRunner

__all__ = ["PrefixMergedTrainer"]


class PrefixMergedTrainer(StepRunner):
    def __init__(self, model: HybridModel, optimizer: OptimizerConfig | None = None,
                 loss: PolicyLossConfig | None = None, *, kernels: KernelConfig | None = None):
        model.config.check_tree_mode()  # occurrence-weighted rows: token dropping would differ
        super().__init__(model, PrefixMergedLayout(), optimizer, loss, kernels=kernels)
