"""The discrete-event engine on random programs: dependencies, lanes, gangs, memory,
lower bounds, determinism, deadlock detection."""

from __future__ import annotations

import pytest
from hypothesis import given

from harts.sim.engine import Action, DeadlockError, Program, execute, lower_bound
from tests.strategies import device_host_actions, sim_programs

EPS = 1e-9


def check_trace(program: Program, trace) -> None:
    ev = trace.events
    for a in program.actions:
        e = ev[a.idx]
        assert e.end >= e.start + a.duration - EPS
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
        if not any(program.actions[m].host for m in members):
            assert ev[members[0]].end - ev[members[0]].start == pytest.approx(
                max(program.actions[m].duration for m in members))
    # a lane's host issues its actions in the order they start: none ends before its issue
    for order in program.lane_order.values():
        issued = 0.0
        for i in sorted(order, key=lambda i: (ev[i].start, order.index(i))):
            issued += program.actions[i].host
            assert ev[i].end >= issued - EPS


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


@given(sim_programs(hosts=True))
def test_random_programs_with_host_time_respect_dependencies_lanes_and_issue(program):
    trace = execute(program)
    check_trace(program, trace)
    assert execute(program) == trace


@given(device_host_actions())
def test_the_host_runs_ahead_of_the_device_on_one_lane(pairs):
    """In sequence on one lane the step is the recurrence end = max(previous end + device,
    issued host seconds): at least the device's and the host's totals, at most the sum of
    each action's max(device, host)."""
    lane = (0, 0, "compute")
    acts = tuple(Action(i, f"a{i}", "X", lane, d, host=h) for i, (d, h) in enumerate(pairs))
    tr = execute(Program(acts, {lane: tuple(range(len(acts)))}))
    issued = done = 0.0
    for d, h in pairs:
        issued += h
        done = max(done + d, issued)
    assert tr.makespan == pytest.approx(done, rel=1e-12, abs=1e-12)
    assert tr.makespan >= max(sum(d for d, _ in pairs), sum(h for _, h in pairs)) - EPS
    assert tr.makespan <= sum(max(d, h) for d, h in pairs) + EPS


def test_a_device_bound_action_hides_the_next_ones_host_time():
    # a0: 5 s of device, 1 s of host; a1: 1 s of device, 4 s of host. The host issues a1
    # while a0 runs (by 5 s), so a1 ends at 6 s, not at 5 + 4
    lane = (0, 0, "compute")
    acts = (Action(0, "a0", "X", lane, 5.0, host=1.0), Action(1, "a1", "X", lane, 1.0, host=4.0))
    tr = execute(Program(acts, {lane: (0, 1)}))
    assert (tr.events[1].start, tr.events[1].end) == (5.0, 6.0)
    # the other way round the host sets the pace: a0 ends when issued (4 s), a1 at 4 + 5
    acts = (Action(0, "a0", "X", lane, 1.0, host=4.0), Action(1, "a1", "X", lane, 5.0, host=1.0))
    tr = execute(Program(acts, {lane: (0, 1)}))
    assert [(e.start, e.end) for e in tr.events] == [(0.0, 4.0), (4.0, 9.0)]


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
