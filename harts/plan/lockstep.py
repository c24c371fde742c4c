"""The lockstep of an expert-parallel group: which forwards and backwards its replicas run
together, from a plan's microbatches.

With expert parallelism every MoE layer of a forward or a backward is an all-to-all over
the EP group, so the group's replicas run one sequence of passes, each replica one pass
per event (its own or a *shadow* over zero rows), and a backward meets the graphs its
peers built in the forward it met. Each replica's own passes come in its window run's
order (`sequences`): a producer's forward (F), a non-producer's forward and backward (FB),
and after a consumer the backwards (B) of the producers whose windows it closes, nearest
first (in a chain of windows one consumer's end closes every window up the chain whose
last consumer that producer was). The windows of one replica nest.

The group's *joint events* merge those sequences (`_merge`): every event one kind, at most
one pass of each replica; producers that share a forward event share their backward event
(their peers' shadow forwards are kept until it). The merge goes event by event, taking
the earliest slot's work first: the producers' forwards that are next (of the earliest
slot, or of any slot), every next forward-backward of that slot, or the backwards of a
group of producers once each of them is next. It never blocks: the most recently opened
group's members each have its backward as their next backward (the windows nest).
Pairing producers makes each wait at the shared backward for the one whose window holds
the most work, so a merge pairs only the forwards whose windows hold at least a fraction
`alpha` of the largest one's rows (the others pair among themselves after). Of the merges
(`MERGES`: producers paired within a slot or across slots, at each `alpha`) the one with
the smallest price is kept: per event its largest pass, a pass priced max(rows,
`PASS_FLOOR_ROWS`) times its share of a forward and backward.

The executor runs these events (`harts.distributed.runner`, its window run pausing
between a cascade's backwards); the simulator runs the same passes in the same gangs
(`harts.sim.simulate.lockstep_schedule`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MERGES", "JointEvent", "joint_events", "sequences", "window_rows"]

# the rows below which a pass costs about the same whatever its rows (host-bound launches:
# the executor model's microbatch floor is 12k rows on the shipped h100 profile at 16k),
# for choosing between the merges only
PASS_FLOOR_ROWS = 8192.0
_FORWARD_SHARE = 1.0 / 3.0
# (producers paired across slots, alpha) of the merges tried
MERGES = tuple((across, alpha) for across in (False, True) for alpha in (0.0, 0.25, 0.5, 0.75, 1.0))


@dataclass(frozen=True)
class JointEvent:
    """One step of an EP group's lockstep: `kind` F (producers' forwards), FB (forward and
    backward of non-producers) or B (producers' backwards), and the microbatch each
    replica runs in it (replicas not named run a shadow). `key`: F and B, its smallest
    producer id (pairs a shadow forward with its backward); FB, its earliest slot."""

    kind: str
    members: dict[int, int]
    key: int


def sequences(microbatches: Sequence[Any], replicas: Sequence[int],
              ident: Callable[[Any], int] = lambda m: m.id) -> dict[int, list[tuple[str, int, int]]]:
    """Each replica's passes in its window run's order, (kind, microbatch id, slot): a
    producer's forward, a non-producer's forward and backward, then the backwards of the
    producers whose windows that closes, nearest first (a backward takes its closing
    consumer's slot). Raises ValueError where a replica's windows do not nest."""
    by_id = {ident(m): m for m in microbatches}
    consumers: dict[int, list[int]] = {}
    for m in sorted(microbatches, key=lambda m: m.order):
        if m.producer is not None:
            consumers.setdefault(m.producer, []).append(ident(m))
    last = {p: max(cs, key=lambda c: by_id[c].order) for p, cs in consumers.items()}
    out: dict[int, list[tuple[str, int, int]]] = {}
    for r in replicas:
        own: list[tuple[str, int, int]] = []
        open_: list[int] = []
        for m in sorted((m for m in microbatches if m.replica == r), key=lambda m: m.order):
            mid = ident(m)
            if mid in consumers:
                own.append(("F", mid, m.slot))
                open_.append(mid)
                continue
            own.append(("FB", mid, m.slot))
            done = mid
            while by_id[done].producer is not None and last[by_id[done].producer] == done:
                done = by_id[done].producer
                if not open_ or open_.pop() != done:
                    raise ValueError(f"replica {r}: producer {done}'s window closes inside another; "
                                     "the replicas' collectives cannot be aligned")
                own.append(("B", done, m.slot))
        out[r] = own
    return out


def joint_events(microbatches: Sequence[Any], replicas: Sequence[int],
                 ident: Callable[[Any], int] = lambda m: m.id,
                 rows: Callable[[Any], int] = lambda m: m.executed_tokens) -> list[JointEvent]:
    """The lockstep of `replicas` (an EP group) over `microbatches` (each with `replica`,
    `order`, `slot`, `producer`, the id `ident` reads and the rows `rows` reads: a
    `Plan`'s or, with `rows=lambda m: m.tokens`, a `StepWork`'s); see the module doc."""
    seqs = sequences(microbatches, replicas, ident)
    size = {ident(m): float(rows(m)) for m in microbatches}
    work = {p: w for seq in seqs.values() for p, w in window_rows(seq, size).items()}
    merges = [_merge(seqs, work, across, alpha) for across, alpha in MERGES]
    return min(merges, key=lambda evs: _price(evs, size))


def window_rows(seq: list[tuple[str, int, int]], size: dict[int, float]) -> dict[int, float]:
    """Per producer of a replica's sequence, the rows of its window: its own and those of
    every pass between its forward and its backward."""
    out: dict[int, float] = {}
    open_: list[tuple[int, float]] = []
    for kind, mb, _ in seq:
        if kind == "B":
            p, w = open_.pop()
            out[p] = w
            continue
        open_ = [(p, w + size[mb]) for p, w in open_]
        if kind == "F":
            open_.append((mb, size[mb]))
    return out


def _price(events: list[JointEvent], size: dict[int, float]) -> float:
    share = {"F": _FORWARD_SHARE, "B": 1.0 - _FORWARD_SHARE, "FB": 1.0}
    return sum(share[e.kind] * max(max(size[m], PASS_FLOOR_ROWS) for m in e.members.values()) for e in events)


_PHASE = {"F": 0, "FB": 1, "B": 2}


def _merge(seqs: dict[int, list[tuple[str, int, int]]], work: dict[int, float], across: bool,
           alpha: float = 0.0) -> list[JointEvent]:
    """The joint events of the replicas' sequences (module doc): producers' forwards paired
    across slots (`across`) or within the earliest slot of those next, and only those whose
    windows hold at least `alpha` x the largest one's rows (`work`: `window_rows` of every
    producer)."""
    pos = dict.fromkeys(seqs, 0)
    groups: list[dict[int, int]] = []  # open producer groups, in the order they opened
    events: list[JointEvent] = []
    while True:
        nxt = {r: s[pos[r]] for r, s in seqs.items() if pos[r] < len(s)}
        if not nxt:
            return events
        options: list[tuple[str, dict[int, tuple[str, int, int]]]] = []
        for g in groups:
            if all(nxt.get(r, ("",))[0] == "B" and nxt[r][1] == mb for r, mb in g.items()):
                options.append(("B", {r: nxt[r] for r in g}))
        for kind in ("F", "FB"):
            ready = {r: it for r, it in nxt.items() if it[0] == kind}
            if ready and not (kind == "F" and across):
                first = min(it[2] for it in ready.values())
                ready = {r: it for r, it in ready.items() if it[2] == first}
            if ready and kind == "F":
                most = max(work[it[1]] for it in ready.values())
                ready = {r: it for r, it in ready.items() if work[it[1]] >= alpha * most}
            if ready:
                options.append((kind, ready))
        if not options:  # cannot happen where every replica's windows nest (`sequences`)
            raise RuntimeError("the EP group's lockstep is blocked")
        kind, chosen = min(options, key=lambda o: (min(it[2] for it in o[1].values()), _PHASE[o[0]], -len(o[1])))
        members = {r: it[1] for r, it in chosen.items()}
        if kind == "F":
            groups.append(members)
        elif kind == "B":
            groups.remove(members)
        for r in chosen:
            pos[r] += 1
        key = min(it[2] for it in chosen.values()) if kind == "FB" else min(members.values())
        events.append(JointEvent(kind, members, key))
