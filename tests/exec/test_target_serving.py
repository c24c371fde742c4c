"""Targets served where their rows are computed (`serving_microbatch`): every target once,
by a microbatch that computes its hidden row and whose computation its trajectory uses,
so a window plan forms each row's logits exactly once, as the unsplit tree does (L1's plan,
which l1l2 returns where no window fits, once per microbatch computing the row)."""

import numpy as np
from hypothesis import example, given, settings

from harts.exec.layouts.plan import piece_rows, serving_microbatch
from harts.plan.planners import PlanConfig, make_plan
from harts.tree import build_forest, shapes
from tests.strategies import shape_instances


@settings(max_examples=12, deadline=None)
@given(shape_instances())
@example(("swe-tree", 91, 1024))  # no window fits: L1's plan
def test_each_row_logits_once_and_every_target_served(instance):
    family, seed, budget = instance
    forest = build_forest(shapes.draw(family, seed, budget, vocab_size=512))
    plan = make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=budget, chunk_size=64))
    targets = forest.targets()
    mbs = {m.id: m for m in plan.microbatches}
    computed = {m.id: piece_rows(forest, m.pieces) for m in plan.microbatches}
    served = serving_microbatch(targets, plan.microbatches, computed, mbs)
    assert (served >= 0).all()
    owner = np.empty(forest.num_trajectories, np.int64)
    for m in plan.microbatches:
        owner[np.asarray(m.trajectories, np.int64)] = m.id
    rows_formed = 0
    for m in plan.microbatches:
        mine = served == m.id
        # its rows, and a computation its target's trajectory uses: its own microbatch's
        # or one of the producers up that microbatch's chain
        assert np.isin(targets.row[mine], computed[m.id]).all()
        for t in np.unique(targets.traj[mine]):
            chain, p = [], int(owner[t])
            while p is not None:
                chain.append(p)
                p = mbs[p].producer
            assert m.id in chain
        rows_formed += np.unique(targets.row[mine]).size
    if sum(c.size for c in computed.values()) == forest.compact_tokens:  # every row computed once
        assert rows_formed == np.unique(targets.row).size
    else:
        # no window fits the budget (trajectories nearly as long as it): l1l2 returns L1's
        # plan, each trajectory's rows computed in its own microbatch, which forms the
        # logits of the rows its trajectories read, once per microbatch
        assert plan.info.get("chosen") == "l1" and not plan.consumers()
        assert rows_formed == sum(np.unique(targets.row[np.isin(targets.traj, np.asarray(m.trajectories))]).size
                                  for m in plan.microbatches)
