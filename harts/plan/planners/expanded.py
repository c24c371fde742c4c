"""`expanded-ffd`: the baseline. Every trajectory is its own copy; trajectories are packed
first-fit-decreasing by tokens under the budget, which fixes the number of microbatches
(rounded up to a multiple of dp so no slot is left part-empty, and, with a pipeline, at
least `PlanConfig.target_microbatches` per replica, the same floor the tree planners get),
then spread over that many microbatches largest-cost-first into the least-loaded one with
room (empty ones dropped), and placed so each slot holds similar loads."""

from __future__ import annotations

import numpy as np

from harts.config.plan import PlanConfig
from harts.plan.plan import Microbatch, Plan, PlanMode, forest_digest
from harts.plan.planners.common import first_fit_decreasing, lpt_balanced, place_sorted, round_up
from harts.plan.planners.registry import PlannerName, register_planner
from harts.tree.forest import RolloutForest


@register_planner(PlannerName.EXPANDED_FFD)
def plan_expanded_ffd(forest: RolloutForest, config: PlanConfig) -> Plan:
    cm = config.cost_model
    lengths = forest.traj_length
    budget = config.microbatch_tokens
    if lengths.size and int(lengths.max()) > budget:
        t = int(np.argmax(lengths))
        raise ValueError(
            f"trajectory {forest.traj_ids[t]!r} has {int(lengths[t])} tokens, more than the "
            f"microbatch budget {budget}: raise --microbatch-tokens"
        )
    size = lengths.tolist()
    cost = cm.segment_cost(np.zeros(lengths.size), lengths).tolist()
    items = list(range(len(size)))
    ffd = first_fit_decreasing(items, size, budget)
    num_bins = round_up(len(ffd), config.dp)
    if config.pp > 1:
        num_bins = max(num_bins, config.dp * config.target_microbatches)
    bins = lpt_balanced(items, cost, size, num_bins, budget) or ffd
    bins = [b for b in bins if b]
    mb_cost = [cm.microbatch_overhead + sum(cost[t] for t in b) for b in bins]
    where = place_sorted(mb_cost, config.dp)
    ranked = sorted(range(len(bins)), key=lambda i: (where[i][0], where[i][1]))
    mbs = []
    order_on: dict[int, int] = {}
    for new, i in enumerate(ranked):
        r, s = where[i]
        o = order_on.get(r, 0)
        order_on[r] = o + 1
        trajs = tuple(sorted(bins[i]))
        tokens = sum(size[t] for t in trajs)
        mbs.append(Microbatch(id=new, replica=r, slot=s, order=o, trajectories=trajs,
                              executed_tokens=tokens, expanded_tokens=tokens, cost=mb_cost[i]))
    return Plan(
        mode=PlanMode.EXPANDED,
        planner=PlannerName.EXPANDED_FFD.value,
        dp=config.dp,
        microbatch_tokens=budget,
        microbatches=tuple(mbs),
        producer_retention=config.producer_retention,
        chain_retention=config.chain_retention,
        cost_model=cm.spec(),
        seed=config.seed,
        forest=forest_digest(forest),
        info={"ffd_microbatches": len(ffd)},
    )
