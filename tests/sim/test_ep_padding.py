"""EP lockstep needs the replicas of an EP group to run the same passes: `pad_ep_groups`
adds zero-token microbatches where a replica's window has fewer members than its peers'."""

from __future__ import annotations

import pytest
from hypothesis import given

from harts.config.models import get_model_config
from harts.config.plan import PlanConfig
from harts.plan.planners import make_plan
from harts.plan.schedule import build_schedule
from harts.plan.step import step_from_plan
from harts.sim.costs import make_cost_model
from harts.sim.hardware import load_hardware
from harts.sim.parallel import default_parallel
from harts.sim.simulate import pad_ep_groups, simulate_step
from harts.tree.workload import generate, preset
from tests.strategies import sim_steps


def _shape(step, r):
    return [(w.producer is None, len(w.consumers)) for w in step.replica_windows(r)]


@given(sim_steps())
def test_padding_aligns_window_shapes_and_adds_no_work(step):
    padded = pad_ep_groups(step, step.num_replicas)
    kinds = {tuple(k for k, _ in _shape(step, r)) for r in range(step.num_replicas)}
    if len(kinds) > 1:
        assert padded is None  # window sequences that differ in kind cannot be padded
        return
    assert len({tuple(_shape(padded, r)) for r in range(padded.num_replicas)}) == 1
    assert padded.total_tokens() == step.total_tokens()
    assert padded.expanded_tokens == step.expanded_tokens
    old = {m.mb: m for m in step.microbatches}
    for m in padded.microbatches:
        assert m == old[m.mb] if m.mb in old else (m.tokens == 0 and m.expanded_tokens == 0)
    if len({tuple(_shape(step, r)) for r in range(step.num_replicas)}) == 1:
        assert padded is step


def test_a_planned_step_runs_in_lockstep():
    """swe-treestep-8 at budget 65536 gives replicas windows of 3 and 2 consumers: padded,
    the EP group's passes run as gangs (before padding the simulator fell back)."""
    model = get_model_config("tiny")
    par = default_parallel(model, 8)
    # the shape these targets were set on: the generator with its copies at the context cap
    # and last-turn forks (`allow_duplicates`, `last_turn_branching`)
    forest = generate(preset("swe-treestep-8", allow_duplicates=True, last_turn_branching=True)).forest()
    plan = make_plan(forest, "l1l2", PlanConfig(dp=par.dp, pp=par.pp, microbatch_tokens=65536))
    step = step_from_plan(plan, forest, model.chunk_size)
    assert len({tuple(_shape(step, r)) for r in range(par.dp)}) > 1
    cost = make_cost_model("roofline", model, par, load_hardware("h200"))
    res = simulate_step(step, build_schedule("consumer-1f1b", step, par.pp), cost)
    assert res.ep_lockstep
    free = simulate_step(step, build_schedule("consumer-1f1b", step, par.pp), cost, ep_lockstep=False)
    assert not free.ep_lockstep
    # padding adds passes, not tokens: both count the step's expanded tokens
    assert res.throughput * res.step_seconds == pytest.approx(step.expanded_tokens)
    assert free.throughput * free.step_seconds == pytest.approx(step.expanded_tokens)
