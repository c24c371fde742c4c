"""Chains of sharing windows across processes (gloo, CPU): a forest whose trajectories are
2-4x the microbatch budget, planned into chains of windows by l1, l1l2 and expanded-ffd
(whose short trajectory is a packed microbatch), run under dp=2, under pp=2 and (l1l2) under
dp=2 with ep=2 (the replicas' chains in lockstep, `joint_events`) and under tp=2, equals the
single-process expanded step (float64: every log-prob, loss term, expert load
and gradient within 1e-10 relative; float32 within `TOL32` relative RMS error); so do
nested windows of a tree whose trajectories fit the budget, under dp=2 and pp=2, and one
long tree split over the dp=2 replicas (with ep=2, and with pp=2, too)."""

from __future__ import annotations

import pytest
import torch

from harts.distributed.mesh import parse_parallel
from harts.verify.distributed import verify_distributed_dtypes
from tests.distributed.cases import small_config
from tests.distributed.test_equivalence import _check_float32, _check_float64
from tests.strategies import long_chain_trajectories

BUDGET = 24


@pytest.mark.parametrize("spec, planner", [("dp=2", "l1l2"), ("dp=2", "expanded-ffd"), ("dp=2", "l1"),
                                           ("pp=2", "l1"), ("pp=2", "l1l2"), ("pp=2", "expanded-ffd"),
                                           ("dp=2,ep=2", "l1l2"), ("tp=2", "l1l2")],
                         ids=["dp2-l1l2", "dp2-expanded", "dp2-l1", "pp2-l1", "pp2-l1l2", "pp2-expanded",
                              "dp2ep2-l1l2", "tp2-l1l2"])
def test_chains_equal_the_expanded_reference(spec, planner):
    # two long trees (one per replica under dp=2), forks in a piece's first chunk, on a cut,
    # one past it and deep
    trajs = long_chain_trajectories(70, [(19, 12), (32, 20), (33, 5), (60, 6)], seed=2, groups=2)
    _equal_the_expanded_reference(trajs, spec, planner, small_config(), BUDGET)


@pytest.mark.parametrize("spec, planner", [("dp=2", "l1l2"), ("dp=2", "l1"), ("dp=2,ep=2", "l1l2"),
                                           ("dp=2,pp=2", "l1l2")],
                         ids=["dp2-l1l2", "dp2-l1", "dp2ep2-l1l2", "dp2pp2-l1l2"])
def test_a_tree_split_over_replicas_equals_the_expanded_reference(spec, planner):
    # one long tree under dp=2: split into two groups of trajectories, each group's paths
    # a window tree on its own rank (harts.plan.planners.tree_split)
    from harts.config.plan import PlanConfig
    from harts.plan.planners import make_plan
    from harts.tree import build_forest

    trajs = long_chain_trajectories(70, [(19, 12), (32, 20), (33, 5), (60, 6)], seed=2)
    parallel = parse_parallel(spec)
    plan = make_plan(build_forest(trajs), planner,
                     PlanConfig(dp=2, pp=parallel.pp, ep=parallel.ep, microbatch_tokens=BUDGET,
                                chunk_size=small_config().chunk_size))
    assert plan.info["split_trees"] == [2]
    _equal_the_expanded_reference(trajs, spec, planner, small_config(), BUDGET)


def _equal_the_expanded_reference(trajs, spec: str, planner: str, model, budget: int) -> None:
    rep64, rep32 = verify_distributed_dtypes(trajs, parallel=parse_parallel(spec), planner=planner,
                                             dtypes=(torch.float64, torch.float32), model=model,
                                             microbatch_tokens=budget, timeout=240)
    assert rep64["sharing_windows"] >= 2
    if parse_parallel(spec).pp > 1:
        # the pipeline's report has no whole-model gradient norm (each stage holds its part);
        # every rank ran the passes the simulator scheduled, chains depth-first
        for rep in (rep64, rep32):
            assert rep["executed_is_simulated"] is True
            rep["grad_norm"] = rep["ref_grad_norm"]
    _check_float64(rep64)
    _check_float32(rep32)


@pytest.mark.parametrize("spec", ["dp=2", "pp=2"])
def test_nested_window_trees_equal_the_expanded_reference(spec):
    # an SWE-agent tree whose trajectories all fit the budget but whose one window does
    # not: l1l2 runs it as nested windows (harts.plan.planners.l1l2.nested_trees)
    from harts.config.plan import PlanConfig
    from harts.plan.planners import make_plan
    from harts.tree import build_forest, shapes

    cfg = small_config()
    trajs = shapes.draw("swe-tree", 5, 256, vocab_size=cfg.vocab_size)
    degree = {"dp": 1, "pp": 1, spec[:2]: 2}
    plan = make_plan(build_forest(trajs), "l1l2", PlanConfig(microbatch_tokens=208, chunk_size=cfg.chunk_size,
                                                             dp=degree["dp"], pp=degree["pp"]))
    assert plan.info["nested_trees"] == 1
    _equal_the_expanded_reference(trajs, spec, "l1l2", cfg, 208)
