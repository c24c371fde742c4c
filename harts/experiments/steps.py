"""Steps of the SWE-shaped workloads, planned: what the planning and simulation studies share.

A `Case` is the paper's (model, GPUs, sampling scheme) triple. Its step is the workload
preset ``swe-<scheme>-<gpus>`` (one prompt group of 8 rollouts per GPU), structure only;
step k of a multi-step study uses the preset's seed + k. The data-parallel layout is the
simulator's default for the model and GPU count (Tiny: PP2 from 8 GPUs; Flash: PP4), and
planners price microbatches with the token-pair cost derived from the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from harts.tree.forest import RolloutForest

SCHEME_LABEL = {"treestep": "Tree-Step", "stepwise": "Step-wise"}
PLANNER_LABEL = {
    "expanded-ffd": "Baseline (expanded FFD)",
    "ortools-ffd": "OR-Tools+FFD",
    "l1": "HARTS L1",
    "l1l2": "HARTS L1+L2",
}


@dataclass(frozen=True)
class Case:
    model: str
    gpus: int
    scheme: str  # "treestep" | "stepwise"

    @property
    def key(self) -> str:
        return f"{self.model}-{self.gpus}-{self.scheme}"

    @property
    def label(self) -> str:
        return f"{self.model.title()}/{self.gpus} {SCHEME_LABEL.get(self.scheme, self.scheme)}"


def workload_config(scheme: str, gpus: int, step: int = 0, num_groups: int | None = None) -> Any:
    from harts.config.workload import PRESETS
    from harts.tree.workload import preset

    name = f"swe-{scheme}-{gpus}"
    if name in PRESETS:
        base = preset(name)
        overrides: dict[str, Any] = {"seed": base.seed + step}
    else:
        overrides = {"num_groups": gpus, "seed": gpus + step}
        name = f"swe-{scheme}-1"
    if num_groups is not None:
        overrides["num_groups"] = num_groups
    return preset(name, **overrides)


@lru_cache(maxsize=32)
def step_forest(scheme: str, gpus: int, step: int = 0, num_groups: int | None = None) -> RolloutForest:
    """The structure-only forest of one step (cached: several studies plan the same step)."""
    from harts.tree.workload import generate

    return generate(workload_config(scheme, gpus, step, num_groups)).forest()


def parallel_for(model: str, gpus: int) -> Any:
    from harts.config.models import get_model_config
    from harts.sim.parallel import default_parallel

    return default_parallel(get_model_config(model), gpus)


@lru_cache(maxsize=8)
def cost_model_for(model: str) -> Any:
    from harts.config.costs import TokenPairCost
    from harts.config.models import get_model_config
    from harts.config.param_counts import parameter_counts

    cfg = get_model_config(model)
    return TokenPairCost.for_model(cfg, parameter_counts(cfg).active)


def make_step_plan(forest: RolloutForest, planner: str, *, model: str, dp: int, microbatch_tokens: int,
                   seed: int = 0, time_limit: float = 2.0, pp: int = 1) -> tuple[Any, Any]:
    """(Plan, PlanMetrics) of one planner on one step; `pp` > 1 plans for a pipeline of that
    many stages (pass the simulated layout's pp when the plan is simulated)."""
    from harts.config.models import get_model_config
    from harts.config.plan import PlanConfig
    from harts.plan.metrics import compute_metrics
    from harts.plan.planners import make_plan

    cfg = PlanConfig(dp=dp, microbatch_tokens=microbatch_tokens, cost_model=cost_model_for(model), seed=seed,
                     time_limit=time_limit, chunk_size=get_model_config(model).chunk_size, pp=pp)
    plan = make_plan(forest, planner, cfg)
    return plan, compute_metrics(plan, forest)


def simulate_work(step_work: Any, schedule: str, *, model: str, parallel: Any, hardware: str = "h200",
                  cost_model: str = "roofline", recompute: bool = True) -> Any:
    """Simulate a `StepWork` under a pipeline schedule (harts.sim); returns its SimResult."""
    from harts.config.models import get_model_config
    from harts.plan.schedule import build_schedule
    from harts.sim.costs import make_cost_model
    from harts.sim.hardware import load_hardware
    from harts.sim.simulate import simulate_step

    cost = make_cost_model(cost_model, get_model_config(model), parallel, load_hardware(hardware),
                           recompute=recompute)
    return simulate_step(step_work, build_schedule(schedule, step_work, parallel.pp), cost)


def plan_work(plan: Any, forest: RolloutForest, model: str) -> Any:
    """The simulator's view (`StepWork`) of a plan."""
    from harts.config.models import get_model_config
    from harts.plan.step import step_from_plan

    return step_from_plan(plan, forest, get_model_config(model).chunk_size)
