"""The discrete-event engine: lanes run actions; no knowledge of pipelines or planners.

A `Program` is a set of actions, each on one lane (a GPU's compute stream or its
communication stream) with a duration, dependencies, memory it allocates when it starts and
buffers it frees when it ends. Which action a free lane runs next is the policy's choice
(`Policy.select`); `StaticOrder` runs each lane's list in order, which is what a schedule
is. An action in a *gang* (a collective) starts on all its lanes at once, when every member
is ready, and all members last as long as the slowest.

Determinism: events at equal times are processed by action index (ends before starts), and
lanes are polled in sorted order, so identical programs give identical traces.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "Action",
    "DeadlockError",
    "Policy",
    "Program",
    "StaticOrder",
    "Trace",
    "TraceEvent",
    "execute",
    "lower_bound",
]

Lane = tuple[int, int, str]  # (replica, stage, "compute" | "comm")
Rank = tuple[int, int]


@dataclass(frozen=True)
class Action:
    idx: int
    name: str
    kind: str
    lane: Lane
    duration: float
    deps: tuple[int, ...] = ()
    gang: str | None = None
    mbs: tuple[int, ...] = ()
    alloc: tuple[tuple[str, float], ...] = ()  # buffers allocated at start (held)
    free: tuple[str, ...] = ()  # buffers freed at end
    transient: float = 0.0  # workspace held only while running
    # seconds the lane's host spends issuing the action's kernels (0: not modelled). The
    # host issues a lane's actions in the order they start and never waits for the device,
    # so it runs ahead through device-bound actions; an action ends at max(its start +
    # duration, the end of its issue), with `duration` the device's time
    host: float = 0.0

    @property
    def rank(self) -> Rank:
        return self.lane[0], self.lane[1]


@dataclass(frozen=True)
class Program:
    actions: tuple[Action, ...]
    lane_order: dict[Lane, tuple[int, ...]]  # static order per lane (all actions of the lane)
    static_memory: dict[Rank, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for i, a in enumerate(self.actions):
            if a.idx != i:
                raise ValueError(f"action {a.name}: idx {a.idx} != position {i}")
            for d in a.deps:
                if not 0 <= d < len(self.actions) or d == i:
                    raise ValueError(f"action {a.name}: bad dependency {d}")
        seen = [0] * len(self.actions)
        for lane, order in self.lane_order.items():
            for i in order:
                if self.actions[i].lane != lane:
                    raise ValueError(f"action {self.actions[i].name} listed on lane {lane}")
                seen[i] += 1
        if any(c != 1 for c in seen):
            raise ValueError("every action must appear exactly once in the lane orders")


class Policy(Protocol):
    def select(self, lane: Lane, position: int, ready: Sequence[int], program: Program) -> int | None:
        """The action the free lane starts now (one of `ready`), or None to wait."""


class StaticOrder:
    """Run each lane's list in order: the lane waits until its next action is ready."""

    def select(self, lane: Lane, position: int, ready: Sequence[int], program: Program) -> int | None:
        order = program.lane_order[lane]
        if position >= len(order):
            return None
        nxt = order[position]
        return nxt if nxt in ready else None


class DeadlockError(RuntimeError):
    pass


@dataclass(frozen=True)
class TraceEvent:
    idx: int
    name: str
    kind: str
    replica: int
    stage: int
    lane: str
    start: float
    end: float
    mbs: tuple[int, ...]


@dataclass(frozen=True)
class Trace:
    events: tuple[TraceEvent, ...]  # by action index
    makespan: float
    peak_memory: dict[Rank, float]
    memory_timeline: dict[Rank, tuple[tuple[float, float], ...]]  # (time, bytes in use)
    min_memory: dict[Rank, float]

    def busy(self, lane_kind: str = "compute") -> dict[Rank, float]:
        out: dict[Rank, float] = {}
        for e in self.events:
            if e.lane == lane_kind:
                out[(e.replica, e.stage)] = out.get((e.replica, e.stage), 0.0) + (e.end - e.start)
        return out


