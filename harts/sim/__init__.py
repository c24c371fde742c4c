"""Cost-model simulator of a training step (no torch): plans x pipeline schedules on a
modelled cluster. Entry points: `simulate` (StepWork -> SimResult), `make_cost_model`,
`load_hardware`, `fit_profile`; the engine (`execute`) knows nothing of pipelines. The step
structure it prices lives in harts.plan: `StepWork` (harts.plan.work), `step_from_plan`
(a planner's Plan -> StepWork, harts.plan.step), `build_schedule` (harts.plan.schedule)."""

from harts.config.parallel import ParallelConfig
from harts.sim.costs import CostModel, CostModelName, make_cost_model
from harts.sim.engine import Action, DeadlockError, Program, Trace, execute, lower_bound
from harts.sim.executor import ExecutorCostModel, ExecutorRates
from harts.sim.hardware import HardwareProfile, load_hardware
from harts.sim.parallel import default_parallel
from harts.sim.profile import Calibration, fit_profile, load_calibration, load_profile
from harts.sim.simulate import SimResult, lower, simulate, simulate_step

__all__ = [
    "Action", "Calibration", "CostModel", "CostModelName", "DeadlockError", "ExecutorCostModel", "ExecutorRates",
    "HardwareProfile",
    "ParallelConfig", "Program", "SimResult", "Trace", "default_parallel", "execute",
    "fit_profile", "load_calibration", "load_hardware", "load_profile", "lower", "lower_bound",
    "make_cost_model", "simulate", "simulate_step",
]
