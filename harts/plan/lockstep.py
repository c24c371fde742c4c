"""The lockstep of an expert-parallel group: which forwards and backwards its replicas run
together, from a plan's slots.

With expert parallelism every MoE layer of a forward or a backward is an all-to-all over
the EP group, so the group's replicas run one sequence of forwards and backwards, and a
replica's k-th backward meets the graphs its peers built in the forward it met. The
group's *joint events* give that sequence: per slot, each producer's forward (one producer
per event: its peers' part, a *shadow* over zero rows, is kept until that producer's
backward), then one event for every replica's non-producer microbatch of the slot
(forward and backward), then each window's producer backward. In a chain of windows one
consumer's end closes its producer's window and, in turn, every window up the chain whose
last consumer that producer was: their backwards follow, nearest first, the first of them
the one resume of the member's window run (`JointEvent.resumes`).

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
    """One step of an EP group's lockstep: `kind` F (a producer's forward), FB (forward and
    backward of non-producers) or B (a producer's backward), and the microbatch each
    replica runs in it (replicas not named run a shadow). At a B event whose member's
    backward ran in the resume of an earlier one (`resumes` False, a chain's), the member
    runs nothing, and the other replicas run their shadows' backwards in the same order."""

    kind: str
    members: dict[int, int]
    key: int  # the producer id for F and B (pairs a shadow forward with its backward)
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
    items.sort(key=lambda x: (x[0], x[1], x[2]))  # stable: each replica's cascade stays in order
    events: list[JointEvent] = []
    for slot, _phase, r, kind, mb, resumes in items:
        if kind == "FB" and events and events[-1].kind == "FB" and events[-1].key == slot \
                and r not in events[-1].members:
            events[-1].members[r] = mb
        else:
            events.append(JointEvent(kind, {r: mb}, slot if kind == "FB" else mb, resumes))
    return events