def execute(program: Program, policy: Policy | None = None) -> Trace:
    policy = policy or StaticOrder()
    acts = program.actions
    n = len(acts)
    remaining = [len(a.deps) for a in acts]
    dependents: list[list[int]] = [[] for _ in range(n)]
    for a in acts:
        for d in a.deps:
            dependents[d].append(a.idx)
    lanes = sorted(program.lane_order)
    pos = {lane: 0 for lane in lanes}
    busy = {lane: False for lane in lanes}
    ready: dict[Lane, list[int]] = {lane: [] for lane in lanes}
    for a in acts:
        if remaining[a.idx] == 0:
            ready[a.lane].append(a.idx)
    gangs: dict[str, list[int]] = {}
    for a in acts:
        if a.gang is not None:
            gangs.setdefault(a.gang, []).append(a.idx)
    arrived: dict[str, list[int]] = {}
    start = [0.0] * n
    end = [0.0] * n
    started = [False] * n
    finished = 0
    ranks = sorted({a.rank for a in acts} | set(program.static_memory))
    mem = {r: float(program.static_memory.get(r, 0.0)) for r in ranks}
    peak = dict(mem)
    low = dict(mem)
    timeline: dict[Rank, list[tuple[float, float]]] = {r: [(0.0, mem[r])] for r in ranks}
    buffers: dict[tuple[Rank, str], float] = {}
    heap: list[tuple[float, int]] = []
    t = 0.0
    issued = {lane: 0.0 for lane in lanes}  # where each lane's host has issued up to

    def note(rank: Rank) -> None:
        v = mem[rank]
        timeline[rank].append((t, v))
        if v > peak[rank]:
            peak[rank] = v
        if v < low[rank]:
            low[rank] = v

    def begin(i: int, duration: float) -> None:
        a = acts[i]
        started[i] = True
        start[i] = t
        end[i] = t + duration
        heapq.heappush(heap, (end[i], i))
        rank = a.rank
        for key, size in a.alloc:
            if (rank, key) in buffers:
                raise ValueError(f"action {a.name}: buffer {key} allocated twice")
            buffers[(rank, key)] = size
            mem[rank] += size
        mem[rank] += a.transient
        if a.alloc or a.transient:
            note(rank)

    def poll(lane: Lane) -> None:
        if busy[lane]:
            return
        choice = policy.select(lane, pos[lane], ready[lane], program)
        if choice is None:
            return
        ready[lane].remove(choice)
        busy[lane] = True
        a = acts[choice]
        if a.gang is None:
            begin(choice, issue(choice))
            return
        members = arrived.setdefault(a.gang, [])
        members.append(choice)
        if len(members) == len(gangs[a.gang]):
            duration = max(issue(m) for m in members)
            for m in sorted(members):
                begin(m, duration)

    def issue(i: int) -> float:
        """The action's duration from now: its device time, or longer where its lane's
        host is still issuing it (`Action.host`)."""
        a = acts[i]
        if a.host <= 0.0:
            return a.duration
        issued[a.lane] += a.host
        return max(a.duration, issued[a.lane] - t)

    for lane in lanes:
        poll(lane)
    while heap:
        t = heap[0][0]
        done: list[int] = []
        while heap and heap[0][0] == t:
            done.append(heapq.heappop(heap)[1])
        touched: set[Lane] = set()
        for i in sorted(done):
            a = acts[i]
            rank = a.rank
            mem[rank] -= a.transient
            for key in a.free:
                size = buffers.pop((rank, key), None)
                if size is None:
                    raise ValueError(f"action {a.name}: frees unknown buffer {key}")
                mem[rank] -= size
            if a.free or a.transient:
                note(rank)
            busy[a.lane] = False
            pos[a.lane] += 1
            finished += 1
            touched.add(a.lane)
            for j in dependents[i]:
                remaining[j] -= 1
                if remaining[j] == 0:
                    ready[acts[j].lane].append(j)
                    touched.add(acts[j].lane)
        for lane in sorted(touched):
            poll(lane)
    if finished != n:
        stuck = [
            acts[program.lane_order[lane][pos[lane]]].name
            for lane in lanes
            if pos[lane] < len(program.lane_order[lane])
        ]
        raise DeadlockError(f"{n - finished} actions never ran; lanes wait at: {', '.join(stuck[:12])}")
    events = tuple(
        TraceEvent(a.idx, a.name, a.kind, a.lane[0], a.lane[1], a.lane[2], start[a.idx], end[a.idx], a.mbs)
        for a in acts
    )
    makespan = max(end) if n else 0.0
    return Trace(
        events, makespan, peak, {r: tuple(v) for r, v in timeline.items()}, low
    )


def lower_bound(program: Program) -> tuple[float, float]:
    """(critical path, busiest lane): each is a lower bound on the makespan.

    The critical path takes every action's own duration along dependency chains (it
    ignores lanes and gang synchronisation, which only delay); a gang member counts with
    the gang's duration, the slowest member's, since that is how long it occupies its lane.
    """
    acts = program.actions
    dur = [a.duration for a in acts]
    gang_max: dict[str, float] = {}
    for a in acts:
        if a.gang is not None:
            gang_max[a.gang] = max(gang_max.get(a.gang, 0.0), a.duration)
    for a in acts:
        if a.gang is not None:
            dur[a.idx] = gang_max[a.gang]
    # topological order by Kahn's algorithm over dependencies
    indeg = [len(a.deps) for a in acts]
    dependents: list[list[int]] = [[] for _ in acts]
    for a in acts:
        for d in a.deps:
            dependents[d].append(a.idx)
    stack = [i for i, k in enumerate(indeg) if k == 0]
    finish = [0.0] * len(acts)
    seen = 0
    while stack:
        i = stack.pop()
        seen += 1
        s = max((finish[d] for d in acts[i].deps), default=0.0)
        finish[i] = s + dur[i]
        for j in dependents[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                stack.append(j)
    if seen != len(acts):
        raise DeadlockError("dependency cycle")
    cp = max(finish, default=0.0)
    lane_sum = max((sum(dur[i] for i in order) for order in program.lane_order.values()), default=0.0)
    return cp, lane_sum
