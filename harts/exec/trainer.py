"""The trajectory-expanded reference trainer, the baseline every HARTS number is measured
against, and `run_steps`, which steps any trainer with its next step prepared ahead.

`ExpandedTrainer` is the step runner (`harts.exec.step.StepRunner`: forward, loss,
backward, clipping, AdamW) over the packed layout (`harts.exec.layouts.PackedLayout`):
trajectories packed into microbatches under a token budget, each running the model over a
`PackedContext` in which sequences never see each other. The other single-process
trainers are the same runner over their layouts (`TreeTrainer`, `PrefixMergedTrainer`,
`PlanTrainer`), so a difference between modes can only come from the layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from harts.config.kernels import KernelConfig
from harts.config.optimizer import OptimizerConfig
from harts.exec.layouts.packed import PackedLayout, trajectory_targets
from harts.exec.loss import PolicyLossConfig
from harts.exec.model.model import HybridModel
from harts.exec.step import (
    LOSS_TERMS,
    Microbatch,
    PreparedStep,
    StepResult,
    StepRunner,
    moe_statistics_pass,
    step_denominators,
)
from harts.plan.partition import pack_microbatches
from harts.tree.trajectory import Trajectory

__all__ = [
    "LOSS_TERMS",
    "ExpandedTrainer",
    "Microbatch",
    "OptimizerConfig",
    "PreparedStep",
    "StepResult",
    "moe_statistics_pass",
    "pack_microbatches",
    "run_steps",
    "step_denominators",
    "trajectory_targets",
]


class ExpandedTrainer(StepRunner):
    """The baseline: the step runner over the packed layout (module docstring)."""

    def __init__(self, model: HybridModel, optimizer: OptimizerConfig | None = None,
                 loss: PolicyLossConfig | None = None, *, kernels: KernelConfig | None = None):
        super().__init__(model, PackedLayout(), optimizer, loss, kernels=kernels)


def run_steps(trainer: StepRunner, batches: Iterable[Sequence[Trajectory]], microbatch_tokens: int | None, *,
              prefetch: bool = True) -> Iterator[StepResult]:
    """One update step per batch, yielding each step's result as it finishes.

    With `prefetch` (and a trainer that can `prepare`), batch i+1's data side (partition,
    layouts, index tensors copied to the device asynchronously) is built in a background
    thread while step i runs, so that host work overlaps GPU work as a data loader's does;
    the numbers are those of `trainer.step` on the same batches. Batches are read one ahead,
    so each must be final when the previous step starts (for on-policy PPO, recomputing old
    log-probs from the current model, step one batch at a time instead)."""
    if not (prefetch and trainer.preparable):
        for batch in batches:
            yield trainer.step(batch, microbatch_tokens)
        return
    from concurrent.futures import ThreadPoolExecutor

    it = iter(batches)
    with ThreadPoolExecutor(1, thread_name_prefix="harts-prepare") as pool:
        batch = next(it, None)
        pending = None if batch is None else pool.submit(trainer.prepare, batch, microbatch_tokens)
        while pending is not None:
            prepared = pending.result()
            nxt = next(it, None)
            pending = None if nxt is None else pool.submit(trainer.prepare, nxt, microbatch_tokens)
            yield trainer.step(prepared.trajectories, microbatch_tokens, prepared=prepared)
