"""`ortools-ffd`: the prior art's tree partitioning (Tree Training style), as strong as we
can honestly make it.

Units are whole trees when they fit and subtrees with their recomputed root path
otherwise (`tree_units`, the same partitioning L1 starts from); there is no
cross-microbatch sharing. First-fit-decreasing packs the units (units of one tree share
their path when they land together) and fixes the number of microbatches, rounded up to a
multiple of dp. CP-SAT then reassigns units to those microbatches minimising the largest
microbatch loads' deviation from their mean first and the recomputed path tokens
second, seeded with the FFD packing
as a hint, under a deterministic time limit (`time_limit`, CP-SAT's deterministic-time
units, roughly seconds; one worker, seeded, so the same seed gives the same plan). On a
timeout without an improvement the hint itself is the answer, so the planner always
returns a feasible plan. Microbatches are then aligned into slots like every planner's.
"""

from __future__ import annotations

from collections import defaultdict

from harts.config.plan import PlanConfig
from harts.plan.plan import Plan
from harts.plan.planners.common import (
    ForestIndex,
    TreeMB,
    ffd_units,
    finalize_tree,
    lpt_balanced,
    round_up,
    tree_units,
)
from harts.plan.planners.l1 import place
from harts.plan.planners.registry import PlannerName, register_planner
from harts.tree.forest import RolloutForest

# balance dominates: one token-equivalent of load deviation outweighs this many recomputed
# tokens
_BALANCE_WEIGHT = 100


def _solve(idx, units, hint, num_bins, budget, config) -> tuple[list[int], str]:
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    n = len(units)
    # symmetry breaking: with units ranked by size, the unit of rank k uses a bin <= k
    # (bins are interchangeable); relabelling the hint's bins by first use keeps it valid
    order = sorted(range(n), key=lambda i: (-units[i].tokens, i))
    rank = {u: k for k, u in enumerate(order)}
    relabel: dict[int, int] = {}
    for u in order:
        relabel.setdefault(hint[u], len(relabel))
    hint = [relabel[b] for b in hint]
    x: dict[tuple[int, int], cp_model.IntVar] = {}
    for u in range(n):
        for b in range(min(num_bins, rank[u] + 1)):
            x[u, b] = model.new_bool_var(f"x{u}_{b}")
    for u in range(n):
        model.add_exactly_one(x[u, b] for b in range(min(num_bins, rank[u] + 1)))
    # path nodes shared by several units of one split tree
    users: dict[int, list[int]] = defaultdict(list)
    for u, unit in enumerate(units):
        for w in unit.path:
            users[w].append(u)
    y: dict[tuple[int, int], cp_model.IntVar] = {}
    for w, us in users.items():
        for b in range(num_bins):
            xs = [x[u, b] for u in us if (u, b) in x]
            if not xs:
                continue
            y[w, b] = model.new_bool_var(f"y{w}_{b}")
            for xv in xs:
                model.add_implication(xv, y[w, b])
    sub_tokens = [unit.tokens - unit.path_tokens for unit in units]
    sub_cost = [round(unit.cost - unit.path_cost) for unit in units]
    node_cost = {w: round(idx.node_cost[w]) for w in users}
    total_cost = sum(sub_cost) + sum(node_cost[w] * len(us) for w, us in users.items())
    hint_bins = defaultdict(set)
    for u, b in enumerate(hint):
        hint_bins[b].update(units[u].path)
    total_hint_cost = sum(sub_cost) + sum(node_cost[w] for ws in hint_bins.values() for w in ws)
    # balance: the summed absolute deviation of microbatch loads from their mean (the mean
    # of the hint: recomputation moves it by little); a max-load objective alone is
    # satisfied by the largest unit and leaves the other microbatches unbalanced
    mean = round(total_hint_cost / num_bins)
    deviation = []
    for b in range(num_bins):
        xs = [(u, x[u, b]) for u in range(n) if (u, b) in x]
        ys = [(w, y[w, b]) for w in users if (w, b) in y]
        model.add(
            sum(sub_tokens[u] * v for u, v in xs) + sum(idx.length[w] * v for w, v in ys) <= budget
        )
        load = sum(sub_cost[u] * v for u, v in xs) + sum(node_cost[w] * v for w, v in ys)
        d = model.new_int_var(0, total_cost, f"d{b}")
        model.add(d >= load - mean)
        model.add(d >= mean - load)
        deviation.append(d)
    recomputed = sum(idx.length[w] * v for (w, _), v in y.items())
    model.minimize(_BALANCE_WEIGHT * sum(deviation) + recomputed)
    for (u, b), v in x.items():
        model.add_hint(v, hint[u] == b)
    for (w, b), v in y.items():
        model.add_hint(v, any(hint[u] == b for u in users[w]))
    solver = cp_model.CpSolver()
    p = solver.parameters
    p.num_workers = 1
    p.random_seed = config.seed
    p.max_deterministic_time = config.time_limit
    # a wall-clock guard only: the deterministic limit is the one meant to bind
    p.max_time_in_seconds = 10.0 * config.time_limit
    status = solver.solve(model)
    name = solver.status_name(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return hint, name
    return [next(b for b in range(num_bins) if (u, b) in x and solver.value(x[u, b])) for u in range(n)], name


@register_planner(PlannerName.ORTOOLS_FFD)
def plan_ortools_ffd(forest: RolloutForest, config: PlanConfig) -> Plan:
    idx = ForestIndex(forest, config.cost_model)
    budget = config.microbatch_tokens
    idx.check_fits(budget)
    units = tree_units(idx, budget)
    ffd = ffd_units(idx, units, budget)
    num_bins = round_up(max(ffd) + 1, config.dp)
    # the FFD count rounded up to full slots leaves bins empty; spreading the units over
    # all of them largest-first (tokens summed, paths not shared, so it is feasible) is
    # the balanced FFD a DP trainer would use, and the better starting point
    spread = lpt_balanced(
        list(range(len(units))), [u.cost for u in units], [u.tokens for u in units], num_bins, budget
    )
    hint = ffd
    if spread is not None:
        hint = [0] * len(units)
        for b, members in enumerate(spread):
            for u in members:
                hint[u] = b
    where, status = _solve(idx, units, hint, num_bins, budget, config)
    bins = [TreeMB() for _ in range(num_bins)]
    for u, b in zip(units, where, strict=True):
        bins[b].add_unit(idx, u)
    mbs = [b for b in bins if b.rows]
    place(mbs, config.dp)
    info = {"units": len(units), "ffd_microbatches": max(ffd) + 1, "cp_sat_status": status}
    return finalize_tree(idx, mbs, config, PlannerName.ORTOOLS_FFD.value, info)
