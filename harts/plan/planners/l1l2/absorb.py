"""A window's smallest consumers taken into its producer, one microbatch fewer each.

A cell's producer holds its trunk and shaved prefixes, often far less than the budget,
and a cell's slots are filled to the budget less `producer_retention` x the producer's
rows, so a window plan often has one microbatch more than the forest's compact rows
need. A consumer whose rows fit beside the producer's (producer rows + consumer rows <=
budget) can run inside the producer instead: the producer computes its rows and owns its
trajectories. Every row is still computed once (a consumer's rows are its own, and no
other consumer reads them), the other consumers read the same context, and the memory
rule (`Plan.memory_tokens`) charges them only for the producer rows they read, so none
of them is charged more. What it buys: one microbatch's launches, weight reads and
gradient accumulation per consumer taken in. What it costs: the producer's forward and
backward hold more rows, and on CUDA more of its saved tensors wait in host memory
(`harts.exec.offload`, copies on a stream of their own).

Applied without a pipeline and on one replica (`PlanConfig.dp == pp == 1`), where the
slots run one after another and fewer of them only shortens the step; with several
replicas or stages the slots line up across them and one replica's fewer microbatches
would leave the others' slots alone. Smallest consumers first, while one fits."""

from __future__ import annotations

from harts.plan.planners.common import PlanConfig, TreeMB


def absorb_consumers(mbs: list[TreeMB], config: PlanConfig) -> list[TreeMB]:
    """`mbs` (one replica's window microbatches as `to_microbatches` places them, producers
    named by position) with each window's smallest consumers merged into its producer
    while producer rows + consumer rows <= budget; orders and slots renumbered. Returns
    `mbs` itself when nothing fits."""
    if config.dp != 1 or config.pp != 1:
        return mbs
    budget = config.microbatch_tokens
    gone: set[int] = set()
    for p, prod in enumerate(mbs):
        cons = sorted((i for i, m in enumerate(mbs) if m.producer == p), key=lambda i: (mbs[i].tokens, i))
        for c in cons:
            if prod.tokens + mbs[c].tokens > budget or not _merge(prod, mbs[c]):
                break
            gone.add(c)
    if not gone:
        return mbs
    keep = [i for i in range(len(mbs)) if i not in gone]
    where = {old: new for new, old in enumerate(keep)}
    out = [mbs[i] for i in keep]
    for m in out:
        if m.producer is not None:
            m.producer = where[m.producer]
    has_consumers = {m.producer for m in out if m.producer is not None}
    # orders in the old order; a slot per non-producer microbatch; a producer takes the slot
    # of the microbatch right after it (its first consumer)
    ranked = sorted(range(len(out)), key=lambda i: (out[i].replica, out[i].order))
    for order, i in enumerate(ranked):
        out[i].order = order
    slot = 0
    for i in ranked:
        if i in has_consumers:
            continue
        out[i].slot = slot
        slot += 1
    for k, i in enumerate(ranked):
        if i in has_consumers:
            nxt = ranked[k + 1] if k + 1 < len(ranked) else None
            out[i].slot = out[nxt].slot if nxt is not None else max(slot - 1, 0)
    return out


def _merge(prod: TreeMB, cons: TreeMB) -> bool:
    """Consumer `cons`'s rows and trajectories into `prod`; False (nothing changed) where a
    node's rows would not form one interval (a consumer row not continuing the producer's)."""
    for v, (a, e) in cons.rows.items():
        if v in prod.rows:
            pa, pe = prod.rows[v]
            if pe != a and e != pa:
                return False
    for v, (a, e) in cons.rows.items():
        if v in prod.rows:
            pa, pe = prod.rows[v]
            prod.rows[v] = (min(a, pa), max(e, pe))
        else:
            prod.rows[v] = (a, e)
    prod.trajs.extend(cons.trajs)
    prod.tokens += cons.tokens
    prod.cost += cons.cost
    return True
