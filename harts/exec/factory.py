"""The one construction site of each single-process trainer: `make_trainer(kind, model, ...)`.

Kinds (each the one step runner, `harts.exec.step.StepRunner`, over a layout of
`harts.exec.layouts`):

- "expanded": `ExpandedTrainer`, the trajectory-by-trajectory baseline (`PackedLayout`);
- "tree": `TreeTrainer`, whole rollout trees per microbatch (`TreeLayout`; `kda_mode`
  "replay" or the "node" ablation);
- "plan": `PlanTrainer`, a step planner's `plan` (`PlanLayout`: sharing windows; `order`,
  `schedule`, `offload_producers`, `producer_recompute` as `PlanLayout` takes them);
- "prefix-merged": `PrefixMergedTrainer`, the prefix-merged expanded baseline
  (`PrefixMergedLayout`).

Distributed trainers are built by `harts.distributed.runner.distributed_trainer`, and a
whole run's trainer by `harts.train.build_trainer`. Which trajectories share a microbatch
without building a trainer: `harts.plan.partition`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from harts.config.kernels import KernelConfig
from harts.config.loss import PolicyLossConfig
from harts.config.optimizer import OptimizerConfig

__all__ = ["TRAINER_KINDS", "chained_expanded_plan", "make_trainer"]

TRAINER_KINDS = ("expanded", "tree", "plan", "prefix-merged")


def chained_expanded_plan(trajectories: Sequence[Any], microbatch_tokens: int, chunk_size: int,
                          forest: Any = None, **plan_fields: Any) -> Any:
    """The expanded baseline's plan where a trajectory is longer than `microbatch_tokens`:
    the expanded-ffd plan, whose chains of windows (`harts.plan.planners.chains`) keep every
    microbatch within the budget; None where every trajectory fits (the packed layout, the
    "expanded" kind, runs them). `forest`: the trajectories' forest where the caller has it;
    `plan_fields`: other `PlanConfig` fields (the chains' retentions). Raises ValueError for
    a budget the planner refuses."""
    longest = int(forest.traj_length.max()) if forest is not None and forest.num_trajectories else \
        max((len(t) for t in trajectories), default=0)
    if longest <= microbatch_tokens:
        return None
    from harts.config.plan import PlanConfig
    from harts.plan.planners import make_plan
    from harts.tree import build_forest

    forest = forest if forest is not None else build_forest(trajectories)
    return make_plan(forest, "expanded-ffd", PlanConfig(microbatch_tokens=microbatch_tokens, chunk_size=chunk_size,
                                                        **plan_fields))


def make_trainer(kind: str, model: Any, plan: Any = None, *, optimizer: OptimizerConfig | None = None,
                 loss: PolicyLossConfig | None = None, kernels: KernelConfig | None = None,
                 kda_mode: str | None = None, order: Sequence[int] | None = None, schedule: Any = None,
                 offload_producers: bool | None = None, producer_recompute: bool = True) -> Any:
    """A `kind` trainer (module docstring) of `model`: its AdamW from `optimizer`, its loss
    from `loss`, its ops' kernels from `kernels` (None: `KernelConfig.from_env()`). `plan`
    and the window options are the "plan" kind's, `kda_mode` the "tree" kind's."""
    if kind not in TRAINER_KINDS:
        raise ValueError(f"unknown trainer kind {kind!r}; known: {', '.join(TRAINER_KINDS)}")
    if (plan is not None) != (kind == "plan"):
        raise ValueError(f"a plan goes with the 'plan' kind ({kind!r} {'got' if plan is not None else 'needs'} one)")
    if kind != "plan" and (order is not None or schedule is not None or offload_producers is not None
                           or not producer_recompute):
        raise ValueError("order, schedule, offload_producers and producer_recompute are the 'plan' kind's")
    if kind != "tree" and kda_mode is not None:
        raise ValueError("kda_mode is the 'tree' kind's")
    if kind == "expanded":
        from harts.exec.trainer import ExpandedTrainer

        return ExpandedTrainer(model, optimizer, loss, kernels=kernels)
    if kind == "tree":
        from harts.exec.tree_trainer import TreeTrainer

        return TreeTrainer(model, optimizer, loss, kda_mode=kda_mode or "replay", kernels=kernels)
    if kind == "plan":
        from harts.exec.window import PlanTrainer

        return PlanTrainer(model, plan, optimizer, loss, order=order, schedule=schedule, kernels=kernels,
                           offload_producers=offload_producers, producer_recompute=producer_recompute)
    from harts.exec.prefix_trainer import PrefixMergedTrainer

    return PrefixMergedTrainer(model, optimizer, loss, kernels=kernels)
