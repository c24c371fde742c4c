"""l1l2 without a pipeline repacks windows into fewer slots, the producer taking items
whole, and on one replica tries a window per tree (`harts.plan.planners.l1l2.absorb`; on
several replicas each saves as many slots):
against the same plan without that pass, a valid plan with that many microbatches fewer, the same rows computed
(every row once where it was), a total load lower by their overheads, every microbatch
within the budget under the memory rule, which charges only the producer rows consumers
read. Steps of such plans equal the expanded step in float64 and float32
(tests/exec/test_window.py draws them too)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.exec.loss import PolicyLossConfig
from harts.exec.model.model import build_model
from harts.exec.trainer import ExpandedTrainer
from harts.exec.window import PlanTrainer
from harts.plan.memory import chain_charge, continues
from harts.plan.planners import PlanConfig, make_plan
from harts.plan.planners.l1l2 import pipeline
from harts.tree import build_forest, shapes
from harts.verify.equivalence import compare_steps
from tests.exec.test_window import _check, _config
from tests.exec.test_window_chains import TOL32
from tests.strategies import plan_forests, shape_instances, tight_plan_configs


def _both(forest, config):
    """(plan, the same plan without the repack)."""
    plan = make_plan(forest, "l1l2", config)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "take_into_producers", lambda cells, cfg, solver=None: (cells, 0))
        cells = make_plan(forest, "l1l2", config)
    return plan, cells


LOSS = PolicyLossConfig()  # drawn shapes carry no reference log-probs


def _run(cls, cfg, trajs, *args, dtype=torch.float64):
    model = build_model(cfg, seed=3, dtype=dtype)
    return model, cls(model, *args, loss=LOSS).forward_backward(trajs, 1 << 20)


@settings(max_examples=30, deadline=None)
@given(plan_forests().flatmap(lambda f: st.tuples(st.just(f), tight_plan_configs(f))), st.integers(1, 2))
def test_absorbed_plans_are_valid_and_cheaper(forest_config, dp):
    forest, config = forest_config
    config = dataclasses.replace(config, dp=dp, pp=1)
    plan, cells = _both(forest, config)
    plan.validate(forest, cost_model=config.cost_model)
    absorbed = plan.info.get("microbatches_saved", 0)
    if plan.info.get("chosen") == "l1" or cells.info.get("chosen") == "l1":
        return
    # each replica saves the same number of microbatches
    for r in range(dp):
        count = [sum(m.replica == r for m in p.microbatches) for p in (plan, cells)]
        assert count[0] == count[1] - absorbed
    total = [sum(m.executed_tokens for m in p.microbatches) for p in (plan, cells)]
    assert total[0] == total[1]
    over = config.cost_model.microbatch_overhead
    cost = [sum(m.cost for m in p.microbatches) for p in (plan, cells)]
    assert cost[0] == pytest.approx(cost[1] - absorbed * dp * over, rel=1e-9, abs=1e-6)
    # the memory rule (which charges a consumer only the producer rows consumers read)
    # holds every microbatch within the budget
    mem = plan.memory_tokens()
    for m in plan.microbatches:
        assert mem[m.id] <= config.microbatch_tokens + 1e-6
    for m in plan.microbatches:
        assert m.executed_tokens <= config.microbatch_tokens


@pytest.mark.parametrize(("family", "seed"), [("stepwise", 1), ("stepwise", 2), ("stepwise", 3), ("grpo", 2)])
def test_windows_repacked_meet_the_compact_bound(family, seed):
    """At 16k the producer holds the shared prefixes (a few thousand rows), so the cells
    need one slot more than ceil(rows / budget); repacked, with the producer computing some
    trajectories whole, the plan meets the bound."""
    forest = build_forest(shapes.draw(family, seed, 16384))
    plan, cells = _both(forest, PlanConfig(microbatch_tokens=16384))
    bound = math.ceil(forest.compact_tokens / 16384)
    assert len(cells.microbatches) == bound + 1
    assert len(plan.microbatches) == bound and plan.info["microbatches_saved"] == 1
    prod = next(m for m in plan.microbatches if any(c.producer == m.id for c in plan.microbatches))
    assert prod.trajectories and plan.read_rows(prod.id) < prod.executed_tokens


def test_memory_rule_charges_only_the_rows_consumers_read():
    forest = build_forest(shapes.draw("stepwise", 2, 16384))
    plan = make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=16384))
    mem = plan.memory_tokens()
    for m in plan.microbatches:
        if m.producer is not None:
            charge = plan.producer_retention * plan.read_rows(m.producer)
            if plan.chain_retention is not None and continues(m.pieces, plan.microbatches[m.producer].pieces):
                charge = chain_charge(charge, plan.chain_retention, sum(e - a for _, a, e in m.context))
            assert mem[m.id] == pytest.approx(m.executed_tokens + charge)


@pytest.mark.parametrize(("family", "seed", "budget"), [("bushy", 1, 256), ("stepwise", 0, 256), ("grpo", 0, 256)])
def test_absorbed_window_steps_equal_the_expanded_step(family, seed, budget):
    cfg = _config(8)
    trajs = shapes.draw(family, seed, budget, vocab_size=cfg.vocab_size)
    forest = build_forest(trajs)
    plan = make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=budget, chunk_size=8))
    assert plan.info["microbatches_saved"] >= 1
    ref_model, ref = _run(ExpandedTrainer, cfg, trajs)
    model, got = _run(PlanTrainer, cfg, trajs, plan)
    _check(ref, ref_model, got, model)


def test_absorbed_window_step_in_float32():
    cfg = _config(8)
    trajs = shapes.draw("bushy", 1, 256, vocab_size=cfg.vocab_size)
    plan = make_plan(build_forest(trajs), "l1l2", PlanConfig(microbatch_tokens=256, chunk_size=8))
    assert plan.info["microbatches_saved"] >= 1
    ref_model, ref = _run(ExpandedTrainer, cfg, trajs, dtype=torch.float32)
    model, got = _run(PlanTrainer, cfg, trajs, plan, dtype=torch.float32)
    rep = compare_steps(ref, ref_model, got, model)
    assert rep["rms_rel_logprob_err"] <= TOL32 and rep["rms_rel_grad_err"] <= TOL32, rep


@settings(max_examples=6, deadline=None)
@given(shape_instances(budgets=(256, 384)))
def test_drawn_shape_steps_equal_the_expanded_step(instance):
    """Drawn shape instances at budgets of a few hundred rows, repacked or not (the test
    asserts nothing about whether they were): the window step equals the expanded one."""
    family, seed, budget = instance
    cfg = _config(8)
    trajs = shapes.draw(family, seed, budget, vocab_size=cfg.vocab_size)
    plan = make_plan(build_forest(trajs), "l1l2", PlanConfig(microbatch_tokens=budget, chunk_size=8))
    ref_model, ref = _run(ExpandedTrainer, cfg, trajs)
    model, got = _run(PlanTrainer, cfg, trajs, plan)
    _check(ref, ref_model, got, model)


def test_two_groups_in_one_window_are_split_into_a_window_each():
    """grpo/2 and grpo/4 at 16k in one forest: the cells put both prompts under one
    7-consumer window, whose consumers' room leaves no slot to save; a window per tree,
    each repacked, takes one microbatch fewer."""
    a = shapes.draw("grpo", 2, 16384)
    b = [dataclasses.replace(t, id=f"b/{t.id}", group=f"b/{t.group}") for t in shapes.draw("grpo", 4, 16384)]
    forest = build_forest(a + b)
    plan, cells = _both(forest, PlanConfig(microbatch_tokens=16384))
    plan.validate(forest)
    prods = {m.producer for m in plan.microbatches if m.producer is not None}
    assert len({m.producer for m in cells.microbatches if m.producer is not None}) == 1 and len(prods) == 2
    assert len(plan.microbatches) == len(cells.microbatches) - 1 == plan.info["microbatches_saved"] + 6
