"""The order of a one-replica tree plan's blocks, by the host-ahead recurrence.

A *block* is a run of a replica's execution order that nothing outside it depends on: a
standalone microbatch, or a top-level producer with everything up to the end of its
window (`Plan.window_last`: its consumers, nested windows and whatever runs inside). Blocks
are independent, so any order of them is a valid plan with the same rows, values and
memory budget (each block's microbatches keep their order and their memory charge).

Their order matters to a host-bound executor. The host issues a microbatch's kernel
launches in about the same time whatever its rows (`PlanConfig.microbatch_floor`, plus
`consumer_floor` for a window consumer, in the load model's token equivalents), and it
runs ahead of the device: while the device works through a large microbatch the host is
already issuing the next. A small microbatch at the start of the step (a window's
producer holding only a short shared prompt, say) leaves the device idle while the host
issues it; after a large one, it is issued while the device works off the large one's
queue. `host_ahead_load` prices an order so, one action per pass (`passes`: a
microbatch's forward, `forward_fraction` of its load and floor, and its backward, in the
executor's order, a producer's backward after its last consumer's), with `S` the action's start, `H` the
host's issue clock and `E` the device's end:

    S = max(E, H);  H += floor;  E = max(S + load, H)

(`load` as `common.floored_loads` takes it: overhead + cost, + `consumer_row_cost` per
producer row read by a consumer). `order_blocks` keeps the order that prices lowest of
every permutation of up to `EXHAUSTIVE_BLOCKS` blocks, else of the planner's order, that
order with one block moved to the front, and the blocks by falling first-microbatch load;
the planner's own wins ties. Without floors every order prices the sum of the loads and
the plan is returned as it is.

Only plans of one replica without a pipeline are reordered (`PlanConfig.dp == 1`,
`pp == 1`): across replicas the slots line microbatches up for their collectives, and a
pipeline's schedule orders its own microbatches.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from harts.config.plan import PlanConfig
from harts.plan.plan import Microbatch, Plan, PlanMode

# blocks up to which every permutation is priced (6! = 720 recurrences of a few items)
EXHAUSTIVE_BLOCKS = 6


def blocks(plan: Plan, replica: int = 0) -> list[list[Microbatch]]:
    """The replica's execution order cut into blocks (module docstring)."""
    seq = plan.replica_sequence(replica)  # orders 0, 1, ... (`Plan.validate`)
    last = plan.window_last()
    out: list[list[Microbatch]] = []
    i = 0
    while i < len(seq):
        end = j = i
        # a block closes when no window opened in it reaches past its last microbatch
        while j <= end:
            end = max(end, last.get(seq[j].id, j))
            j += 1
        out.append(seq[i:end + 1])
        i = end + 1
    return out


def host_ahead_load(loads: Sequence[float], floors: Sequence[float]) -> float:
    """The device's end, in load units, of microbatches run in this order (module
    docstring): `loads[i]` and `floors[i]` are the i-th one's device load and host issue
    time."""
    s_host = s_end = 0.0
    for load, floor in zip(loads, floors, strict=True):
        start = max(s_end, s_host)
        s_host += floor
        s_end = max(start + load, s_host)
    return s_end


def _prices(plan: Plan, config: PlanConfig) -> tuple[dict[int, float], dict[int, float]]:
    rows = {m.id: m.executed_tokens for m in plan.microbatches}
    over = config.cost_model.microbatch_overhead
    load, floor = {}, {}
    for m in plan.microbatches:
        load[m.id], floor[m.id] = over + m.cost, config.microbatch_floor
        if m.producer is not None:
            load[m.id] += config.consumer_row_cost * rows[m.producer]
            floor[m.id] += config.consumer_floor
    return load, floor


