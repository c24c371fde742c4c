"""The plan's memory rule: what each microbatch holds in token units (`Plan.memory_tokens`,
checked against `microbatch_tokens` by `Plan.validate`)."""

from __future__ import annotations

from typing import Any

# `plan` below is a `harts.plan.plan.Plan` (which imports this module: no import back)


def memory_tokens(plan: Any) -> list[float]:
    """Activation memory (token units) each microbatch of `plan` needs, retained windows
    included.

    A microbatch inside windows pays `producer_retention` x the rows of the innermost
    open window's producer that its consumers read (`read_rows`: what the producer
    keeps for them; the producer's other rows wait in host memory on CUDA). With
    one-level windows (windows disjoint) that is the only open window. Inside a chain of
    windows the outer producers' saved tensors wait in host memory (on CUDA,
    `harts.exec.offload`), and their stashes, which the running microbatch reads
    (`harts.exec.stash.ChainStash`), are not charged: each holds about its own rows'
    attention keys/values, linear in the chain's depth up to the rows the executor keeps
    on the device (`KernelConfig.chain_stash_device_budgets`; farther ones wait in host
    memory), not a bound this rule gives (docs/ARCHITECTURE.md, "Chains of windows").

    With `chain_retention` set, a chain piece that continues its producer's rows inside a
    node (`continues`) pays the smaller of that charge and `chain_retention` x its context
    rows (`chain_charge`): what it holds for every row above it, the stashes of the pieces
    it reads and the transient of reading them."""
    mbs = plan.microbatches
    mem = [float(mb.executed_tokens) for mb in mbs]
    inner: dict[int, tuple[int, int]] = {}  # mb -> (producer order, producer id)
    for p, end in plan.window_last().items():
        prod = mbs[p]
        for mb in mbs:
            if mb.replica == prod.replica and prod.order < mb.order <= end:
                if mb.id not in inner or inner[mb.id][0] < prod.order:
                    inner[mb.id] = (prod.order, p)
    read = {p: read_rows(plan, p) for p in {p for _, p in inner.values()}}
    for m, (_, p) in inner.items():
        charge = plan.producer_retention * read[p]
        mb = mbs[m]
        if mb.producer == p:
            charge = consumer_charge(charge, plan.chain_retention, mb.pieces, mbs[p].pieces,
                                     sum(e - a for _, a, e in mb.context))
        mem[m] += charge
    return mem


def continues(pieces, producer_pieces) -> bool:
    """Whether a microbatch with `pieces` ((node, start, end) each) starts inside a node
    where its producer's rows (`producer_pieces`) end: a chain piece cut inside a node."""
    ends = {(v, e) for v, _, e in producer_pieces}
    return any(a > 0 and (v, a) in ends for v, a, _ in pieces)


def consumer_charge(producer_charge: float, chain_retention: float | None, pieces, producer_pieces,
                    context_rows: int) -> float:
    """What a consumer with `pieces` pays beside its rows under its producer (computing
    `producer_pieces`): the producer's charge, or where `chain_retention` is set and the
    consumer `continues` the producer's rows, the `chain_charge` over its `context_rows`."""
    if chain_retention is not None and continues(pieces, producer_pieces):
        return chain_charge(producer_charge, chain_retention, context_rows)
    return producer_charge


def chain_charge(producer_charge: float, chain_retention: float, context_rows: int) -> float:
    """What a chain piece that continues its producer pays beside its rows: the smaller
    of the producer's charge and `chain_retention` x its context rows."""
    return min(producer_charge, chain_retention * context_rows)


def read_rows(plan: Any, producer: int) -> int:
    """How many of the rows `producer` computes its consumers read as context (each row
    once, however many read it)."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for m in plan.microbatches:
        if m.producer == producer:
            for pc in m.context:
                spans.setdefault(pc.node, []).append((pc.start, pc.end))
    total = 0
    for pc in plan.microbatches[producer].pieces:
        reach = -1
        for a, e in sorted(spans.get(pc.node, ())):
            a, e = max(a, pc.start, reach), min(e, pc.end)
            if e > a:
                total += e - a
                reach = e
    return total
