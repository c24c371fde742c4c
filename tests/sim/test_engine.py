"""The discrete-event engine on random programs: dependencies, lanes, gangs, memory,
lower bounds, determinism, deadlock detection."""

from __future__ import annotations

import pytest
from hypothesis import given

from harts.sim.engine import Action, DeadlockError, Program, execute, lower_bound
from tests.strategies import sim_programs

EPS = 1e-9


def check_trace(program: Program, trace) -> None:
    ev = trace.events
    for a in program.actions:
        e = ev[a.idx]
        assert e.end >= e.start
        for d in a.deps:
            assert e.start >= ev[d].end - EPS, f"{a.name} starts before its dependency {program.actions[d].name}"
    for order in program.lane_order.values():
        for i, j in zip(order, order[1:], strict=False):
            assert ev[j].start >= ev[i].end - EPS, "a lane ran two actions at once or out of order"
    gangs: dict[str, list[int]] = {}
    for a in program.actions:
        if a.gang:
            gangs.setdefault(a.gang, []).append(a.idx)
    for members in gangs.values():
        assert len({ev[m].start for m in members}) == 1
        assert len({ev[m].end for m in members}) == 1
        assert ev[members[0]].end - ev[members[0]].start == pytest.approx(
            max(program.actions[m].duration for m in members))


@given(sim_programs())
def test_random_programs_respect_dependencies_lanes_and_bounds(program):
    trace = execute(program)
    check_trace(program, trace)
    cp, lane = lower_bound(program)
    assert trace.makespan >= cp - EPS
    assert trace.makespan >= lane - EPS
    for rank, low in trace.min_memory.items():
        assert low >= program.static_memory.get(rank, 0.0) - EPS >= -EPS
        # every buffer is freed and every transient released: back to the static footprint
        assert trace.memory_timeline[rank][-1][1] == pytest.approx(program.static_memory.get(rank, 0.0))
    assert execute(program) == trace


def test_gang_waits_for_slowest_member_and_late_arrival():
    # lane A: a0 (2 s) then the gang member a1 (1 s); lane B: gang member b (3 s)
    acts = (
        Action(0, "a0", "X", (0, 0, "compute"), 2.0),
        Action(1, "a1", "X", (0, 0, "compute"), 1.0, gang="g"),
        Action(2, "b", "X", (1, 0, "compute"), 3.0, gang="g"),
    )
    prog = Program(acts, {(0, 0, "compute"): (0, 1), (1, 0, "compute"): (2,)})
    tr = execute(prog)
    assert (tr.events[1].start, tr.events[1].end) == (2.0, 5.0)
    assert (tr.events[2].start, tr.events[2].end) == (2.0, 5.0)


def test_memory_peak_counts_held_buffers_and_transients():
    lane = (0, 0, "compute")
    acts = (
        Action(0, "f", "F", lane, 1.0, alloc=(("act", 10.0),), transient=5.0),
        Action(1, "b", "B", lane, 1.0, deps=(0,), free=("act",), transient=7.0),
    )
    tr = execute(Program(acts, {lane: (0, 1)}, {(0, 0): 100.0}))
    assert tr.peak_memory[(0, 0)] == 117.0
    assert [v for _, v in tr.memory_timeline[(0, 0)]] == [100.0, 115.0, 110.0, 117.0, 100.0]


def test_deadlock_is_reported():
    # the lane order runs b before a, but b depends on a
    lane = (0, 0, "compute")
    acts = (Action(0, "a", "X", lane, 1.0), Action(1, "b", "X", lane, 1.0, deps=(0,)))
    with pytest.raises(DeadlockError, match="lanes wait at"):
        execute(Program(acts, {lane: (1, 0)}))


def test_program_rejects_actions_missing_from_lanes():
    lane = (0, 0, "compute")
    with pytest.raises(ValueError, match="exactly once"):
        Program((Action(0, "a", "X", lane, 1.0),), {lane: ()})
