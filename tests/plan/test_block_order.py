"""A one-replica plan's independent blocks in the order the host-ahead recurrence prices
lowest (harts.plan.order)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.config.models import get_model_config
from harts.config.plan import PlanConfig
from harts.plan import order
from harts.plan.planners import make_plan
from harts.tree import build_forest, shapes
from tests.strategies import device_host_actions, plan_configs, plan_forests

MODEL = get_model_config("tiny-h200")


def test_host_ahead_load_by_hand():
    """Loads 2, 15, 15 with a host issue time of 10 each: the small one first leaves the
    device idle while the host issues it (ends 10, 25, 40); after a large one it is issued
    while the device works (15, 20, 35)."""
    assert order.host_ahead_load([2.0, 15.0, 15.0], [10.0] * 3) == pytest.approx(40.0)
    assert order.host_ahead_load([15.0, 2.0, 15.0], [10.0] * 3) == pytest.approx(35.0)
    # host-bound throughout: the host's clock
    assert order.host_ahead_load([1.0, 1.0, 1.0], [10.0] * 3) == pytest.approx(30.0)


@given(device_host_actions())
def test_host_ahead_load_is_at_least_either_side(actions):
    """The device's end is at least its total work and at least the host's issue time, and
    with no host time it is the plain sum."""
    loads = [d for d, _ in actions]
    floors = [h for _, h in actions]
    got = order.host_ahead_load(loads, floors)
    assert got >= sum(loads) * (1 - 1e-12) and got >= sum(floors) * (1 - 1e-12)
    assert order.host_ahead_load(loads, [0.0] * len(actions)) == pytest.approx(sum(loads))


@pytest.mark.parametrize("instance", ["stepwise/11@16384", "grpo/2@16384", "bushy/2@4096", "long-agent/1@16384",
                                      "long-group/2@16384"])
def test_passes_are_the_executor_order_the_simulator_prices(instance):
    """`order.passes` lists a plan's forwards and backwards in the order of
    `harts.sim.executor.executor_passes` (the one-stage consumer-1f1b schedule): windows,
    chains of windows (forwards, then backwards last piece first) and nested ones."""
    from harts.plan.step import step_from_plan
    from harts.sim.executor import executor_passes
    from harts.sim.ops import Phase

    family, rest = instance.split("/")
    seed, budget = (int(x) for x in rest.split("@"))
    forest = build_forest(shapes.draw(family, seed, budget, vocab_size=MODEL.vocab_size))
    plan = make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=budget, chunk_size=MODEL.chunk_size))
    assert plan.consumers()
    step = step_from_plan(plan, forest, MODEL.chunk_size)
    want = [(step.microbatches[i].mb, phase == Phase.FWD) for idxs, phase in executor_passes(step) for i in idxs]
    assert order.passes([m.id for m in plan.replica_sequence(0)], plan.consumers()) == want


def test_a_window_is_priced_by_its_passes():
    """A producer of load 2, its consumer and a standalone microbatch of 15 each, a floor of
    10 each and forwards a half of both: passes P.f C.f C.b P.b S.f S.b, each device end by
    the recurrence 5, 12.5, 20, 21, 28.5, 36."""
    got = order._actions_load([0, 1, 2], {0: [1]}, {0: 2.0, 1: 15.0, 2: 15.0}, dict.fromkeys(range(3), 10.0), 0.5)
    assert got == pytest.approx(36.0)


def _floored(config: PlanConfig, floor: float, consumer: float) -> PlanConfig:
    return dataclasses.replace(config, microbatch_floor=floor, consumer_floor=consumer)


@settings(max_examples=25, deadline=None)
@given(st.data(), st.floats(0.0, 400.0), st.floats(0.0, 100.0))
def test_reordered_plans_keep_their_blocks(data, floor, consumer):
    """`order_blocks` on any one-replica tree plan: a valid plan of the same microbatches
    (trajectories, pieces, context, producer unchanged), each block's microbatches
    contiguous and in their own order, priced no higher than the planner's order."""
    forest = data.draw(plan_forests())
    config = _floored(dataclasses.replace(data.draw(plan_configs(forest)), dp=1), floor, consumer)
    plan = make_plan(forest, "l1", dataclasses.replace(config, microbatch_floor=0.0, consumer_floor=0.0))
    for planned in (plan, make_plan(forest, "l1l2", dataclasses.replace(config, microbatch_floor=0.0,
                                                                       consumer_floor=0.0))):
        got = order.order_blocks(planned, config)
        got.validate(forest, budget=config.microbatch_tokens)
        strip = lambda m: dataclasses.replace(m, order=0, slot=0)  # noqa: E731
        assert [strip(m) for m in got.microbatches] == [strip(m) for m in planned.microbatches]
        seq = [m.id for m in got.replica_sequence(0)]
        for block in order.blocks(planned):
            ids = [m.id for m in block]
            at = seq.index(ids[0])
            assert seq[at:at + len(ids)] == ids
        before = order.plan_host_ahead_load(planned, config)
        after = order.plan_host_ahead_load(got, config)
        assert after <= before * (1 + 1e-12)
        if got is not planned:
            assert got.info["block_order"]["host_ahead_load"] == pytest.approx([before, after])


