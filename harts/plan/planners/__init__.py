"""Step planners behind one registry (`PlannerName`): expanded-ffd, ortools-ffd, l1, l1l2."""

from harts.config.plan import PlanConfig
from harts.plan.planners import expanded, l1, l1l2, ortools_ffd  # noqa: F401  (registration)
from harts.plan.planners.registry import (
    PlannerName,
    get_planner,
    known_planners,
    make_plan,
    register_planner,
)

__all__ = [
    "PlanConfig",
    "PlannerName",
    "get_planner",
    "known_planners",
    "make_plan",
    "register_planner",
]
