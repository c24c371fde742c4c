"""Fitting the executor model's rates (`harts.sim.executor`) to measured steps (no torch).

A measured case is a step of one plan kind on one rollout forest with its measured
seconds. The three plan kinds of the window suite (benchmarks/gpu/window_suite.py):
- `tree`: the unsplit tree, one microbatch (the l1l2 planner at a budget above the tree);
- `windows`: the l1l2 plan at the budget (a producer and its consumers);
- `expanded`: the trajectories packed first-fit-decreasing at the budget;
- and `l1`, the windowless split (the L1 planner at the budget: shared rows recomputed),
  what l1l2 with microbatch floors runs where a window plan would not pay.

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
    efficiency_factor,
    executor_passes,
    microbatch_features,
    step_seconds_1gpu,
)
from harts.sim.executor_rates import CATEGORY_SCALES, ExecutorRates
from harts.sim.hardware import HardwareProfile
from harts.sim.ops import Phase

__all__ = [
    "KINDS",
    "UNSPLIT_BUDGET",
    "Case",
    "case_of",
    "category_seconds",
    "device_seconds",
    "fit_launches",
    "fit_rates",
    "host_rate_to_match",
    "predict",
    "step_of",
]

KINDS = ("tree", "windows", "expanded")
UNSPLIT_BUDGET = 131072  # the window suite's budget of the unsplit tree


def step_of(forest, kind: str, budget: int, chunk_size: int, unsplit_budget: int = UNSPLIT_BUDGET,
            floors: dict[str, float] | None = None) -> StepWork:
    """The step the executor runs for a plan kind (module docstring) on one GPU; kind
    `floored` is l1l2 with `floors` (`harts.sim.executor.plan_floors`: the plan `harts
    train` makes on that GPU, windows only where they pay, its blocks ordered for the host)."""
    from harts.config.plan import PlanConfig
    from harts.plan.planners import make_plan
    from harts.plan.step import step_from_plan

    planner, b = {"tree": ("l1l2", max(unsplit_budget, forest.compact_tokens)), "windows": ("l1l2", budget),
                  "floored": ("l1l2", budget), "expanded": ("expanded-ffd", budget), "l1": ("l1", budget)}[kind]
    if kind == "floored" and not floors:
        raise ValueError("kind 'floored' needs the floors (harts.sim.executor.plan_floors)")
    extra = floors if kind == "floored" else {}
    plan = make_plan(forest, planner, PlanConfig(microbatch_tokens=b, chunk_size=chunk_size, **extra))
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
    # measured kernel seconds of the scaled categories, where profiled: {"attention", "kda"}
    device_by_category: tuple[tuple[str, float], ...] | None = None
    # the passes in the executor's order (`executor_passes`); None: each microbatch's
    # forward and backward in turn
    passes: tuple[tuple[tuple[int, ...], Phase], ...] | None = None

    @property
    def microbatches(self) -> int:
        return len(self.features)


def case_of(name: str, kind: str, step: StepWork, model: ModelConfig, hardware: HardwareProfile,
            device_by_category: dict[str, float] | None = None, **truth: float | None) -> Case:
    """`device_by_category`: a profiled step's kernel seconds by category (`harts sim
    validate`'s categories); its attention and KDA seconds are kept for the category fits."""
    cost = ExecutorCostModel(model, ParallelConfig(dp=1, pp=1, ep=1), hardware)
    feats = tuple(microbatch_features(cost, step))
    cats = None
    if device_by_category:
        cats = tuple((k, float(device_by_category[k])) for k in CATEGORY_TRUTHS if k in device_by_category)
    return Case(name, kind, feats, cost.optimizer(0) - _fixed(cost.rates), device_by_category=cats,
                passes=executor_passes(step), **truth)


# the measured categories the category scales are fitted to
CATEGORY_TRUTHS = ("attention", "kda")
# a category under this many kernel seconds in a step is left out of the fit (timer noise)
_MIN_CATEGORY_S = 1e-3


def category_seconds(rates: ExecutorRates, case: Case) -> dict[str, float]:
    """The step's device seconds of attention and KDA, as `harts sim validate` reports them."""
    out = dict.fromkeys(CATEGORY_TRUTHS, 0.0)
    scales = (rates.attention_tree_scale, rates.attention_causal_scale, rates.kda_scale)
    for f in case.features:
        eff = rates.device_scale * efficiency_factor(rates, f.rows)
        for parts, times in ((f.fwd_parts, f.forward_passes), (f.bwd_parts, 1.0)):
            out["attention"] += (scales[0] * parts[0] + scales[1] * parts[1]) * eff * times
            out["kda"] += scales[2] * parts[2] * eff * times
    return out


def _fixed(rates: ExecutorRates) -> float:
    return rates.launches_per_step * rates.host_s_per_launch + rates.step_fixed_s


def predict(rates: ExecutorRates, case: Case) -> float:
    return step_seconds_1gpu(rates, case.features, case.optimizer_s, case.passes)


def host_rate_to_match(rates: ExecutorRates, case: Case, measured_s: float, widest: float = 10.0) -> float | None:
    """The host seconds per launch at which the executor model prices `case` at
    `measured_s`, every other rate kept: the host speed a measured step implies. None
    where no rate in [0, `widest` x the profile's] does: the step's device side alone
    prices above the measurement, or the host would have to be more than `widest` times
    slower. The price never falls as the host rate grows, so a bisection finds it."""
    h0 = rates.host_s_per_launch

    def at(h: float) -> float:
        return predict(rates.with_values(host_s_per_launch=h), case)

    lo, hi = 0.0, widest * h0
    if at(lo) > measured_s or at(hi) < measured_s:
        return None
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if at(mid) < measured_s else (lo, mid)
    return 0.5 * (lo + hi)


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
    # with a category scale among the names, each profiled step's attention and KDA
    # seconds are residuals too (the step's total alone hardly tells the scales apart)
    cats = [(i, k, x) for i, c in enumerate(cases) for k, x in (c.device_by_category or ())
            if x >= _MIN_CATEGORY_S] if target == "device" and set(names) & set(CATEGORY_SCALES) else []

    def residuals(z: np.ndarray) -> np.ndarray:
        r = base.with_values(**dict(zip(names, z * scale, strict=True)))
        res = np.log(np.array([model(r, c) for c in cases]) / truth)
        if not cats:
            return res
        per = [category_seconds(r, c) for c in cases]
        return np.concatenate([res, np.log(np.maximum([per[i][k] for i, k, _ in cats], 1e-30)
                                           / np.array([x for *_, x in cats]))])

    sol = least_squares(residuals, np.ones(len(names)), bounds=(0.0, np.inf), x_scale=1.0)
    fitted = base.with_values(**dict(zip(names, sol.x * scale, strict=True)))
    res = residuals(sol.x)
    out = {"cases": len(cases), "rms_log_error": float(np.sqrt(np.mean(res[:len(cases)] ** 2))),
           "max_abs_log_error": float(np.max(np.abs(res[:len(cases)])))}
    if cats:
        out["category_rms_log_error"] = float(np.sqrt(np.mean(res[len(cases):] ** 2)))
    return fitted, out


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
