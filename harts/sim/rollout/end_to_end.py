"""One RL step end to end: the rollout phase from this simulator, then the training phase
of the same trajectories from the training-step simulator (`harts.sim.simulate`), so a
user sees where the step's time goes and what a rollout policy saves.

The trajectories become a structure-only forest: one sequence per trajectory (prompt,
then its actions and observations), the prompt shared by the rollouts of a group (what
the tree planners compress). The step is planned (`l1l2` by default) for the model's
default parallel layout on the same GPUs and simulated with the roofline cost model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from harts.config.rollout import RolloutWorkload
from harts.sim.rollout.engine import simulate_rollout
from harts.sim.rollout.types import RolloutResult, TrajectorySpec
from harts.sim.rollout.workload import generate_trajectories


@dataclass(frozen=True)
class StepBreakdown:
    policy: str
    rollout_s: float
    training_s: float
    rollout: RolloutResult
    training: Any  # harts.sim.SimResult
    planner: str
    schedule: str

    @property
    def step_s(self) -> float:
        return self.rollout_s + self.training_s

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "step_s": self.step_s,
            "rollout_s": self.rollout_s,
            "training_s": self.training_s,
            "rollout_fraction": self.rollout_s / self.step_s if self.step_s > 0 else 0.0,
            "rollout_throughput_tokens_per_s": self.rollout.throughput_tokens_per_s,
            "training_throughput_tokens_per_s": self.training.throughput,
            "planner": self.planner,
            "schedule": self.schedule,
            "parallel": self.training.parallel.describe(),
        }


def trajectory_forest(specs: tuple[TrajectorySpec, ...]) -> Any:
    """The structure-only training forest of a step's trajectories."""
    from harts.tree.build import build_structure

    lengths: list[int] = []
    prompt_sym: dict[int, int] = {}
    seqs, groups, ids = [], [], []
    for s in specs:
        if s.group not in prompt_sym:
            prompt_sym[s.group] = len(lengths)
            lengths.append(s.turns[0].input_tokens)
        syms = [prompt_sym[s.group]]
        for k, t in enumerate(s.turns):
            if k:
                syms.append(len(lengths))
                lengths.append(t.input_tokens)
            syms.append(len(lengths))
            lengths.append(t.action_tokens)
        seqs.append(np.asarray(syms, dtype=np.int64))
        groups.append(f"g{s.group}")
        ids.append(f"t{s.tid}")
    return build_structure(seqs, groups, ids, np.asarray(lengths, np.int64))


def simulate_step_end_to_end(cfg: RolloutWorkload, policy: str, gpus: int, planner: str = "l1l2",
                             schedule: str = "consumer-1f1b",
                             specs: tuple[TrajectorySpec, ...] | None = None) -> StepBreakdown:
    from harts.config.models import get_model_config
    from harts.config.plan import PlanConfig
    from harts.plan.planners import make_plan
    from harts.plan.step import step_from_plan
    from harts.sim.hardware import load_hardware
    from harts.sim.parallel import default_parallel
    from harts.sim.simulate import simulate

    specs = generate_trajectories(cfg) if specs is None else specs
    rollout = simulate_rollout(cfg, policy, gpus, specs=specs)
    model = get_model_config(cfg.model)
    par = default_parallel(model, gpus)
    forest = trajectory_forest(specs)
    budget = max(cfg.max_context, max(s.total_tokens for s in specs))
    plan = make_plan(forest, planner, PlanConfig(dp=par.dp, pp=par.pp, microbatch_tokens=budget, seed=cfg.seed))
    work = step_from_plan(plan, forest, model.chunk_size)
    training = simulate(work, schedule, model, par, load_hardware(cfg.hardware))
    return StepBreakdown(rollout.policy, rollout.makespan_s, training.step_seconds, rollout, training, planner,
                         schedule)