def test_the_standalone_tree_runs_before_a_small_producer():
    """stepwise/11 at 16,384: l1l2's window plan is a 2,062-row producer (its shared
    prompt), its consumer and a 15k-row standalone tree. With a floor of 10,000 token
    equivalents the standalone tree runs first, and the window after it."""
    forest = build_forest(shapes.draw("stepwise", 11, 16384, vocab_size=MODEL.vocab_size))
    config = PlanConfig(microbatch_tokens=16384, chunk_size=MODEL.chunk_size)
    plan = make_plan(forest, "l1l2", config)
    roles = [str(plan.role(m.id)) for m in plan.replica_sequence(0)]
    assert roles == ["producer", "consumer", "standalone"]
    got = order.order_blocks(plan, dataclasses.replace(config, microbatch_floor=10_000.0))
    assert [str(got.role(m.id)) for m in got.replica_sequence(0)] == ["standalone", "producer", "consumer"]
    assert got.info["block_order"]["first_microbatches"] == [2, 0]
    # without floors, or on two replicas, the planner's order stays
    assert order.order_blocks(plan, config) is plan
    assert order.order_blocks(plan, dataclasses.replace(config, dp=2, microbatch_floor=10_000.0)) is plan


def test_a_reordered_plan_trains_the_same_numbers():
    """float64 on the CPU: the window plan of a drawn forest and the same plan with its
    blocks in another order give the same loss and gradients (the order of the blocks'
    gradient accumulation only), within 1e-12 relative."""
    from harts.exec.loss import PolicyLossConfig
    from harts.exec.model.model import build_model
    from harts.exec.window import PlanTrainer
    from harts.tree.workload import generate_trajectories
    from harts.verify.equivalence import compare_steps

    # tiny-treestep seed 2: two window trees of two and three microbatches
    trajs = generate_trajectories("tiny-treestep", seed=2)
    forest = build_forest(trajs)
    budget = max(int(forest.traj_length.max()) + 5, forest.compact_tokens // 4)
    cfg = get_model_config("tiny-cpu").replace(chunk_size=8, aux_scope="global")
    config = PlanConfig(microbatch_tokens=budget, chunk_size=8)
    plan = make_plan(forest, "l1l2", config)
    bl = order.blocks(plan)
    assert len(bl) >= 2, "the budget must leave more than one block"
    # the blocks reversed: a valid order that `order_blocks` may or may not pick
    mbs = list(plan.microbatches)
    consumers, slot = plan.consumers(), 0
    for o, m in enumerate(m for b in reversed(bl) for m in b):
        mbs[m.id] = dataclasses.replace(m, order=o, slot=slot)
        slot += m.id not in consumers
    other = dataclasses.replace(plan, microbatches=tuple(mbs))
    other.validate(forest, budget=budget)
    assert [m.id for m in other.replica_sequence(0)] != [m.id for m in plan.replica_sequence(0)]
    runs = []
    for p in (plan, other):
        model = build_model(cfg, seed=3, dtype=torch.float64)
        runs += [PlanTrainer(model, p, loss=PolicyLossConfig(kl_coef=0.1)).forward_backward(trajs, 1 << 20), model]
    rep = compare_steps(*runs)
    assert rep["max_rel_logprob_err"] <= 1e-12 and rep["max_rel_grad_err"] <= 1e-12, rep["worst_grad_params"]
    assert all(err <= 1e-12 for err in rep["loss_abs_err"].values())
