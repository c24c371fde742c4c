"""`l1`: HARTS level 1, compression-oriented microbatches.

Trees are kept whole when they fit the budget; larger ones are split at the highest node
whose child subtrees fit beside the shared path, siblings grouped so they share it
(`tree_units`). Units are then dealt into dp x S microbatches (S the smallest slot count
that works, starting from the compact-token lower bound): largest cost first, into a
microbatch that already holds part of the same tree when the union fits (the shared path
is then computed once), otherwise into the least-loaded microbatch with room. Equal-sized
microbatches are then aligned into slots (`place_sorted`). With a pipeline
(`PlanConfig.pp` > 1) S starts at `PlanConfig.target_microbatches`; L1 does not split
trees further for it (that would recompute their paths), so with fewer units than
dp x S some microbatches stay empty and are dropped.
"""

from __future__ import annotations

import math

from harts.config.plan import PlanConfig
from harts.plan.plan import Plan
from harts.plan.planners.common import (
    ForestIndex,
    TreeMB,
    Unit,
    ffd_units,
    finalize_tree,
    lpt_balanced,
    place_sorted,
    tree_units,
)
from harts.plan.planners.registry import PlannerName, register_planner
from harts.tree.forest import RolloutForest


def pack_units(idx: ForestIndex, units: list[Unit], num_bins: int, budget: int) -> list[TreeMB] | None:
    """Deal units into `num_bins` microbatches (see the module doc); None if one fits nowhere."""
    bins = [TreeMB() for _ in range(num_bins)]
    holds: list[set[int]] = [set() for _ in range(num_bins)]  # trees present per bin
    for u in sorted(units, key=lambda u: (-u.cost, u.tree, u.path, u.subtrees)):
        best, best_key = -1, None
        for b, mb in enumerate(bins):
            if u.path and u.tree in holds[b]:
                new = mb.union_tokens(idx, u)
                if new > budget:
                    continue
                key = (0, -(mb.tokens + u.tokens - new), mb.cost)
            else:
                if mb.tokens + u.tokens > budget:
                    continue
                key = (1, 0, mb.cost)
            if best_key is None or key < best_key:
                best, best_key = b, key
        if best < 0:
            return None
        bins[best].add_unit(idx, u)
        holds[best].add(u.tree)
    return [b for b in bins if b.rows]


def l1_microbatches(idx: ForestIndex, config: PlanConfig) -> tuple[list[TreeMB], list[Unit]]:
    budget = config.microbatch_tokens
    idx.check_fits(budget)
    units = tree_units(idx, budget)
    # first-fit-decreasing by tokens bounds the slot count from above: L1 never needs
    # more slots than a plain FFD packing of the same units
    ffd = ffd_units(idx, units, budget)
    # with a pipeline, at least `target_microbatches` slots: whole units are spread over
    # that many microbatches (no tree is split further, which would recompute its path);
    # empty microbatches are dropped, so fewer units than slots give fewer microbatches
    target = config.target_microbatches
    ffd_slots = max(math.ceil((max(ffd) + 1) / config.dp), target)
    lower = max(1, math.ceil(idx.forest.compact_tokens / (config.dp * budget)), target)
    for slots in range(min(lower, ffd_slots), ffd_slots + 1):
        bins = pack_units(idx, units, config.dp * slots, budget)
        if bins is not None:
            return bins, units
    # the FFD packing, its units spread largest-cost-first over all dp x S microbatches
    # when the summed tokens allow, as is otherwise
    spread = lpt_balanced(
        list(range(len(units))), [u.cost for u in units], [u.tokens for u in units],
        config.dp * ffd_slots, budget,
    )
    groups: dict[int, list[int]] = {}
    if spread is not None:
        groups = dict(enumerate(spread))
    else:
        for u, b in enumerate(ffd):
            groups.setdefault(b, []).append(u)
    bins = []
    for members in groups.values():
        if members:
            mb = TreeMB()
            for u in members:
                mb.add_unit(idx, units[u])
            bins.append(mb)
    return bins, units


def place(mbs: list[TreeMB], dp: int) -> None:
    """Slot-aligned placement of standalone microbatches (orders follow slots)."""
    where = place_sorted([m.cost for m in mbs], dp)
    for m, (r, s) in zip(mbs, where, strict=True):
        m.replica, m.slot = r, s
    for r in range(dp):
        mine = sorted((m for m in mbs if m.replica == r), key=lambda m: m.slot)
        for o, m in enumerate(mine):
            m.order = o


@register_planner(PlannerName.L1)
def plan_l1(forest: RolloutForest, config: PlanConfig) -> Plan:
    idx = ForestIndex(forest, config.cost_model)
    mbs, units = l1_microbatches(idx, config)
    place(mbs, config.dp)
    return finalize_tree(idx, mbs, config, PlannerName.L1.value, {"units": len(units)})
