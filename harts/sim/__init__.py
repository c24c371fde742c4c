"""Cost-model simulator of a training step (no torch): plans x pipeline schedules on a
modelled cluster. Entry points: `simulate` (StepWork -> SimResult), `step_from_plan`
(a planner's Plan -> StepWork), `build_schedule`, `make_cost_model`, `load_hardware`,
`fit_profile`; the engine (`execute`) knows nothing of pipelines."""

from harts.config.parallel import ParallelConfig
from harts.sim.adapter import step_from_plan
from harts.sim.costs import CostModel, CostModelName, make_cost_model
from harts.sim.engine import Action, DeadlockError, Program, Trace, execute, lower_bound
from harts.sim.hardware import HardwareProfile, load_hardware
from harts.sim.parallel import default_parallel
from harts.sim.profile import Calibration, fit_profile, load_calibration, load_profile
from harts.sim.schedule import Schedule, ScheduleName, build_schedule
from harts.sim.simulate import SimResult, lower, simulate, simulate_step
from harts.sim.work import KDARound, MicrobatchWork, StepWork

__all__ = [
    "Action", "Calibration", "CostModel", "CostModelName", "DeadlockError", "HardwareProfile",
    "KDARound", "MicrobatchWork", "ParallelConfig", "Program", "Schedule", "ScheduleName",
    "SimResult", "StepWork", "Trace", "build_schedule", "default_parallel", "execute",
    "fit_profile", "load_calibration", "load_hardware", "load_profile", "lower", "lower_bound",
    "make_cost_model", "simulate", "simulate_step", "step_from_plan",
]