def _candidates(bl: list[list[Microbatch]], load: dict[int, float]):
    n = len(bl)
    if n <= EXHAUSTIVE_BLOCKS:
        yield from itertools.permutations(range(n))
        return
    yield tuple(range(n))
    for k in range(1, n):
        yield (k, *range(k), *range(k + 1, n))
    yield tuple(sorted(range(n), key=lambda k: -load[bl[k][0].id]))


def order_blocks(plan: Plan, config: PlanConfig) -> Plan:
    """`plan` with its blocks in the order the host-ahead recurrence prices lowest (module
    docstring); `plan` itself where nothing is cheaper, where it is not a one-replica tree
    plan without a pipeline, or where the config has no floors. A reordered plan notes the
    prices in `info["block_order"]`."""
    if (plan.mode != PlanMode.TREE or config.dp != 1 or config.pp != 1
            or (config.microbatch_floor <= 0 and config.consumer_floor <= 0)):
        return plan
    bl = blocks(plan)
    if len(bl) < 2:
        return plan
    load, floor = _prices(plan, config)

    ff = config.cost_model.forward_fraction
    consumers = plan.consumers()

    def price(perm: Sequence[int]) -> float:
        return _actions_load([m.id for k in perm for m in bl[k]], consumers, load, floor, ff)

    base = price(range(len(bl)))
    best, best_price = None, base
    for perm in _candidates(bl, load):
        p = price(perm)
        if p < best_price * (1 - 1e-9):
            best, best_price = perm, p
    if best is None:
        return plan
    mbs = list(plan.microbatches)
    slot = 0
    for order, m in enumerate(m for k in best for m in bl[k]):
        # a producer carries the slot of the microbatch after it (`Plan` docstring)
        mbs[m.id] = dataclasses.replace(m, order=order, slot=slot)
        if m.id not in consumers:
            slot += 1
    info = {**plan.info, "block_order": {"blocks": len(bl), "host_ahead_load": [base, best_price],
                                         "first_microbatches": [bl[k][0].id for k in best]}}
    return dataclasses.replace(plan, microbatches=tuple(mbs), info=info)


def plan_host_ahead_load(plan: Plan, config: PlanConfig) -> float:
    """`host_ahead_load` of a one-replica plan's passes in its execution order."""
    load, floor = _prices(plan, config)
    return _actions_load([m.id for m in plan.replica_sequence(0)], plan.consumers(), load, floor,
                         config.cost_model.forward_fraction)


def passes(seq: Sequence[int], consumers: dict[int, list[int]]) -> list[tuple[int, bool]]:
    """(microbatch id, is forward) of the microbatches `seq` (execution order) in the order
    the executor runs their passes (`harts.sim.executor.executor_passes`, the one-stage
    consumer-1f1b schedule): each forward in order, a consumer's or standalone microbatch's
    backward right after its forward, a producer's right after its last consumer's backward,
    so a chain runs its forwards and then its backwards, last piece first."""
    pos = {m: i for i, m in enumerate(seq)}
    waiting: dict[int, list[int]] = {}
    for p, cs in consumers.items():
        if p in pos:
            waiting.setdefault(max(cs, key=pos.__getitem__), []).append(p)
    out: list[tuple[int, bool]] = []

    def backward(m: int) -> None:
        out.append((m, False))
        for p in waiting.get(m, ()):
            backward(p)

    for m in seq:
        out.append((m, True))
        if m not in consumers:
            backward(m)
    return out


def _actions_load(seq: Sequence[int], consumers: dict[int, list[int]], load: dict[int, float],
                  floor: dict[int, float], ff: float) -> float:
    """`host_ahead_load` of the `passes` of `seq`: a forward takes `ff` of a microbatch's
    load and floor, its backward the rest."""
    acts = passes(seq, consumers)
    share = [ff if fwd else 1 - ff for _, fwd in acts]
    return host_ahead_load([x * load[m] for x, (m, _) in zip(share, acts, strict=True)],
                           [x * floor[m] for x, (m, _) in zip(share, acts, strict=True)])
