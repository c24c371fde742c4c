"""Cells to microbatches: per cell, its producer (trunk nodes, every item's shaved
prefix and the items it takes whole) placed just before its first consumer, then each
slot's consumer (its items' rows, reading the producer's rows as context). Order per
cell: slots that do not read the producer, the producer, its first consumer, the other
slots, the last consumer; the producer's backward follows the last consumer (the
executor's window)."""

from __future__ import annotations

from harts.plan.planners.common import ForestIndex, TreeMB
from harts.plan.planners.l1l2.cell import Cell, Item


def to_microbatches(idx: ForestIndex, cells: list[list[Cell]]) -> list[TreeMB]:
    """The microbatches of every replica's cells, placed (replica, slot, order) and each
    consumer pointing at its cell's producer."""
    mbs: list[TreeMB] = []
    for r, row in enumerate(cells):
        slot0 = 0
        order = 0
        for c in row:
            trunk = set(c.trunk)
            has_p = bool(c.trunk) or any(it.shaved_tokens for b in c.bins for it in b)
            prod: TreeMB | None = None
            prod_id = -1
            if has_p:
                prod = TreeMB()
                for v in c.trunk:
                    prod.add_node(idx, v)
                    prod.trajs.extend(idx.ends_here[v])
                for it in c.taken:  # computed whole by the producer, its trajectories its own
                    for v in range(it.root, idx.sub_end[it.root] + 1):
                        prod.add_node(idx, v)
                    prod.trajs.extend(idx.trajs_in_subtree(it.root))
            for b in range(c.k):
                if not c.bins[b]:
                    continue
                m = TreeMB()
                for it in c.bins[b]:
                    add_item(idx, m, prod, it, trunk)
                if m.context:
                    if prod_id < 0:
                        prod.replica, prod.slot, prod.order = r, slot0 + b, order
                        order += 1
                        prod_id = len(mbs)
                        mbs.append(prod)
                    m.producer = prod_id
                m.replica, m.slot, m.order = r, slot0 + b, order
                order += 1
                mbs.append(m)
            slot0 += c.k
    return mbs


def add_item(idx: ForestIndex, m: TreeMB, prod: TreeMB | None, it: Item, trunk: set[int]) -> None:
    """Rows of item `it` to consumer m (context from the producer), its prefix to prod."""
    for u in it.full:
        prod.add_node(idx, u)
        m.context[u] = (0, idx.length[u])
    if it.cut_node >= 0:
        u, o = it.cut_node, it.cut_off
        prod.rows[u] = (0, o)
        prod.tokens += o
        m.context[u] = (0, o)
        m.rows[u] = (o, idx.length[u])
        m.tokens += idx.length[u] - o
    skip = set(it.full)
    for u in range(it.root, idx.sub_end[it.root] + 1):
        if u not in skip and u != it.cut_node:
            m.add_node(idx, u)
    m.trajs.extend(idx.trajs_in_subtree(it.root))
    u = idx.parent[it.root]
    while u >= 0 and u in trunk and u not in m.context:
        m.context[u] = (0, idx.length[u])
        u = idx.parent[u]
