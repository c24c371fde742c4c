"""The lockstep of an expert-parallel group: which forwards and backwards its replicas run
together, from a plan's slots.

With expert parallelism every MoE layer of a forward or a backward is an all-to-all over
the EP group, so the group's replicas run one sequence of forwards and backwards, and a
backward meets the graphs its peers built in the forward it met. The group's *joint
events* give that sequence: per slot, the producers' forwards, then one event for every
replica's non-producer microbatch of the slot (forward and backward), then the producers'
backwards. Producers of different replicas share a forward event where they also share
their backward event (`_events`); a producer whose peers have no such partner has events
of its own, in which they run a *shadow* over zero rows, kept from the forward to that
producer's backward. In a chain of windows one consumer's end closes its producer's
window and, in turn, every window up the chain whose last consumer that producer was:
their backwards follow, nearest first, the first of them the one resume of the member's
window run (`JointEvent.resumes`).

The executor runs these events (`harts.distributed.runner`); the simulator runs the same
passes in the same gangs (`harts.sim.simulate.lockstep_schedule`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["JointEvent", "joint_events"]


@dataclass(frozen=True)
class JointEvent:
    """One step of an EP group's lockstep: `kind` F (producers' forwards), FB (forward and
    backward of non-producers) or B (producers' backwards), and the microbatch each
    replica runs in it (replicas not named run a shadow). At a B event whose member's
    backward ran in the resume of an earlier one (`resumes` False, a chain's), the member
    runs nothing, and the other replicas run their shadows' backwards in the same order."""

    kind: str
    members: dict[int, int]
    key: int  # F and B: its smallest producer id (pairs a shadow forward with its backward)
    resumes: bool = True  # B: the member's window run resumes here (False: it ran in the last resume)


def joint_events(microbatches: Sequence[Any], replicas: Sequence[int],
                 ident: Callable[[Any], int] = lambda m: m.id) -> list[JointEvent]:
    """The lockstep of `replicas` (an EP group) over `microbatches` (each with `replica`,
    `order`, `slot`, `producer` and the id `ident` reads: a `Plan`'s or a `StepWork`'s);
    each replica's own events are in its order (checked)."""
    by_id = {ident(m): m for m in microbatches}
    consumers: dict[int, list[int]] = {}
    for m in sorted(microbatches, key=lambda m: m.order):
        if m.producer is not None:
            consumers.setdefault(m.producer, []).append(ident(m))
    last = {p: max(cs, key=lambda c: by_id[c].order) for p, cs in consumers.items()}
    items = []  # (slot, phase, replica, kind, mb, resumes)
    for r in replicas:
        seq = sorted((m for m in microbatches if m.replica == r), key=lambda m: m.order)
        own = []
        for m in seq:
            mid = ident(m)
            if mid in consumers:
                own.append((m.slot, 0, r, "F", mid, True))
                continue
            own.append((m.slot, 1, r, "FB", mid, True))
            # one resume of the window run: the backward of every producer whose window
            # this closes, in turn up a chain of windows
            done, first = mid, True
            while by_id[done].producer is not None and last[by_id[done].producer] == done:
                done = by_id[done].producer
                own.append((m.slot, 2, r, "B", done, first))
                first = False
        if [x[:2] for x in own] != sorted(x[:2] for x in own):
            raise ValueError(f"replica {r}: its microbatch order does not follow its slots; "
                             "the replicas' collectives cannot be aligned")
        items.extend(own)
    return _events(items)


def _events(items: list[tuple]) -> list[JointEvent]:
    """The events of the group's items (slot, phase, replica, kind, mb, resumes), slot by
    slot: producer forwards, then forward-backwards, then producer backwards.

    Producers of different replicas share their events where they can: the k-th forwards
    of a slot's replicas run as one event where the same producers' backwards are, in
    turn, the k-th backwards of one slot (each backward meets the graphs its peers built in
    its forward), and where every replica's backwards of that slot run in such shared
    events (a replica's backwards run in one resume of its window run, so its events
    there must come one after another). Elsewhere each producer's forward and backward is
    an event of its own, its peers running shadows, and a slot's backwards go replica by
    replica."""
    by: dict[tuple[int, int], dict[int, list[tuple]]] = {}
    for it in items:
        by.setdefault((it[0], it[1]), {}).setdefault(it[2], []).append(it)

    def zipped(block: dict[int, list[tuple]]) -> list[dict[int, tuple]]:
        return [{r: its[k] for r, its in sorted(block.items()) if k < len(its)}
                for k in range(max(len(its) for its in block.values()))]

    def pairs(group: dict[int, tuple]) -> frozenset:
        return frozenset((r, it[4]) for r, it in group.items())

    slots = sorted({s for s, _ in by})
    fwd = {s: zipped(by[(s, 0)]) for s in slots if (s, 0) in by}
    bwd = {s: zipped(by[(s, 2)]) for s in slots if (s, 2) in by}
    shared = {pairs(g) for gs in fwd.values() for g in gs if len(g) > 1}
    shared &= {pairs(g) for gs in bwd.values() for g in gs if len({it[5] for it in g.values()}) == 1}
    changed = True
    while changed:  # a slot whose backwards cannot all be shared shares none
        changed = False
        for gs in bwd.values():
            if any(len(g) > 1 and pairs(g) not in shared for g in gs) and any(pairs(g) in shared for g in gs):
                shared -= {pairs(g) for g in gs}
                changed = True

    events: list[JointEvent] = []

    def add(kind: str, group: dict[int, tuple], key: int) -> None:
        events.append(JointEvent(kind, {r: it[4] for r, it in group.items()}, key,
                                 all(it[5] for it in group.values())))

    for s in slots:
        for g in fwd.get(s, ()):
            if pairs(g) in shared:
                add("F", g, min(it[4] for it in g.values()))
            else:
                for r, it in g.items():
                    add("F", {r: it}, it[4])
        for r, its in sorted(by.get((s, 1), {}).items()):
            for k, it in enumerate(its):  # one forward-backward event per slot and position
                if k == 0 and events and events[-1].kind == "FB" and events[-1].key == s \
                        and r not in events[-1].members:
                    events[-1].members[r] = it[4]
                else:
                    add("FB", {r: it}, s)
        gs = bwd.get(s, ())
        if gs and all(len(g) == 1 or pairs(g) in shared for g in gs):
            for g in gs:
                add("B", g, min(it[4] for it in g.values()))
        else:
            for r, its in sorted(by.get((s, 2), {}).items()):
                for it in its:
                    add("B", {r: it}, it[4])
    return events
