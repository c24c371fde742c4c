"""Parallel layout of a simulated cluster: DP replicas x PP stages, expert parallelism carved
out of each stage's DP group (Megatron's expert-data-parallel), TP = 1.

Global rank = stage * dp + replica, so a stage's DP (and EP) group is contiguous and stays in
one node while it fits; pipeline neighbours are `dp` ranks apart. The layers of each pipeline
stage are `harts.plan.stages.stage_layers`.
"""

from __future__ import annotations

from harts.config.models import ModelConfig
from harts.config.parallel import ParallelConfig  # noqa: F401  (importers of harts.sim.parallel)

__all__ = ["default_ep", "default_parallel"]


def default_parallel(model: ModelConfig, gpus: int) -> ParallelConfig:
    """The layout the simulator uses when none is given (an assumption, stated in the
    JSON output): Tiny pipelines over 2 stages once there are 8 GPUs (the paper's Table 6
    is a PP ablation on Tiny/8), Flash over 4 (124B parameters do not fit fewer stages
    with the optimizer state sharded over DP); EP = DP up to one node."""
    if gpus < 1:
        raise ValueError("gpus must be >= 1")
    if model.num_layers >= 40:
        pp = 4 if gpus >= 16 else (2 if gpus >= 2 and gpus % 2 == 0 else 1)
    else:
        pp = 2 if gpus >= 8 and gpus % 2 == 0 else 1
    dp = gpus // pp
    if dp * pp != gpus:
        raise ValueError(f"{gpus} GPUs do not split into {pp} stages")
    return ParallelConfig(dp=dp, pp=pp, ep=default_ep(model, dp))


def default_ep(model: ModelConfig, dp: int) -> int:
    """The largest power of two that divides DP and the expert count, up to one node (8)."""
    ep = 1
    while ep * 2 <= min(dp, 8) and dp % (ep * 2) == 0 and model.num_experts % (ep * 2) == 0:
        ep *= 2
    return ep
