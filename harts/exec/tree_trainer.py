"""Tree-mode training: the step runner over the tree layout (`harts.exec.layouts.tree`:
whole rollout trees per microbatch, a `TreeContext` each), computing the same numbers as
`ExpandedTrainer` on the same trajectories."""

from __future__ import annotations

from harts.config.kernels import KernelConfig
from harts.config.optimizer import OptimizerConfig
from harts.exec.layouts.tree import TreeLayout, target_table
from harts.exec.loss import PolicyLossConfig
from harts.exec.model.model import HybridModel
from harts.exec.step import StepRunner

__all__ = ["TreeTrainer", "target_table"]


class TreeTrainer(StepRunner):
    """Whole trees per microbatch; `kda_mode` "replay" (the KDA call plan's rounds) or the
    "node" ablation. Token dropping is refused (`ModelConfig.check_tree_mode`)."""

    def __init__(self, model: HybridModel, optimizer: OptimizerConfig | None = None,
                 loss: PolicyLossConfig | None = None, *, kda_mode: str = "replay",
                 kernels: KernelConfig | None = None):
        model.config.check_tree_mode()
        super().__init__(model, TreeLayout(kda_mode), optimizer, loss, kernels=kernels)

    @property
    def kda_mode(self) -> str:
        return self.layout.kda_mode
