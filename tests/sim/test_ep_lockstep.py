"""On one stage the simulator runs an EP group's passes as the executor does: the joint
events of `harts.plan.lockstep` (the executor's own, `harts.distributed.runner`), each
replica's microbatches where it is a member and zero-token shadows where it is not, one
event's passes as one gang; chains of windows included."""

from __future__ import annotations

import pytest

from harts.config.models import get_model_config
from harts.config.parallel import ParallelConfig
from harts.config.plan import PlanConfig
from harts.plan.lockstep import joint_events
from harts.plan.planners import make_plan
from harts.plan.schedule import build_schedule
from harts.plan.step import step_from_plan
from harts.sim.costs import make_cost_model
from harts.sim.hardware import load_hardware
from harts.sim.simulate import lockstep_schedule, simulate_step
from harts.tree import build_forest
from tests.strategies import long_chain_trajectories

MODEL = get_model_config("tiny-h200")


def _step(planner: str, dp: int):
    # the short tree (16 tokens) fits no window-tree leaf, so it stays a microbatch of its
    # own on one replica and the others run shadows beside it (a 9-token one would ride in a
    # leaf: `leaves.fill_leaves`)
    trajs = long_chain_trajectories(70, [(19, 12), (32, 20), (33, 5), (60, 6)], seed=2, groups=dp, short=16)
    forest = build_forest(trajs)
    plan = make_plan(forest, planner, PlanConfig(microbatch_tokens=24, chunk_size=8, dp=dp))
    return plan, step_from_plan(plan, forest, 8)


@pytest.mark.parametrize("planner, dp, ep", [("l1l2", 2, 2), ("l1", 4, 2), ("expanded-ffd", 2, 2),
                                             ("l1l2", 4, 4)])
def test_the_simulated_lockstep_is_the_executors(planner, dp, ep):
    plan, step = _step(planner, dp)
    by_id = {m.mb: m for m in step.microbatches}
    assert any(m.producer is not None and by_id[m.producer].producer is not None for m in step.microbatches)
    padded, sched = lockstep_schedule(step, ep, "consumer-1f1b")
    real = {m.mb for m in step.microbatches}
    for g in range(dp // ep):
        group = range(g * ep, (g + 1) * ep)
        # the simulator's events are the executor's (the plan's and its step's microbatches agree)
        events = joint_events(step.microbatches, group, ident=lambda m: m.mb, rows=lambda m: m.tokens)
        assert events == joint_events(plan.microbatches, group)
        for r in group:
            ops = sched.ops(r, 0)
            want = []
            for ev in events:
                mine = ev.members.get(r)
                kinds = {"F": "F", "FB": "FB", "B": "B"}[ev.kind]
                want += [(k, mine) for k in kinds]
            assert [(op.kind, op.mbs[0] if op.mbs[0] in real else None) for op in ops] == want
            # a shadow has no tokens and runs its forward and backward on its own replica
            for op in ops:
                if op.mbs[0] not in real:
                    assert padded[op.mbs[0]].tokens == 0 and padded[op.mbs[0]].replica == r
    assert padded.expanded_tokens == step.expanded_tokens
    cost = make_cost_model("executor", MODEL, ParallelConfig(dp=dp, ep=ep), load_hardware("h100"))
    res = simulate_step(step, build_schedule("consumer-1f1b", step, 1), cost)
    assert res.ep_lockstep
    # the step's own microbatches are counted as such, the shadows apart
    assert res.num_microbatches == len(step.microbatches)
    assert res.ep_shadows == len(padded.microbatches) - len(step.microbatches) > 0
    gangs: dict[str, list[int]] = {}
    for a in res.program.actions:
        if a.gang and a.gang.startswith("ep:"):
            gangs.setdefault(a.gang, []).append(a.idx)
    assert gangs and all(len(m) == ep for m in gangs.values())
    for members in gangs.values():
        assert len({res.trace.events[m].start for m in members}) == 1
    # a shadow prices its fixed work only: no pass over no rows costs the device more
    # than the cheapest real pass of the same kind
    device = {}
    for a in res.program.actions:
        if a.kind in ("F", "PF", "B", "PB") and a.mbs:
            device.setdefault((a.kind[-1], a.mbs[0] in real), []).append(a.duration)
    for kind in ("F", "B"):
        assert max(device[(kind, False)]) <= min(device[(kind, True)])
