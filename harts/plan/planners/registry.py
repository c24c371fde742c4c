"""The step-planner registry: one `StrEnum` of names, one function per name.

A planner is `fn(forest, config) -> Plan`. `make_plan` is the one entry point: it checks
the config, hands trajectories longer than the budget to chains of windows
(`harts.plan.planners.chains`, the planner planning the rest) together with the trees a
planner names as ones it cannot lay out without recomputing rows (its `nest` function,
given at registration: l1l2's trees whose one window does not fit), times the planner
(wall clock, stored as `Plan.plan_seconds`), orders a one-replica plan's independent
blocks for a host-bound executor where microbatch floors are given (`harts.plan.order`)
and, unless told otherwise, validates the result against the forest so a planner bug
fails loudly at the place it happened.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from enum import StrEnum

from harts.config.plan import PlanConfig
from harts.config.registry import Registry
from harts.plan.order import order_blocks
from harts.plan.plan import Plan
from harts.tree.forest import RolloutForest


class PlannerName(StrEnum):
    EXPANDED_FFD = "expanded-ffd"
    ORTOOLS_FFD = "ortools-ffd"
    L1 = "l1"
    L1L2 = "l1l2"


PlannerFn = Callable[[RolloutForest, PlanConfig], Plan]
# the roots of the trees a planner hands to nested windows (`chains.chain_windows`)
NestFn = Callable[[RolloutForest, PlanConfig], list[int]]
_PLANNERS: Registry[PlannerName, PlannerFn] = Registry("planner", PlannerName, ValueError, "known planners")


_NESTS: dict[str, NestFn] = {}


def register_planner(name: PlannerName, nest: NestFn | None = None) -> Callable[[PlannerFn], PlannerFn]:
    """Register `fn` under `name`; `nest(forest, config)`, when given, names the roots of
    trees `fn` cannot plan without recomputing rows, which `make_plan` chains instead."""
    def deco(fn: PlannerFn) -> PlannerFn:
        if nest is not None:
            _NESTS[str(name)] = nest
        return _PLANNERS.register(name, fn)

    return deco


def known_planners() -> list[str]:
    return _PLANNERS.known()


def get_planner(name: str) -> PlannerFn:
    return _PLANNERS.get(name)


def make_plan(
    forest: RolloutForest, planner: str, config: PlanConfig | None = None, validate: bool = True
) -> Plan:
    config = config or PlanConfig()
    config.validate()
    fn = get_planner(planner)
    t0 = time.perf_counter()
    from harts.plan.planners.chains import plan_with_chains

    # trajectories longer than the budget: chains of windows, the rest planned by `fn`
    plan = plan_with_chains(forest, config, fn, str(planner), _NESTS.get(str(planner)))
    # one replica with microbatch floors: its independent blocks in the cheapest order
    plan = order_blocks(plan, config)
    seconds = time.perf_counter() - t0
    plan = dataclasses.replace(plan, plan_seconds=seconds)
    if validate:
        plan.validate(forest)
    return plan
