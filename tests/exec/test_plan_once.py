"""A plan's step structure is made once: the executor's KDA schedules come from the plan's
own KDA call plans (the ones the simulator prices), array for array what it would plan
from its layouts, and `PlanTrainer` builds and validates the forest once per plan and
trajectories, with unchanged results."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

import harts.exec.layouts.plan as plan_layout
import harts.exec.tree_layout as tree_layout
import harts.plan.step as plan_step
from harts.config.models import get_model_config
from harts.config.plan import PlanConfig
from harts.exec.loss import PolicyLossConfig
from harts.exec.model.model import build_model
from harts.exec.tree_layout import LocalLayout, plan_replay_schedule, replay_schedule
from harts.exec.window import PlanTrainer, piece_rows
from harts.plan.plan import Plan
from harts.plan.planners import make_plan
from harts.plan.step import plan_kda_calls_of, step_from_plan
from harts.tree import build_forest
from harts.tree.workload import generate_trajectories

_plan_kda_calls = plan_step.plan_kda_calls


def _plan(workload, seed, chunk, planner, dp=1, frac=3):
    trajs = generate_trajectories(workload, seed=seed)
    forest = build_forest(trajs)
    budget = max(int(forest.traj_length.max()) + 5, forest.compact_tokens // frac)
    return trajs, forest, make_plan(forest, planner, PlanConfig(dp=dp, microbatch_tokens=budget, chunk_size=chunk))


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, tuple | list):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(_same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


@pytest.mark.parametrize("chunk", [4, 16, 64])
@pytest.mark.parametrize("workload,seed,dp,frac", [("tiny-treestep", 1, 1, 3), ("tiny-treestep", 2, 2, 6),
                                                   ("tiny-stepwise", 1, 1, 3), ("small-treestep", 1, 2, 6)])
@pytest.mark.parametrize("planner", ["l1l2", "l1"])
def test_the_plans_kda_calls_give_the_schedule_the_layout_plans(workload, seed, dp, frac, chunk, planner):
    _, forest, plan = _plan(workload, seed, chunk, planner, dp, frac)
    kda = plan_kda_calls_of(plan, forest, chunk)
    for m in plan.microbatches:
        layout = LocalLayout.of_rows(forest, piece_rows(forest, m.pieces), piece_rows(forest, m.context))
        assert _same(plan_replay_schedule(layout, forest, kda[m.id]), replay_schedule(layout, chunk)), m.id


def test_the_simulator_and_the_executor_share_one_kda_plan(monkeypatch):
    trajs, forest, plan = _plan("tiny-treestep", 1, 8, "l1l2")
    calls = []
    monkeypatch.setattr(plan_step, "plan_kda_calls", lambda *a: calls.append(1) or _plan_kda_calls(*a))
    monkeypatch.setattr(tree_layout, "plan_kda_calls", lambda *a: pytest.fail("the executor planned KDA calls"))
    step_from_plan(plan, forest, 8)
    assert len(calls) == plan.num_microbatches
    model = build_model(get_model_config("tiny-cpu").replace(chunk_size=8), seed=3, dtype=torch.float64)
    PlanTrainer(model, plan).prepare(trajs, 1 << 20)
    step_from_plan(plan, build_forest(trajs), 8)  # another forest of the same trajectories
    assert len(calls) == plan.num_microbatches


@pytest.fixture
def one_thread():
    # bit-for-bit comparisons of CPU steps: with several threads some float reductions'
    # order varies from run to run, forest reused or not
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_plan_trainer_builds_and_validates_the_forest_once(monkeypatch, one_thread):
    trajs, _, plan = _plan("tiny-treestep", 1, 8, "l1l2")
    assert plan.consumers()
    cfg = get_model_config("tiny-cpu").replace(chunk_size=8, aux_scope="global")
    loss = PolicyLossConfig(kl_coef=0.1)

    def run(rebuild: bool):
        model = build_model(cfg, seed=3, dtype=torch.float32)
        trainer = PlanTrainer(model, plan, loss=loss)
        out = []
        for _ in range(2):
            if rebuild:
                trainer.layout._forest_cache = None
            r = trainer.step(trajs, 1 << 20)
            out.append(({k: float(v) for k, v in r.losses.items()}, float(r.grad_norm)))
        return out, {n: p.detach().clone() for n, p in model.named_parameters()}

    builds, checks = [], []
    build, validate = plan_layout.build_forest, Plan.validate
    monkeypatch.setattr(plan_layout, "build_forest", lambda t: builds.append(1) or build(t))
    monkeypatch.setattr(Plan, "validate", lambda self, *a, **k: checks.append(1) or validate(self, *a, **k))
    cached = run(rebuild=False)
    assert len(builds) == len(checks) == 1  # the second step reused the first one's forest
    rebuilt = run(rebuild=True)
    assert len(builds) == len(checks) == 3
    # the same losses, gradient norms and updated parameters, bit for bit
    assert cached[0] == rebuilt[0]
    assert all(torch.equal(cached[1][n], rebuilt[1][n]) for n in cached[1])


def test_new_trajectory_objects_rebuild_the_forest(monkeypatch):
    trajs, _, plan = _plan("tiny-treestep", 1, 8, "l1")
    builds = []
    build = plan_layout.build_forest
    monkeypatch.setattr(plan_layout, "build_forest", lambda t: builds.append(1) or build(t))
    model = build_model(get_model_config("tiny-cpu").replace(chunk_size=8), seed=3, dtype=torch.float64)
    trainer = PlanTrainer(model, plan)
    trainer.prepare(trajs, 1 << 20)
    trainer.prepare(list(trajs), 1 << 20)  # the same objects in a new list: reused
    assert len(builds) == 1
    trainer.prepare([replace(t) for t in trajs], 1 << 20)  # equal, but other objects: rebuilt
    assert len(builds) == 2
