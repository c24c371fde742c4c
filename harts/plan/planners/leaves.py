"""Leaves of window trees filled: what moves into a chain's leaves (microbatches that
produce for none) once `harts.plan.planners.chains` has built its window trees.

- `sink_leaves`: within one window tree, a leaf moved into another leaf under the same
  producer or one below it, where it fits (a long trajectory's fork branches sharing one
  microbatch);
- `fill_leaves`: the planner's plain microbatches (whole short trees) moved into the
  window trees' leaves of their replica.
"""

from __future__ import annotations

from harts.config.plan import PlanConfig
from harts.plan.memory import consumer_charge
from harts.plan.planners.common import TreeMB

__all__ = ["fill_leaves", "sink_leaves", "sinks"]


def _pieces(mb: TreeMB) -> list[tuple[int, int, int]]:
    return [(v, a, e) for v, (a, e) in mb.rows.items()]


def _covered(mb: TreeMB, u: int) -> int:
    """How far from row 0 of node u microbatch `mb` has the rows, computed or read."""
    end = mb.context.get(u, (0, 0))[1]
    a, e = mb.rows.get(u, (0, 0))
    return e if e > a and a <= end else end


def sinks(config: PlanConfig) -> bool:
    """Whether `sink_leaves` moves any leaf under `config`: `PlanConfig.sink_leaves`, floors
    given (which leaves the host paces), one replica without a pipeline (the executor the
    floors price; the host-ahead block order, `harts.plan.order`, has the same scope)."""
    return (config.sink_leaves and config.microbatch_floor + config.consumer_floor > 0
            and config.dp == 1 and config.pp == 1)


def sink_leaves(mbs: list[TreeMB], producer_of: list[int | None], config: PlanConfig
                ) -> tuple[list[TreeMB], list[int | None]]:
    """A window tree with each leaf (a consumer that produces for none) moved into another
    leaf where it fits: one whose producer is the leaf's own or below it in the window tree
    and has every row of the leaf's context, computed or read, with room for both beside
    that producer's retained rows (`microbatch_tokens - producer_retention x producer
    rows`, the room `chain_windows` gives a leaf). The branches of a long trajectory's
    forks, each a small consumer of the piece it leaves, then share one microbatch under
    a later piece, which reads the longest of their root paths. Largest leaves first, each
    into the target it fills most tightly; returns the build without the moved leaves.

    Only leaves the host paces move: rows under a consumer's floor (`microbatch_floor +
    consumer_floor`, token equivalents of the host's time a microbatch; `PlanConfig`
    holds 0, `harts train` and `harts sim` derive them from the GPU's profile), and only on
    one replica without a pipeline (`sinks`). A larger leaf's own microbatch costs the
    device about what its rows cost anywhere, and the target grown by it would hold its
    rows beside a longer context."""
    if not sinks(config):
        return mbs, producer_of
    B, rho = config.microbatch_tokens, config.producer_retention
    floor = config.microbatch_floor + config.consumer_floor  # a leaf under it is host-paced
    n = len(mbs)
    producers = {p for p in producer_of if p is not None}

    def above(p: int | None) -> set[int]:
        out = set()
        while p is not None:
            out.add(p)
            p = producer_of[p]
        return out

    chain_above = [above(producer_of[i]) for i in range(n)]
    leaves = [i for i in range(n) if i not in producers and producer_of[i] is not None]
    gone: set[int] = set()
    for i in sorted(leaves, key=lambda i: (-mbs[i].tokens, i)):
        if i in gone or mbs[i].tokens >= floor:
            continue
        L = mbs[i]
        fits = []
        for j in leaves:
            if j == i or j in gone or producer_of[i] not in chain_above[j]:
                continue
            p = mbs[producer_of[j]]
            ctx = dict(mbs[j].context)  # the merged leaf's context: the longer of each root path
            for u, (_, e) in L.context.items():
                ctx[u] = (0, max(e, ctx.get(u, (0, 0))[1]))
            charge = consumer_charge(rho * p.tokens, config.chain_retention, _pieces(mbs[j]), _pieces(p),
                                     sum(e - a for a, e in ctx.values()))
            room = B - charge - mbs[j].tokens - L.tokens
            if room >= 0 and all(_covered(p, u) >= e for u, (_, e) in L.context.items()):
                fits.append((room, -j, j))
        if not fits:
            continue
        j = min(fits)[2]
        T = mbs[j]
        T.rows.update(L.rows)
        T.trajs.extend(L.trajs)
        T.tokens += L.tokens
        T.cost += L.cost
        for u, (_, e) in L.context.items():
            if e > T.context.get(u, (0, 0))[1]:
                T.context[u] = (0, e)
        gone.add(i)
    if not gone:
        return mbs, producer_of
    keep = [i for i in range(n) if i not in gone]
    new = {i: k for k, i in enumerate(keep)}
    return [mbs[i] for i in keep], [None if producer_of[i] is None else new[producer_of[i]] for i in keep]


def fill_leaves(out: list[tuple[int, int, dict]], frozen: list, config: PlanConfig
                ) -> tuple[list[tuple[int, int, dict]], int]:
    """The planner's plain microbatches (neither producer nor consumer: whole short trees)
    moved into the window trees' leaves of their replica that have room beside their
    producer's retained rows (`microbatch_tokens - producer_retention x producer rows`, the
    room `chain_windows` gives a leaf), largest first, each into the leaf it fills most
    tightly: the same rows in fewer microbatches. A leaf is a microbatch that produces for
    none; the moved trees read no context. Returns the entries left and how many moved."""
    B, rho = config.microbatch_tokens, config.producer_retention
    overhead = config.cost_model.microbatch_overhead
    producers = {f["m"].producer for _, _, f in out if "m" in f and f["m"].producer is not None}
    plain = [(r, o, f["m"]) for r, o, f in out
             if "m" in f and f["m"].producer is None and f["m"].id not in producers]
    leaves = []  # [replica, entry, room]
    for r, _, f in out:
        if "chain" not in f:
            continue
        k, i = f["chain"]
        fz, producer_of = frozen[k]
        if i in producer_of:
            continue
        p = producer_of[i]
        charge = 0.0 if p is None else consumer_charge(rho * fz[p][3], config.chain_retention, fz[i][0], fz[p][0],
                                                       sum(e - a for _, a, e in fz[i][1]))
        leaves.append([r, f, B - charge - f["tokens"]])
    moved = set()
    for r, o, m in sorted(plain, key=lambda x: (-x[2].executed_tokens, x[0], x[1])):
        fit = [leaf for leaf in leaves if leaf[0] == r and leaf[2] >= m.executed_tokens]
        if not fit:
            continue
        leaf = min(fit, key=lambda leaf: leaf[2])
        f = leaf[1]
        f["pieces"] = tuple(sorted(f["pieces"] + m.pieces))
        f["trajs"] = tuple(sorted(f["trajs"] + m.trajectories))
        f["tokens"] += m.executed_tokens
        f["cost"] += m.cost - overhead
        leaf[2] -= m.executed_tokens
        moved.add((r, o))
    return [e for e in out if (e[0], e[1]) not in moved], len(moved)
