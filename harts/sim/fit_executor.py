"""Fitting the executor model's rates (`harts.sim.executor`) to measured steps (no torch).

A measured case is a step of one plan kind on one rollout forest with its measured
seconds. The three plan kinds of the window suite (benchmarks/gpu/window_suite.py):
- `tree`: the unsplit tree, one microbatch (the l1l2 planner at a budget above the tree);
- `windows`: the l1l2 plan at the budget (a producer and its consumers);
- `expanded`: the trajectories packed first-fit-decreasing at the budget.

`fit_rates` fits the named rates by least squares on log(predicted / measured) with
scipy, the others held at the base profile's values; `fit_launches` fits the launch
counts (hardware-independent: they are the executor's code path) to counted launches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from harts.config.models import ModelConfig
from harts.config.parallel import ParallelConfig
from harts.plan.work import StepWork
from harts.sim.executor import (
    ExecutorCostModel,
    MicrobatchFeatures,
    action_seconds,
    microbatch_features,
    step_seconds_1gpu,
)
from harts.sim.executor_rates import ExecutorRates
from harts.sim.hardware import HardwareProfile
from harts.sim.ops import Phase

__all__ = [
    "KINDS",
    "UNSPLIT_BUDGET",
    "Case",
    "case_of",
    "device_seconds",
    "fit_launches",
    "fit_rates",
    "predict",
    "step_of",
]

KINDS = ("tree", "windows", "expanded")
UNSPLIT_BUDGET = 131072  # the window suite's budget of the unsplit tree


def step_of(forest, kind: str, budget: int, chunk_size: int, unsplit_budget: int = UNSPLIT_BUDGET) -> StepWork:
    """The step the executor runs for a plan kind (module docstring) on one GPU."""
    from harts.config.plan import PlanConfig
    from harts.plan.planners import make_plan
    from harts.plan.step import step_from_plan

    planner, b = {"tree": ("l1l2", max(unsplit_budget, forest.compact_tokens)), "windows": ("l1l2", budget),
                  "expanded": ("expanded-ffd", budget)}[kind]
    plan = make_plan(forest, planner, PlanConfig(microbatch_tokens=b, chunk_size=chunk_size))
    return step_from_plan(plan, forest, chunk_size)


@dataclass(frozen=True)
class Case:
    """One measured (or to be predicted) step: its microbatches' features and the truth."""

    name: str  # "family/seed@budget"
    kind: str
    features: tuple[MicrobatchFeatures, ...]
    optimizer_s: float
    measured_s: float | None = None
    launches: float | None = None  # counted kernel launches of the step, where measured
    device_s: float | None = None  # summed kernel time of the step, where measured

    @property
    def microbatches(self) -> int:
        return len(self.features)


def case_of(name: str, kind: str, step: StepWork, model: ModelConfig, hardware: HardwareProfile,
            **truth: float | None) -> Case:
    cost = ExecutorCostModel(model, ParallelConfig(dp=1, pp=1, ep=1), hardware)
    feats = tuple(microbatch_features(cost, step))
    return Case(name, kind, feats, cost.optimizer(0) - _fixed(cost.rates), **truth)


def _fixed(rates: ExecutorRates) -> float:
    return rates.launches_per_step * rates.host_s_per_launch + rates.step_fixed_s


def predict(rates: ExecutorRates, case: Case) -> float:
    return step_seconds_1gpu(rates, case.features, case.optimizer_s)


def device_seconds(rates: ExecutorRates, case: Case) -> float:
    """Summed device seconds of the step (what a profiler's kernel time measures)."""
    return case.optimizer_s + sum(action_seconds(rates, ph, f)[0] for f in case.features
                                  for ph in (Phase.FWD, Phase.BWD))


def fit_rates(base: ExecutorRates, cases: Sequence[Case], names: Sequence[str],
              target: str = "measured") -> tuple[ExecutorRates, dict[str, float]]:
    """Least squares on log(pred / truth) over `cases` for the rates `names` (>= 0).
    `target` "measured": step seconds; "device": summed kernel seconds (`device_seconds`)."""
    from scipy.optimize import least_squares

    truth = np.array([c.measured_s if target == "measured" else c.device_s for c in cases], dtype=float)
    if np.any(~np.isfinite(truth)) or np.any(truth <= 0):
        raise ValueError("fit_rates: every case needs a positive truth")
    x0 = np.array([max(getattr(base, n), 1e-12) for n in names])
    scale = x0.copy()
    model = predict if target == "measured" else device_seconds

    def residuals(z: np.ndarray) -> np.ndarray:
        r = base.with_values(**dict(zip(names, z * scale, strict=True)))
        return np.log(np.array([model(r, c) for c in cases]) / truth)

    sol = least_squares(residuals, np.ones(len(names)), bounds=(0.0, np.inf), x_scale=1.0)
    fitted = base.with_values(**dict(zip(names, sol.x * scale, strict=True)))
    res = residuals(sol.x)
    return fitted, {"cases": len(cases), "rms_log_error": float(np.sqrt(np.mean(res ** 2))),
                    "max_abs_log_error": float(np.max(np.abs(res)))}


def fit_launches(base: ExecutorRates, cases: Sequence[Case]) -> tuple[ExecutorRates, dict[str, float]]:
    """Launch counts from counted launches per step: a linear least-squares fit of
    step + per-microbatch + per-extra-KDA-round + per-consumer + per-sequence launches."""
    rows, y = [], []
    for c in cases:
        rows.append([1.0, len(c.features), sum(max(0, f.kda_rounds - 1) for f in c.features),
                     sum(1 for f in c.features if f.consumer), sum(f.sequences for f in c.features)])
        y.append(float(c.launches))
    A, b = np.array(rows), np.array(y)
    coef, *_ = np.linalg.lstsq(A, b, rcond=None)
    coef = np.maximum(coef, 0.0)
    pred = A @ coef
    fitted = base.with_values(launches_per_step=coef[0], launches_per_microbatch=coef[1],
                              launches_per_extra_kda_round=coef[2], launches_per_consumer=coef[3],
                              launches_per_sequence=coef[4])
    return fitted, {"cases": len(cases), "max_rel_error": float(np.max(np.abs(pred / b - 1)))}
