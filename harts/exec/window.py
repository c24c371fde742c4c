"""Executing a step `Plan` exactly, sharing windows included: the step runner over the plan
layout (`harts.exec.layouts.plan`, whose module docstring describes the windows'
execution: producer stash, consumers' reads, producer backward after the last consumer)."""

from __future__ import annotations

from collections.abc import Sequence

from harts.config.kernels import KernelConfig
from harts.config.optimizer import OptimizerConfig
from harts.exec.layouts.plan import PlanLayout, WindowStats, order_from_schedule, piece_rows
from harts.exec.loss import PolicyLossConfig
from harts.exec.model.model import HybridModel
from harts.exec.step import StepRunner
from harts.plan.plan import Plan, PlanMode
from harts.plan.schedule import Schedule

__all__ = ["PlanTrainer", "WindowStats", "order_from_schedule", "piece_rows"]


class PlanTrainer(StepRunner):
    """Runs the microbatches of a `Plan`; tree-mode plans with sharing windows exactly.
    `order`, `schedule`, `offload_producers` and `producer_recompute` are `PlanLayout`'s."""

    def __init__(self, model: HybridModel, plan: Plan, optimizer: OptimizerConfig | None = None,
                 loss: PolicyLossConfig | None = None, *, order: Sequence[int] | None = None,
                 schedule: Schedule | None = None, kernels: KernelConfig | None = None,
                 offload_producers: bool | None = None, producer_recompute: bool = True,
                 layout: PlanLayout | None = None):
        """`layout`: a plan layout of `plan` to run instead of one built from the options
        (a distributed runner's replica layout)."""
        if plan.mode == PlanMode.TREE:
            model.config.check_tree_mode()
        if layout is None:
            layout = PlanLayout(plan, order=order, schedule=schedule, offload_producers=offload_producers,
                                producer_recompute=producer_recompute)
        super().__init__(model, layout, optimizer, loss, kernels=kernels)
        self.plan = plan

    @property
    def windows(self) -> list[WindowStats]:
        """What each sharing window of the last pass held, in the order the windows closed."""
        return self.layout.windows

    @property
    def peak_retained_bytes(self) -> int:
        """The most producer state alive at once in the last pass (overlapping windows add up)."""
        return self.layout.peak_retained_bytes
